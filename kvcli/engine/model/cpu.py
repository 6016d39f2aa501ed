"""One owner of how an engine's work uses the CPU: OpenMP pools, split products, the way one-row steps run.

The Engine (engine/scheduling/scheduler.py) holds one CpuTuning and hands it to its decoders; nothing here is
process-wide, so two engines (two models in one warm server) tune apart and closing an engine ends its helper
thread. The model's own modules are untouched: SplitLinear layers (engine/model/linear.py) split a one-row
product only inside `split_rows`, checked against this owner's record of which shapes give torch's bits.
"""

from __future__ import annotations

import queue
import threading
from contextlib import AbstractContextManager
from typing import Any

import torch

from . import linear, openmp

# The ways a one-row step can run (Faster picks): workers spinning with SplitLinear's products split across them,
# spinning with products whole, or sleeping (a pool beside the engine's) with products whole.
SPLIT, WHOLE, SLEEP = "split", "whole", "sleep"


class CpuTuning:
    """release(): this thread is about to wait while another computes (its OpenMP pool goes: openmp.py).
    ways: which way one-row steps run fastest here (Faster over SPLIT, WHOLE, SLEEP), measured across every row of
    the engine's model.
    split_rows(on): a `with` block in which SplitLinear's one-row products split across the threads.
    pool_beside(on): an OpenMP pool held by a helper thread beside the engine's (workers sleep), or none (they spin).
    close(): the helper thread, if any, gives its pool back and ends."""

    def __init__(self) -> None:
        self.ways = Faster(ways=(SPLIT, WHOLE, SLEEP))
        self.same_bits: dict[tuple, bool] = {}  # (weight shape, bias or not) -> split_product gave linear's bits
        self._jobs: queue.SimpleQueue | None = None  # the helper thread's, once pool_beside first ran
        self._pool_on = False  # the helper holds an OpenMP pool of its own
        self._lock = threading.Lock()

    @staticmethod
    def release() -> bool:
        return openmp.release()

    def split_rows(self, enabled: bool = True) -> AbstractContextManager[None]:
        return linear.split_rows(self.same_bits if enabled else None)

    def pool_beside(self, on: bool) -> None:
        """An OpenMP pool in the helper thread (on) or none (off). libgomp's idle workers spin between parallel
        regions only while its pools hold no more threads than there are CPUs: with the helper's pool beside the
        engine's they sleep instead. Spinning is faster on idle cores, sleeping far steadier beside busy processes
        (docs/performance.md), so a step picks by its own times (engine/decoding/solo.py). The bits are the same."""
        if on == self._pool_on:
            return
        self._in_helper(_open_pool if on else openmp.release, 1.0)  # not scheduled in time: it happens soon
        self._pool_on = on

    def close(self) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.put(None)
        self._pool_on = False

    def _in_helper(self, job, timeout: float) -> None:
        """Run `job` in the helper thread (started on first use) and wait for it, at most `timeout` seconds."""
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._jobs,), name="kvcli-rows", daemon=True).start()
            jobs = self._jobs
        done = threading.Event()
        jobs.put(lambda: (job(), done.set()))
        done.wait(timeout)


def _serve(jobs: queue.SimpleQueue) -> None:
    """The helper thread: runs its jobs in order until None, then gives its pool back."""
    while (job := jobs.get()) is not None:
        job()
    openmp.release()


def _open_pool() -> None:
    """One parallel region in this thread: the OpenMP runtime gives it a pool of its own (torch's elementwise
    kernels go parallel from 32,768 elements)."""
    with torch.inference_mode():
        torch.ones(1 << 20).add_(1)


class Faster:
    """Which of a few ways of running a step is fastest here and now, by the steps' own times (all give the same
    bits, so the choice never changes an answer). Each way is tried once, then the way with the lowest median of
    its last few steps runs, and another (the one tried longest ago) is tried again now and then: first after `every` steps, each time it
    loses again after twice as many, up to `most` (a try costs one slow step, so a machine that stays as it is
    pays for few of them). Two running steps in a row that take `jump` times the way's median (the machine got
    busier; one such step is noise) have the other tried at the next step, against the last one's time. A try
    that wins takes over at once (the older times are of another state of the machine), and the next try comes
    after `every` steps again."""

    def __init__(self, every: int = 16, most: int = 256, keep: int = 5, jump: float = 1.5, ways: tuple = (True, False)):
        self.every, self.most, self.keep, self.jump = every, most, keep, jump
        self.times: dict[Any, list[float]] = {way: [] for way in ways}  # way -> its last `keep` step times, s
        self.tried: dict[Any, int] = {}  # way -> the step it was last tried at
        self.steps = 0
        self.gap = every  # steps from a try of the other way to the next
        self.due = 0  # the step at which the other way is tried next
        self.slow = 0  # the running way's last steps in a row that took `jump` times its median
        self.jumped = False  # two of them: the next step tries the other way, held against the last one's time

    def _median(self, way: Any) -> float:
        times = sorted(self.times[way])
        return times[len(times) // 2]

    def best(self) -> Any:
        return min(self.times, key=self._median)

    def pick(self) -> Any:
        self.steps += 1
        for way, times in self.times.items():
            if not times:
                return way
        best = self.best()
        if self.steps < self.due:
            return best
        other = min((w for w in self.times if w != best), key=lambda w: self.tried.get(w, -1))
        self.tried[other] = self.steps
        return other

    def record(self, way: Any, seconds: float) -> None:
        if not all(self.times.values()):  # a way's first time: nothing to compare yet
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
