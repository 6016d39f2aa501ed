"""Caches and documents at fsspec URLs: read manifests, list caches, upload with the manifest last.

Any fsspec URL works (s3://, gs://, az://, hf://, https://, memory://, file://); hf:// and
http(s):// are read-only. Credentials come from wherever the backend finds them (environment,
~/.aws, fsspec configuration); kvcli passes none, stores none, and strips user:password@ from
every URL it prints.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from . import READ_ONLY_SCHEMES, redact, scheme
from ..documents import MAX_DOCUMENT_BYTES, Document, from_bytes
from ..errors import CacheExistsError, CacheMissingError, DocumentError, KvcliError, UsageError, extra_hint
from ..format import manifest as mf

INSTALL_HINT = extra_hint("object stores", "remote")
def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a URL; a fresh instance so no stale listing is reused."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise KvcliError(f"{redact(url)}: fsspec is not installed", hint=INSTALL_HINT) from None
    try:
        fs, path = url_to_fs(url)
    except ImportError as exc:
        raise KvcliError(f"{redact(url)}: no fsspec backend for {scheme(url)}:// ({exc})", hint=INSTALL_HINT) from None
    except ValueError as exc:
        raise UsageError(f"{redact(url)}: not a usable URL ({exc})") from None
    fs.invalidate_cache()
    return fs, path


@contextmanager
def failures(url: str, missing: type[KvcliError] = CacheMissingError, what: str = "no cache here") -> Iterator[None]:
    """Map backend exceptions (botocore, aiohttp, OSError) to one kvcli error naming the URL."""
    try:
        yield
    except KvcliError:
        raise
    except FileNotFoundError:
        raise missing(f"{redact(url)}: {what}") from None
    except PermissionError as exc:
        raise KvcliError(f"{redact(url)}: permission denied ({redact(str(exc))})",
                         hint="check the credentials your object store client uses") from None
    except Exception as exc:  # network, auth, bucket errors: the backend's own words, credentials stripped
        raise KvcliError(f"{redact(url)}: {exc.__class__.__name__}: {redact(str(exc))}") from None


def check_writable(url: str) -> None:
    if scheme(url) in READ_ONLY_SCHEMES:
        raise UsageError(f"{redact(url)}: {scheme(url)}:// is read-only for kvcli; write to s3://, gs://, az://, file:// or a folder")


def read_bytes(url: str, limit: int, *, missing: type[KvcliError] = CacheMissingError, what: str = "not found") -> bytes:
    """At most limit + 1 bytes of the object at `url` (so a caller can tell an oversized one)."""
    fs, path = filesystem(url)
    with failures(url, missing, what), fs.open(path, "rb") as f:
        return f.read(limit + 1)


def manifest_bytes(url: str) -> bytes:
    where = join(url, mf.MANIFEST_NAME)
    raw = read_bytes(where, mf.MAX_MANIFEST_BYTES, what=f"no {mf.MANIFEST_NAME} (no cache here, or an upload that did not finish)")
    if len(raw) > mf.MAX_MANIFEST_BYTES:
        raise CacheMissingError(f"{redact(where)}: manifest is implausibly large")
    return raw


def read_manifest(url: str) -> mf.Manifest:
    """The validated manifest of the cache at `url` (no shard is read)."""
    return mf.parse(manifest_bytes(url), redact(join(url, mf.MANIFEST_NAME)))


def stored_sizes(url: str) -> dict[str, int]:
    """Path relative to `url` -> size of every object under it, section folders included."""
    fs, path = filesystem(url)
    base = path.rstrip("/") + "/"
    with failures(url):
        found = fs.find(path, detail=True)
    return {key[len(base):]: int(e.get("size") or 0) for key, e in found.items() if key.startswith(base)}


def shards(m: mf.Manifest) -> list[tuple[str, mf.LayerEntry, Any]]:
    """Every shard of a cache as (its path relative to the cache, its entry, its section or None): the head's, then
    each section's, in the section's own folder (format/sections.py)."""
    parts = m.sections.parts if m.sections is not None else []
    return [(e.file, e, None) for e in m.layers] + [(f"{p.dir}/{e.file}", e, p) for p in parts for e in p.layers]


def _basename(key: str) -> str:
    """The last part of an object key or path."""
    return key.rstrip("/").rpartition("/")[2]


def read_document(entry: str, encoding: str = "utf-8") -> Document:
    """A document from a URL (fetched whole, bounded), checked and converted like a local one."""
    data = read_bytes(entry, MAX_DOCUMENT_BYTES, missing=DocumentError, what="no such document")
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{redact(entry)}: larger than {MAX_DOCUMENT_BYTES // (1024 * 1024)} MiB")
    return from_bytes(data, redact(entry), encoding)


def upload(local: Path, url: str, *, force: bool) -> None:
    """Copy a finished local cache to `url`: shards first, the manifest last.

    A reader sees the old cache, no cache, or the new one complete; never a partial one. When
    replacing, the old manifest goes first, so old and new files are never read as one cache (a
    reader that fetched the old manifest just before finds shards that fail their sha256: exit 3).
    """
    check_writable(url)
    m = mf.parse((local / mf.MANIFEST_NAME).read_bytes(), str(local / mf.MANIFEST_NAME))
    fs, root = filesystem(url)
    manifest = join(root, mf.MANIFEST_NAME)
    with failures(url, KvcliError, "upload failed (no such folder or bucket)"):
        if fs.exists(manifest):
            if not force:
                raise CacheExistsError(f"{redact(url)}: already exists (use --force to replace it)")
            fs.rm_file(manifest)
        files = shards(m)
        _remove_stale(fs, root, {rel for rel, _e, _p in files})
        fs.makedirs(root, exist_ok=True)  # a real folder for file://; nothing (or the bucket) for object stores
        for part in m.sections.parts if m.sections is not None else []:
            fs.makedirs(join(root, part.dir), exist_ok=True)
        for rel, _entry, _part in files:
            fs.put_file(str(local / rel), join(root, rel))
        fs.put_file(str(local / mf.MANIFEST_NAME), manifest)  # last: from here on the cache exists


def _remove_stale(fs: Any, root: str, keep: set[str]) -> None:
    """Shards a replaced cache held that the new one does not name (a head's, or a section's, whole section folders
    included), so the folder holds one cache's files."""
    from ..format.sections import is_section_dir

    try:
        listed = fs.ls(root, detail=True)
    except FileNotFoundError:
        return
    for e in listed:
        name = _basename(e["name"])
        if e.get("type") == "directory" and is_section_dir(name):
            inside = [f"{name}/{_basename(k)}" for k in fs.ls(e["name"], detail=False)]
            if not any(rel in keep for rel in inside):
                fs.rm(e["name"], recursive=True)
                continue
            for rel in inside:
                if _basename(rel).startswith("layer_") and rel not in keep:
                    fs.rm_file(join(root, rel))
        elif e.get("type") != "directory" and name.startswith("layer_") and name not in keep:
            fs.rm_file(e["name"])


