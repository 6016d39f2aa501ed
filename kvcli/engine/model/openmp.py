"""Handing the CPU's OpenMP workers from one thread to another: a thread about to wait gives back its pool.

OpenMP runtimes keep a pool of worker threads for every thread that has run a parallel region (torch's
kernels, MKL). libgomp (torch's on Linux) spins idle workers between regions only while the pools hold
no more threads than there are CPUs; one pool more (the asker's, beside the engine thread's) and every
worker sleeps between regions, so each of a decoding step's ~1,000 small parallel kernels pays a
wake-up, which slows a decoding step by a third or more (tests/bench/bench_handoff.py measures it). So the
engine thread gives back its pool before it waits (idle, or while another thread takes a turn), and an asker
gives back its own once its questions are with the engine (engine/scheduling/scheduler.py, through its
engine's CpuTuning: engine/model/cpu.py), through OpenMP 5.0's omp_pause_resource_all (soft): the next
parallel region in that thread builds a fresh pool. Without libgomp loaded (another OpenMP runtime, or none)
it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

PAUSE_SOFT = 1  # omp_pause_soft: the pool's threads end, the runtime stays initialised
SONAME = "libgomp.so.1"
_lock = threading.Lock()
_pauses: list | None = None  # omp_pause_resource_all of every libgomp in this process


def _loaded_libgomps() -> list[str]:
    """Paths of the libgomp copies mapped into this process (a wheel may ship one under another name)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libgomp") and ".so" in path and path not in found:
                    found.append(path)
    except OSError:  # no /proc: ask the loader for the usual name
        pass
    return found or [SONAME]


def _runtime() -> list:
    """omp_pause_resource_all of each libgomp already loaded (never loads one); empty if none.

    Only libgomp: its pause gives back the calling thread's pool alone, which is what tests/bench/bench_handoff.py measures, and
    is safe while other threads compute. LLVM's libomp and Intel's pause the whole runtime."""
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = []
            for name in _loaded_libgomps():
                try:
                    fn = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL).omp_pause_resource_all
                except (OSError, AttributeError):  # not loaded, or too old for OpenMP 5.0
                    continue
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                _pauses.append(fn)
        return _pauses


def release() -> bool:
    """Give back this thread's OpenMP worker pool (it is about to wait while another thread computes).
    True if the runtime did; False without a runtime, or inside a parallel region (the runtime refuses)."""
    if "torch" not in sys.modules:  # no torch, no parallel region has run in this process
        return False
    pauses = _runtime()
    return bool(pauses) and all(fn(PAUSE_SOFT) == 0 for fn in pauses)  # microseconds when this thread holds no pool
