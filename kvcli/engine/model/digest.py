"""A model file's sha256, read whole once and remembered by the file's identity."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from ...home import kvcli_home, remembered_digest
from .fingerprint import sha256_json


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cached_sha(path: Path, beside: Callable[[], None] | None = None) -> str:
    """sha256 of a (large) file, remembered under KVCLI_HOME by the file's identity (path, size, mtime, inode): the
    whole file is read once, later runs stat it. beside(), if given, runs in a thread while a file is hashed (the
    hash releases the GIL), and has returned when this does."""
    st = path.stat()
    key = sha256_json([str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])[:32]
    memo = kvcli_home() / "hashes" / key
    if beside is None or memo.is_file():
        return remembered_digest(memo, lambda: sha256_file(path))
    import threading

    thread = threading.Thread(target=beside, name="kvcli-imports", daemon=True)
    thread.start()
    try:
        return remembered_digest(memo, lambda: sha256_file(path))
    finally:
        thread.join()


def import_heavy() -> None:
    """Import what loading any model needs (torch, transformers' model code), so a first hash of a GGUF file and the
    imports share the two cores; a failure is left for the load itself to meet and report."""
    try:
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
    except Exception:
        pass
