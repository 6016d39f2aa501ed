"""Sizes and durations as people type them: 8G, 512M, 1.5GB; 30s, 10m, 2h, 1d (a bare number: bytes, seconds)."""

from __future__ import annotations

import re

from ..errors import UsageError

_SIZES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}
_TIMES = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, option: str = "--max-memory") -> int:
    m = _NUMBER.match(text)
    unit = m and _SIZES.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise UsageError(f"{option} {text}: expected a size such as 8G, 512M or 2GB")
    return int(float(m.group(1)) * unit)


def parse_duration(text: str, option: str = "--idle-timeout") -> float:
    m = _NUMBER.match(text)
    unit = m and _TIMES.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise UsageError(f"{option} {text}: expected a duration such as 30s, 10m or 2h")
    return float(m.group(1)) * unit
