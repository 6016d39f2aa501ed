"""How kvcli bench times restores and TTFT and reads peak memory, in one place: bench.py and bench_formats.py
both import it, and bench.py imports bench_formats.py, never the other way (no import circle)."""

from __future__ import annotations

import resource
import sys

RESTORE_REPEATS = 3  # restores timed per cache (the median is reported)
TTFT_QUESTIONS = 5  # TTFT (with and without the cache) is timed on the first questions; agreement uses all
TO_THE_LIMIT = "max"  # --tokens max: 1k, doubling, up to the model's limit


def reset_peak_rss() -> bool:
    """Start a new RSS high-water mark (Linux: 5 into /proc/self/clear_refs); False where that is not possible,
    and then peak_rss() is the process's peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The RSS high-water mark in bytes: /proc/self/status VmHWM where there is one, else getrusage's ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
