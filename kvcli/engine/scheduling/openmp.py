"""Handing the CPU's OpenMP workers from one thread to another: a thread about to wait gives back its pool.

OpenMP runtimes keep a pool of worker threads for every thread that has run a parallel region (torch's
kernels, MKL). libgomp (torch's on Linux) spins idle workers between regions only while the pools hold
no more threads than there are CPUs; one pool more (the asker's, beside the engine thread's) and every
worker sleeps between regions, so each of a decoding step's ~1,000 small parallel kernels pays a
wake-up. Measured here (2 cores): a q4 decode step in the engine thread took 141-160 ms with the asking
thread's pool alive, 84-90 ms once it was given back, 81-85 ms in the main thread alone
(tests/bench_handoff.py). So the engine thread gives back its pool before it waits (idle, or while
another thread takes a turn), and an asker gives back its own once its questions are with the engine
(engine/scheduling/scheduler.py), through OpenMP 5.0's omp_pause_resource_all (soft): the next parallel
region in that thread builds a fresh pool. Without an OpenMP runtime loaded it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

PAUSE_SOFT = 1  # omp_pause_soft: the pool's threads end, the runtime stays initialised
LIBRARIES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib", "libiomp5.dylib")
_lock = threading.Lock()
_pause = None  # omp_pause_resource_all of the runtime torch loaded, False when there is none


def _runtime():
    """omp_pause_resource_all of the OpenMP runtime already in this process (never loads one), else False."""
    global _pause
    with _lock:
        if _pause is None:
            _pause = False
            for name in LIBRARIES:
                try:
                    lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
                    fn = lib.omp_pause_resource_all
                except (OSError, AttributeError):
                    continue
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                _pause = fn
                break
        return _pause


def release() -> bool:
    """Give back this thread's OpenMP worker pool (it is about to wait while another thread computes).
    True if the runtime did; False without a runtime, or inside a parallel region (the runtime refuses)."""
    if "torch" not in sys.modules:  # no torch, no parallel region has run in this process
        return False
    fn = _runtime()
    if not fn:
        return False
    return fn(PAUSE_SOFT) == 0  # microseconds when this thread holds no pool
