"""A thread that waits while another computes gives back its OpenMP workers (engine/model/openmp.py).

The speed this buys is measured by tests/bench/bench_handoff.py, never here; these tests check that the pool
really goes (its worker threads end), that parallel kernels still compute right afterwards in any
thread, and that the engine's asker and the engine thread both give theirs back around a question.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kvcli
from kvcli.engine.model import openmp
from kvcli.engine.scheduling.scheduler import Engine

TASKS = Path("/proc/self/task")
needs_pool = pytest.mark.skipif(not TASKS.exists() or not openmp._runtime(),
                                reason="needs Linux's /proc and torch on libgomp (the pool to give back)")


def _threads() -> int:
    return len(os.listdir(TASKS))


def _parallel_work() -> float:
    """A kernel big enough for torch to run it in an OpenMP parallel region; its exact result."""
    t = torch.ones(1 << 22)
    t.add_(1)
    return float(t.sum())


@needs_pool
def test_release_ends_this_threads_workers_and_kernels_still_compute():
    seen = {}
    threads = torch.get_num_threads()  # 1 under the suite's workers (conftest): this test wants a pool of 2

    def worker() -> None:
        torch.set_num_threads(2)
        before = _threads()
        seen["first"] = _parallel_work()
        seen["with_pool"] = _threads()
        seen["released"] = openmp.release()
        deadline = time.monotonic() + 5
        while _threads() > before and time.monotonic() < deadline:  # its workers end
            time.sleep(0.01)
        seen["after"], seen["before"] = _threads(), before
        seen["again"] = _parallel_work()  # a fresh pool, same arithmetic

    t = threading.Thread(target=worker)
    try:
        t.start()
        t.join(timeout=60)
    finally:
        torch.set_num_threads(threads)
    assert seen["first"] == seen["again"] == 2.0 * (1 << 22)
    assert seen["with_pool"] > seen["before"]  # the parallel region made workers for this thread
    assert seen["released"] is True
    assert seen["after"] == seen["before"]
    assert _parallel_work() == 2.0 * (1 << 22)  # and in the main thread


def test_release_is_a_no_op_before_torch_is_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    assert openmp.release() is False


def test_asker_and_engine_thread_both_give_back_their_pools(arch, monkeypatch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    want = session.ask("What does the word Licensor mean?", kvcli.GenerationOptions(max_new_tokens=6))
    calls: list[str] = []
    real = openmp.release

    def spy() -> bool:
        calls.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(openmp, "release", spy)
    engine = Engine(a.lm, width=4)
    try:
        got = engine.ask(session, ["What does the word Licensor mean?"], kvcli.GenerationOptions(max_new_tokens=6))[0]
        deadline = time.monotonic() + 30
        while "kvcli-engine" not in calls and time.monotonic() < deadline:  # the engine gives its back once idle
            time.sleep(0.01)
        with engine.turn():  # a turn: the engine thread waits, so it gave its pool back first
            pass
    finally:
        engine.close()
    assert got.answer_token_ids == want.answer_token_ids  # same answer, pools or not
    assert threading.current_thread().name in calls  # the asker, once its question was with the engine
    assert calls.count("kvcli-engine") >= 2  # idle, and before the turn
    assert calls.count(threading.current_thread().name) >= 2  # after submitting, and after its turn
