"""The local store of remote caches: each one copied once, checked, kept under $KVCLI_HOME/remote.

A remote cache is stored as an ordinary cache directory named by the sha256 of its manifest bytes
(which cover every shard's sha256): `$KVCLI_HOME/remote/<sha256>.kv`. Every shard is checked
against the manifest's size and sha256 while it downloads, and the copy is installed atomically
(the same writer as `prefill`), so a half download is never used. The next use of the same cache
reads only the manifest from the store and finds the copy: no shard is downloaded again.

The store is bounded by KVCLI_REMOTE_STORE_MAX (a size as kvcli/units.py reads it: 20G, 500MB;
default 20G; 0 for no bound): after each download the least recently used copies are removed until it fits. Clear it
with `rm -rf "$KVCLI_HOME/remote"`; a running `ask` keeps the files it has open.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from . import objects
from ..errors import CacheCorruptError, CacheExistsError, KvcliError
from ..format import manifest as mf, store, writing

DEFAULT_MAX = "20G"
MAX_VARIABLE = "KVCLI_REMOTE_STORE_MAX"
_CHUNK = 4 << 20


def root() -> Path:
    from ..home import kvcli_home

    return kvcli_home() / "remote"


def max_bytes() -> int:
    """The store's bound from KVCLI_REMOTE_STORE_MAX (0: unbounded), a size as kvcli/units.py reads it."""
    from ..units import parse_size

    return parse_size(os.environ.get(MAX_VARIABLE) or DEFAULT_MAX, f"${MAX_VARIABLE}", zero=True)


def fetch(url: str, progress: Callable[[str], None] | None = None,
          check: Callable[[mf.Manifest], None] | None = None) -> Path:
    """A local, checked copy of the remote cache at `url` (downloaded only if not already stored).

    The manifest comes first and alone: check(manifest) (the caller's fit test: model, tokenizer, framing,
    dtype; it raises to refuse) and the store's bound against the manifest's sizes run before any shard
    is fetched; each shard then streams in, refused as soon as it passes its manifest size."""
    raw = objects.manifest_bytes(url)
    where = objects.redact(url)
    m = mf.parse(raw, objects.join(where, mf.MANIFEST_NAME))
    if check is not None:
        check(m)
    local = root() / f"{hashlib.sha256(raw).hexdigest()}.kv"
    if _complete(local, m):
        os.utime(local)  # most recently used
        return local
    bound = max_bytes()
    need = m.bytes_stored + len(raw)
    if bound and need > bound:
        raise KvcliError(f"{where}: the cache takes {need:,} bytes, more than the local store's bound of {bound:,} "
                         f"(${MAX_VARIABLE}); nothing was downloaded",
                         hint=f"raise ${MAX_VARIABLE} (0 for no bound), or prefill the document locally")
    if bound:
        prune(bound - need)  # room for this copy before it downloads, least recently used copies first
    local.parent.mkdir(parents=True, exist_ok=True)
    files = objects.shards(m)  # a sectioned cache's sections too, each in its own folder
    if progress:
        progress(f"{where}: downloading {len(files)} shards ({m.bytes_stored:,} bytes) into {local.parent}")
    fs, base = objects.filesystem(url)
    try:
        with writing.atomic_cache_dir(local, force=local.exists()) as tmp:
            for part in m.sections.parts if m.sections is not None else []:
                (tmp / part.dir).mkdir()
            for rel, entry, _part in files:
                _download(fs, objects.join(base, rel), tmp / rel, entry, objects.join(where, rel), m.shard_hash)
            writing.write_file(tmp, mf.MANIFEST_NAME, raw)
    except CacheExistsError:  # another process stored the same cache meanwhile
        if not _complete(local, m):
            raise
    prune(keep=local)
    return local


def _complete(local: Path, m: mf.Manifest) -> bool:
    """Whether the stored copy holds every shard at its size (their sha256 is checked on every read)."""
    if not store.is_cache(local):
        return False
    try:
        return all((local / rel).stat().st_size == e.stored_bytes for rel, e, _part in objects.shards(m))
    except OSError:
        return False


def _open_exact(fs, remote: str):
    """The object opened for reading with no read-ahead cache where the backend has one (s3fs, http): each
    read fetches what it asks for, so a shard longer than its manifest size is never fetched past it."""
    try:
        return fs.open(remote, "rb", cache_type="none")
    except TypeError:  # a backend without cache types
        return fs.open(remote, "rb")


def _download(fs, remote: str, dest: Path, entry: mf.LayerEntry, where: str, hash_name: str) -> None:
    """Stream one shard to `dest`, refusing it (exit 3) unless its size and digest match the manifest."""
    digest, got = store.hasher(hash_name), 0
    with objects.failures(where, CacheCorruptError, "shard is missing"), _open_exact(fs, remote) as src, open(dest, "xb") as out:
        while got <= entry.stored_bytes:
            chunk = src.read(min(_CHUNK, entry.stored_bytes + 1 - got))  # one byte past the size tells a longer shard
            if not chunk:
                break
            got += len(chunk)
            if got > entry.stored_bytes:
                break  # never written, never read further
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if got != entry.stored_bytes:
        size = f"more than {entry.stored_bytes}" if got > entry.stored_bytes else f"{got}"
        raise CacheCorruptError(f"{where}: {size} bytes in the store, manifest says {entry.stored_bytes}")
    if digest.hexdigest() != entry.digest:
        raise CacheCorruptError(f"{where}: checksum mismatch (the shard in the object store is damaged or was changed)")


def entries() -> list[tuple[Path, int, float]]:
    """(copy, bytes, last use) for every cache in the store."""
    rows = []
    base = root()
    if not base.is_dir():
        return rows
    for path in base.iterdir():
        if not store.is_cache(path):
            continue
        try:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # section folders included
            rows.append((path, size, path.stat().st_mtime))
        except OSError:
            continue
    return rows


def prune(limit: int | None = None, *, keep: Path | None = None) -> int:
    """Remove least recently used copies until the store fits `limit` (default: the configured bound).
    Returns the bytes removed. The copy `keep` (the one just fetched) always stays."""
    limit = max_bytes() if limit is None else limit
    if limit <= 0:
        return 0
    rows = sorted(entries(), key=lambda r: r[2])
    total, removed = sum(r[1] for r in rows), 0
    for path, size, _ in rows:
        if total <= limit:
            break
        if keep is not None and path == keep:
            continue
        gone = writing.hidden_sibling(path, "evict")
        try:
            os.rename(path, gone)  # one step: readers see the copy or nothing
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
        total -= size
        removed += size
    return removed


def clear() -> int:
    """Remove every stored copy; returns the bytes removed."""
    return prune(1)
