"""What a warm server measures about what it holds: the machine's memory, a model's bytes, a cache's identity."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def total_memory() -> int:
    """Physical memory in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_max_memory() -> int:
    """Half of the machine's RAM (at least 1 GiB): room for models and caches, and for everything else."""
    return max(1 << 30, total_memory() // 2)


def model_bytes(lm: Any) -> int:
    m = lm.model
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def identity(path: Path) -> tuple:
    """Directory and manifest identity: any replace or rewrite of the cache changes it."""
    d = os.stat(path)
    try:
        m = os.stat(path / "manifest.json")
        mid = (m.st_ino, m.st_size, m.st_mtime_ns)
    except OSError:
        mid = ()
    return (d.st_dev, d.st_ino, d.st_mtime_ns, *mid)


def give_back() -> None:
    """Return what a model just left behind to the system: collect reference cycles (a model's modules hold some),
    then glibc's malloc_trim (freed blocks otherwise stay in the process's heap). Nothing without malloc_trim."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
