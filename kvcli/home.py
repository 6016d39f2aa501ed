"""Where kvcli keeps its own files (converted models, fetched caches, remembered probes): one rule for every layer."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def kvcli_home() -> Path:
    """$KVCLI_HOME, else the per-user cache directory ($XDG_CACHE_HOME or ~/.cache, then kvcli)."""
    if os.environ.get("KVCLI_HOME"):
        return Path(os.environ["KVCLI_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcli"


def remember(path: Path, text: str) -> None:
    """Write a small file kvcli keeps to spare work (a hash, a verdict) whole or not at all; a failure to
    remember is never a reason to fail the command."""
    import uuid

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass


def remembered_digest(path: Path, compute: Callable[[], str]) -> str:
    """The hex sha256 kept at `path` by an earlier run, else compute()'s, kept there for the next."""
    try:
        value = path.read_text().strip()
        if len(value) == 64:
            return value
    except OSError:
        pass
    value = compute()
    remember(path, value)
    return value
