"""Sizes and durations as people type them, one parser for every option and variable that takes one.

Sizes (--max-memory, $KVCLI_REMOTE_STORE_MAX): a number, optionally with a fraction, then a unit, case
ignored, spaces allowed between:
  - none or B: bytes (512, 512B)
  - decimal, with B: KB = 10^3, MB = 10^6, GB = 10^9, TB = 10^12 (as disks and networks count)
  - binary, with iB: KiB = 2^10, MiB = 2^20, GiB = 2^30, TiB = 2^40
  - binary, the letter alone: K, M, G, T = KiB, MiB, GiB, TiB (as `free -h`, docker --memory, ulimit)
So 1GB is 1,000,000,000 bytes, 1GiB and 1G are 1,073,741,824; 512M is 536,870,912; 1.5G is 1.5 GiB.

Durations (--idle-timeout, --older-than): a number, optionally with a fraction, then a unit:
  s (or none: seconds), m or min (minutes), h (hours), d (days), w (weeks): 30s, 5m, 2h, 7d, 2w, 1.5h.
  --older-than requires the unit (`prune --older-than 7` is refused rather than meaning seven seconds).
"""

from __future__ import annotations

import re

from .errors import UsageError

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
              "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, option: str = "--max-memory", *, zero: bool = False) -> int:
    """Bytes from '8G', '512M', '1GB', '2GiB', '1.5g', '4096' (see the module's table); zero=True also
    accepts 0 (for a bound that 0 turns off). UsageError naming `option` otherwise."""
    m = _NUMBER.fullmatch(text or "")
    unit = SIZE_UNITS.get(m.group(2).lower()) if m else None
    if unit is None or (float(m.group(1)) <= 0 and not zero):
        raise UsageError(f"{option} {text}: expected a size such as 8G, 512M, 2GB or 1GiB"
                         + (" (0 for no bound)" if zero else ""))
    return int(float(m.group(1)) * unit)


def parse_duration(text: str, option: str = "--idle-timeout", *, bare: bool = True) -> float:
    """Seconds from '30s', '5m', '2h', '7d', '2w', '90' (see the module's table); UsageError naming `option`.
    bare=False requires a unit (--older-than: `prune --older-than 7` must not mean seven seconds)."""
    m = _NUMBER.fullmatch(text or "")
    unit = DURATION_UNITS.get(m.group(2).lower()) if m and (bare or m.group(2)) else None
    if unit is None or float(m.group(1)) <= 0:
        raise UsageError(f"{option} {text}: expected a duration such as 30s, 10m, 2h, 30d or 2w"
                         + ("" if bare else " (a number and a unit)"))
    return float(m.group(1)) * unit
