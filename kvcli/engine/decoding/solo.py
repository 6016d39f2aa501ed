"""Rows one at a time on the document's own cache, with the model's own attention.

For a model whose batched (cascade) path was not proven exact when it loaded (engine/scheduling/probe.py), the
engine decodes each document's rows through this one at a time: the same rows, choosers, streams and
counts as engine/decoding/batch.py's Decoder, on the Session's KVCache (rewound to the document after each
row, so nothing is copied), with the attention kernels plain generate() would use.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from .batch import Row, check_lengths, take


class SoloDecoder:
    """Decoder's interface (add, drop, step, busy) for one row at a time on `cache` (engine/kvcache.KVCache)."""

    width = 1

    def __init__(self, model: Any, cache: Any, *, eos: set[int], length: int | None = None):
        check_lengths(cache.states(), length)
        self.model, self.cache, self.eos = model, cache, eos
        self.device = model.device
        self.waiting: list[Row] = []
        self.active: list[Row] = []
        self.last_rows = 0
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._keep = {"logits_to_keep": 1} if keeps else {}  # the lm head at the last id only, if the model allows

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def drop(self, row: Row) -> None:
        if row in self.waiting:
            self.waiting.remove(row)
        elif row in self.active:
            self.active.remove(row)
            self.cache.rewind()

    def step(self) -> list[Row]:
        """One forward pass: the next row's appended ids, or one new token of the running row."""
        with torch.inference_mode():
            if not self.active:
                if not self.waiting:
                    return []
                row = self.waiting.pop(0)
                self.cache.rewind()
                self.cache.ensure(len(row.appended) + row.max_new)  # the question and its whole answer: grown once, if at all
                self.active = [row]
                ids = row.appended
            else:
                row = self.active[0]
                ids = [row.answer[-1]]
            input_ids = torch.tensor([ids], device=self.device)  # [1, q]
            # every position so far, as generate() passes it: prompt + answer ids
            mask = torch.ones((1, len(row.prompt) + len(row.answer)), dtype=torch.long, device=self.device)
            try:
                out = self.model(input_ids=input_ids, attention_mask=mask, cache=self.cache, use_cache=True, **self._keep)
            except BaseException:
                self.active = []
                self.cache.rewind()
                if ids is row.appended:
                    self.waiting.insert(0, row)
                raise
            self.last_rows = 1
            row.processed = self.cache.processed
            take(row, out.logits[0, -1].float(), self.eos)
        if not row.finish_reason:
            return []
        row.finished_at = time.perf_counter()
        self.active = []
        self.cache.rewind()
        return [row]
