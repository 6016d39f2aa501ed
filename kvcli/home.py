"""Where kvcli keeps its own files (converted models, fetched caches, remembered probes): one rule for every layer."""

from __future__ import annotations

import os
from pathlib import Path


def kvcli_home() -> Path:
    """$KVCLI_HOME, else the per-user cache directory ($XDG_CACHE_HOME or ~/.cache, then kvcli)."""
    if os.environ.get("KVCLI_HOME"):
        return Path(os.environ["KVCLI_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcli"
