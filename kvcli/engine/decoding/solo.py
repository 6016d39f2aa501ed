"""Rows one at a time on the document's own cache, with the model's own attention.

For a model whose batched (cascade) path was not proven exact when it loaded (engine/scheduling/probe.py), the
engine decodes each document's rows through this one at a time: the same rows, choosers, streams and
counts as engine/decoding/batch.py's BatchDecoder, on the Session's KVCache (rewound to the document after each
row, so nothing is copied), with the attention kernels plain generate() would use. A one-row step on several
torch threads runs one of three ways, whichever its steps measure fastest (engine/model/cpu.py's Faster, kept by
the engine's CpuTuning): the engine's OpenMP workers spin between parallel regions and float32 products are split
across the cores (engine/model/linear.py), or they spin and each product runs as torch runs it, or the workers
sleep (CpuTuning.pool_beside) and products run whole. Spinning wins on idle cores, split or whole depending on the
CPU; sleeping wins beside busy processes, where a spinning worker waits for a peer the OS has not scheduled. All
give the same bits.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .protocol import Row, RowQueue, take
from ..model.cpu import SLEEP, SPLIT, CpuTuning
from ..model.linear import pool_beside_helps, split_rows_helps


class OneRowDecoder(RowQueue):
    """engine/decoding/protocol.py's Decoder for one row at a time on `cache` (engine/cache/kvcache.KVCache),
    rewound to the document whenever a row leaves."""

    def __init__(self, model: Any, cache: Any, *, eos: set[int], length: int | None = None, cpu: CpuTuning | None = None):
        pending = len(cache.pending.ids) if cache.pending else 0  # the document's tokens the first row's pass runs
        # lengths only: each layer waits for its restore when read
        super().__init__(model, cache.states(wait=False), eos, None if length is None else length - pending)
        self.cache = cache
        self.device = model.device
        self._keep = {"logits_to_keep": 1} if self.keeps_logits else {}  # the lm head at the last id only
        self.split = split_rows_helps(model)  # float32 products that split_rows can cut
        self.cpu = cpu or CpuTuning()  # the engine's: its ways carry the times over from earlier rows
        self.ways = self.cpu.ways if pool_beside_helps(model) else None  # SPLIT, WHOLE or SLEEP (engine/model/cpu.py)

    def _leave(self, row: Row) -> None:
        self.cache.rewind()

    def step(self) -> list[Row]:
        """One forward pass: the next row's appended ids, or one new token of the running row."""
        with torch.inference_mode():
            if not self.active:
                if not self.waiting:
                    return []
                row = self.waiting.pop(0)
                self.cache.rewind()
                pending = len(self.cache.pending.ids) if self.cache.pending else 0
                self.cache.ensure(pending + len(row.appended) + row.max_new)  # grown once, if at all
                self.active = [row]
                ids = row.appended
            else:
                row = self.active[0]
                ids = [row.answer[-1]]
            # the document's pending tokens in front of a question's ids (one pass for both: kvcache.Pending), else
            # the ids [1, q] and every position so far as generate() passes it: prompt + answer ids
            inputs = self.cache.forward_inputs(ids, self.device) if ids is row.appended else None
            inputs = inputs or {"input_ids": torch.tensor([ids], device=self.device), "attention_mask": torch.ones(
                (1, len(row.prompt) + len(row.answer)), dtype=torch.long, device=self.device)}
            try:
                way = self.ways.pick() if self.ways is not None and inputs["input_ids"].shape[1] == 1 else None
                if way is not None:
                    self.cpu.pool_beside(way == SLEEP)
                t0 = time.perf_counter()
                with self.cpu.split_rows(way == SPLIT and self.split):
                    out = self.model(**inputs, cache=self.cache, use_cache=True, **self._keep)
                if way is not None:
                    self.ways.record(way, time.perf_counter() - t0)
                if "position_ids" in inputs:
                    self.cache.settled()
            except BaseException:  # the row stays held (waiting again, or active) for the caller to drop
                self.cache.rewind()
                if ids is row.appended:
                    self.active = []
                    self.waiting.insert(0, row)
                raise
            self.last_rows = 1
            row.processed = self.cache.processed
            take(row, out.logits[0, -1].float(), self.eos)
        return self._finished()
