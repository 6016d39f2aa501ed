"""Rows one at a time on the document's own cache, with the model's own attention.

For a model whose batched (cascade) path was not proven exact when it loaded (engine/scheduling/probe.py), the
engine decodes each document's rows through this one at a time: the same rows, choosers, streams and
counts as engine/decoding/batch.py's BatchDecoder, on the Session's KVCache (rewound to the document after each
row, so nothing is copied), with the attention kernels plain generate() would use. A one-row step on several
torch threads runs one of two ways, whichever its steps measure faster (Faster): the engine's OpenMP workers
spin between parallel regions and float32 products are split across the cores (engine/model/linear.py), or the
workers sleep (linear.pool_beside) and each product runs as torch runs it. Spinning wins on idle cores;
sleeping wins beside busy processes, where a spinning worker waits for a peer the OS has not scheduled. Both
ways give the same bits.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .protocol import Row, RowQueue, take
from ..model.linear import pool_beside, pool_beside_helps, split_rows, split_rows_helps


class OneRowDecoder(RowQueue):
    """engine/decoding/protocol.py's Decoder for one row at a time on `cache` (engine/cache/kvcache.KVCache),
    rewound to the document whenever a row leaves."""

    def __init__(self, model: Any, cache: Any, *, eos: set[int], length: int | None = None, ways: Faster | None = None):
        super().__init__(model, cache.states(wait=False), eos, length)  # lengths only: each layer waits for its restore when read
        self.cache = cache
        self.device = model.device
        self._keep = {"logits_to_keep": 1} if self.keeps_logits else {}  # the lm head at the last id only
        self.split = split_rows_helps(model)  # float32 products that split_rows can cut
        # True: workers spin (products split), False: they sleep; `ways` carries the times over from earlier rows
        self.ways = (ways or Faster()) if pool_beside_helps(model) else None

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
                way = self.ways.pick() if self.ways is not None and len(ids) == 1 else None
                if way is not None:
                    pool_beside(not way)
                t0 = time.perf_counter()
                with split_rows(bool(way) and self.split):
                    out = self.model(input_ids=input_ids, attention_mask=mask, cache=self.cache, use_cache=True,
                                     **self._keep)
                if way is not None:
                    self.ways.record(way, time.perf_counter() - t0)
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


class Faster:
    """Which of two ways of running a step is faster here and now, by the steps' own times (both give the same
    bits, so the choice never changes an answer). Each way is tried once, then the way with the lower median of
    its last few steps runs, and the other is tried again now and then: first after `every` steps, each time it
    loses again after twice as many, up to `most` (a try costs one slow step, so a machine that stays as it is
    pays for few of them). Two running steps in a row that take `jump` times the way's median (the machine got
    busier; one such step is noise) have the other tried at the next step, against the last one's time. A try
    that wins takes over at once (the older times are of another state of the machine), and the next try comes
    after `every` steps again."""

    def __init__(self, every: int = 16, most: int = 256, keep: int = 5, jump: float = 1.5):
        self.every, self.most, self.keep, self.jump = every, most, keep, jump
        self.times: dict[bool, list[float]] = {True: [], False: []}  # way -> its last `keep` step times, s
        self.steps = 0
        self.gap = every  # steps from a try of the other way to the next
        self.due = 0  # the step at which the other way is tried next
        self.slow = 0  # the running way's last steps in a row that took `jump` times its median
        self.jumped = False  # two of them: the next step tries the other way, held against the last one's time

    def _median(self, way: bool) -> float:
        times = sorted(self.times[way])
        return times[len(times) // 2]

    def best(self) -> bool:
        return min(self.times, key=self._median)

    def pick(self) -> bool:
        self.steps += 1
        for way in (True, False):
            if not self.times[way]:
                return way
        best = self.best()
        return (not best) if self.steps >= self.due else best

    def record(self, way: bool, seconds: float) -> None:
        if not self.times[way] or not self.times[not way]:  # a way's first time: nothing to compare yet
            self.times[way].append(seconds)
            self.due = self.steps + self.every
            return
        running = self.best()
        if way == running:
            self.slow = self.slow + 1 if seconds > self.jump * self._median(way) else 0
            self.jumped = self.slow >= 2  # twice in a row: a busier machine, not one step's noise
            if self.jumped:
                self.due = self.steps + 1
            self.times[way] = (self.times[way] + [seconds])[-self.keep:]
            return
        now = self.times[running][-1] if self.jumped else self._median(running)
        if seconds < now:  # the try won
            self.times[way], self.gap = [seconds], self.every
            if self.jumped:
                self.times[running] = [now]
        else:
            self.times[way] = (self.times[way] + [seconds])[-self.keep:]
            self.gap = min(2 * self.gap, self.most)
        self.due, self.jumped, self.slow = self.steps + self.gap, False, 0