def verify(url: str) -> mf.Manifest:
    """Check the cache as it is in the store (not a local copy): manifest, then every shard's size,
    digest and decoded layout, one shard in memory at a time. Raises CacheError naming the first bad file."""
    from ..errors import CacheCorruptError
    from ..format.sections import named

    m = read_manifest(url)
    fs, base = filesystem(url)
    for rel, entry, part in shards(m):  # a sectioned cache's sections too, each bad one named
        try:
            _verify_shard(fs, m, entry, join(base, rel), join(redact(url), rel))
        except CacheCorruptError as exc:
            raise exc if part is None else named(part, exc) from None
    return m


def _verify_shard(fs: Any, m: mf.Manifest, entry: mf.LayerEntry, path: str, where: str) -> None:
    """One shard as it is in the store: its size, digest and decoded layout against its entry."""
    from ..errors import CacheCorruptError
    from ..format import store

    with failures(where, CacheCorruptError, "shard is missing"), fs.open(path, "rb") as f:
        data = f.read(entry.stored_bytes + 1)
    if len(data) != entry.stored_bytes:
        raise CacheCorruptError(f"{where}: {len(data)} bytes in the store, manifest says {entry.stored_bytes} (truncated or extended)")
    if store.shard_digest(data, m.shard_hash) != entry.digest:
        raise CacheCorruptError(f"{where}: checksum mismatch (the shard in the object store is damaged or was changed)")
    store.check_payload(data, where=where, transform=m.transform, dtype=m.dtype, key_shape=entry.key_shape,
                        value_shape=entry.value_shape, decoded_bytes=entry.decoded_bytes, quant=m.quant)


def cache_urls(url: str, *, suffix: str = "") -> list[str]:
    """`url` itself if it holds a manifest, else every folder directly under it (whose name ends in `suffix`), sorted."""
    fs, path = filesystem(url)
    with failures(url, KvcliError, "no such folder"):
        names = {_basename(e["name"]): e for e in fs.ls(path, detail=True)}
    if mf.MANIFEST_NAME in names:
        return [url]
    return sorted(join(url, n) for n, e in names.items() if e.get("type") == "directory" and n.endswith(suffix))


def list_caches(url: str) -> list[dict[str, Any]]:
    """`kvcli ls URL`: every cache directly under `url` (or `url` itself), broken ones flagged."""
    from ..format import catalog

    rows = []
    for cache in cache_urls(url, suffix=".kv"):
        try:
            m = read_manifest(cache)
        except KvcliError as exc:
            rows.append({"path": redact(cache), "error": str(exc)})
            continue
        rows.append({**catalog.summary(redact(cache), m), "age_s": _age(m)})
    return rows


def _age(m: mf.Manifest) -> float | None:
    """Seconds since the manifest's `created` time (object stores keep no reliable folder times)."""
    import time
    from datetime import datetime

    try:
        return max(0.0, time.time() - datetime.fromisoformat(m.created).timestamp())
    except ValueError:
        return None
