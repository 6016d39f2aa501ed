"""Reading cache directories: a consistent snapshot, validated manifest, verified shards. No torch here.

A cache is a directory holding manifest.json and one shard per layer, swapped into place whole by
kvcli/format/writing.py. Readers open the directory once and every file relative to it, so they see the
old cache or the new one, complete, and never a mix.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from . import manifest as mf, payload
from .chain import MAX_CHAIN, base_path, base_problem
from ..errors import CacheCorruptError, CacheError, CacheMismatchError, CacheMissingError

TMP_MARK = ".kvtmp-"


@dataclass
class OpenedCache:
    """A validated manifest plus open handles to its shards (immune to a concurrent replace)."""

    path: Path
    manifest: mf.Manifest
    shards: list[int]  # file descriptors, one per layer, in layer order
    base: "OpenedCache | None" = None  # the cache this one extends, opened and checked against its link

    def chain(self) -> list["OpenedCache"]:
        """Every link, the first (the one that extends none) first, this one last."""
        links, link = [], self
        while link is not None:
            links.append(link)
            link = link.base
        return links[::-1]

    def read_shard(self, i: int) -> bytes:
        """The stored bytes of layer i, checked against the manifest's size and digest."""
        entry = self.manifest.layers[i]
        where = f"{self.path / entry.file}"
        _check_size(self.shards[i], entry, where)  # before reading: an extended shard is never read into memory
        data = _read_fd(self.shards[i], entry.stored_bytes + 1)
        if len(data) != entry.stored_bytes:
            raise _size_error(where, len(data), entry)
        if shard_digest(data, self.manifest.shard_hash) != entry.digest:
            raise _damaged(where)
        return data

    def stream_shard(self, i: int) -> "ShardStream":
        """Layer i's stored bytes as a stream hashed as it is read (restore: one pass, no copy of the shard).

        Whatever is decoded from it is unverified until ShardStream.verify() has passed."""
        entry = self.manifest.layers[i]
        where = f"{self.path / entry.file}"
        _check_size(self.shards[i], entry, where)
        return ShardStream(self.shards[i], where, entry.stored_bytes, entry.digest, self.manifest.shard_hash)

    def close(self) -> None:
        for fd in self.shards:
            os.close(fd)
        self.shards = []
        if self.base is not None:
            self.base.close()

    def __enter__(self) -> "OpenedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SHARD_HASH = mf.SHARD_HASHES[mf.FORMAT_VERSION]  # the hash new caches' shards get (engine/prefilling.py)
STREAM_CHUNK = payload.SOURCE_READ  # bytes per read when streaming a shard: hashed and decompressed while in cache


def hasher(name: str = SHARD_HASH):
    """A fresh hash object (update, hexdigest) for shard bytes: "blake3" (the blake3 package) or "sha256"."""
    if name == "blake3":
        from blake3 import blake3

        return blake3()  # one thread: restore already hashes one shard per core
    return hashlib.new(name)


def shard_digest(data: bytes | memoryview, name: str = SHARD_HASH) -> str:
    h = hasher(name)
    h.update(data)
    return h.hexdigest()


def _size_error(where: str, size: int, entry: mf.LayerEntry) -> CacheCorruptError:
    return CacheCorruptError(f"{where}: {size} bytes on disk, manifest says {entry.stored_bytes} (truncated or extended)")


def _damaged(where: str) -> CacheCorruptError:
    return CacheCorruptError(f"{where}: checksum mismatch (the shard is damaged)")


def _check_size(fd: int, entry: mf.LayerEntry, where: str) -> None:
    size = os.fstat(fd).st_size
    if size != entry.stored_bytes:
        raise _size_error(where, size, entry)


class ShardStream:
    """One shard's stored bytes, read in order in STREAM_CHUNK pieces, each hashed as it is handed out.

    A source for zstandard's stream_reader (read()), so that each piece is hashed and decompressed while it is
    still in the CPU cache. Never more than the manifest's size is read; verify() hashes whatever the decoder
    left unread and raises CacheCorruptError (naming the file) unless size and hash match the manifest.
    """

    def __init__(self, fd: int, where: str, size: int, digest: str, hash_name: str = SHARD_HASH):
        self.fd, self.where, self.size, self.digest = fd, where, size, digest
        self.pos, self._hash, self._head = 0, hasher(hash_name), b""
        self.read_s = self.hash_s = 0.0  # seconds in reads and in hashing (restore's stage rates)

    def _next(self, n: int) -> bytes:
        n = min(n, self.size - self.pos)
        t0 = time.perf_counter()
        chunk = os.pread(self.fd, n, self.pos) if n > 0 else b""
        t1 = time.perf_counter()
        self.pos += len(chunk)
        self._hash.update(chunk)  # releases the GIL for large pieces
        self.read_s += t1 - t0
        self.hash_s += time.perf_counter() - t1
        return chunk

    def peek(self) -> bytes:
        """The first piece (the zstd frame header is in it), read once and handed out again by read()."""
        if not self._head and self.pos == 0:
            self._head = self._next(STREAM_CHUNK)
        return self._head

    def read(self, n: int = -1) -> bytes:
        if self._head:
            head, self._head = self._head, b""
            return head
        return self._next(STREAM_CHUNK if n is None or n < 0 else n)

    def verify(self) -> None:
        """Hash the rest and check size and digest: a damaged, truncated or swapped shard is refused here."""
        self._head = b""
        while self.pos < self.size:
            if not self._next(STREAM_CHUNK):
                break
        if self.pos != self.size or os.pread(self.fd, 1, self.pos):
            raise CacheCorruptError(f"{self.where}: {self.pos} bytes read, manifest says {self.size} (truncated or extended)")
        if self._hash.hexdigest() != self.digest:
            raise _damaged(self.where)


def _read_fd(fd: int, limit: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(limit - total, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _open_in(dir_fd: int, name: str, where: Path) -> int:
    """Open a regular file inside the directory, refusing symlinks and anything not a plain file.

    `name` is a validated plain file name; symlinks are refused (never followed out of the directory),
    and FIFOs or devices are refused before they are opened (opening a FIFO would block).
    """
    if "/" in name or name in ("", ".", ".."):
        raise CacheCorruptError(f"{where / name}: not a plain file name")
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CacheCorruptError(f"{where / name}: cannot be read ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise CacheCorruptError(f"{where / name}: is a symbolic link; caches hold plain files only")
    if not stat.S_ISREG(st.st_mode):
        raise CacheCorruptError(f"{where / name}: is not a regular file")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheCorruptError(f"{where / name}: is a symbolic link; caches hold plain files only") from None
        raise CacheCorruptError(f"{where / name}: cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the check and the open
        os.close(fd)
        raise CacheCorruptError(f"{where / name}: is not a regular file")
    return fd


def read_manifest(path: str | os.PathLike, *, shards: bool = False, chain: bool = True) -> mf.Manifest:
    """Validate and return the manifest of the cache at `path`; no shard is touched (restore and verify check
    them). shards=True also opens each shard, never reading it, so that a missing one is refused. chain=False:
    this cache's own manifest, its base (if it extends one) not looked at."""
    with open_cache(path, shards=shards, chain=chain) as cache:
        return cache.manifest


def open_cache(path: str | os.PathLike, *, shards: bool = True, chain: bool = True) -> OpenedCache:
    """Open a cache: validated manifest and open shard handles (none without shards), all from one directory snapshot.

    A cache that extends another (`prefill --after`) opens its whole chain (unless chain=False), each link checked
    against the one above it (base_problem); a missing, changed or foreign link is refused, naming it."""
    top = _open_link(Path(path), shards)
    link = top
    try:
        for _depth in range(MAX_CHAIN):
            if link.manifest.base is None or not chain:
                return top
            where = base_path(link.path, link.manifest.base["path"])
            try:
                link.base = _open_link(where, shards)
            except CacheMissingError as exc:
                raise CacheMissingError(f"{link.path}: extends {where}, which cannot be opened ({exc})") from None
            except CacheError as exc:
                raise type(exc)(f"{link.path}: extends {where}, which is not a usable cache ({exc})") from None
            problem = base_problem(link.manifest, link.base.manifest)
            if problem:
                raise CacheMismatchError(f"{link.path}: its base {where} {problem}; prefill it again with --after")
            link = link.base
        raise CacheCorruptError(f"{path}: a chain of more than {MAX_CHAIN} caches (a loop of bases?)")
    except BaseException:
        top.close()
        raise


def _open_link(path: Path, shards: bool) -> OpenedCache:
    if TMP_MARK in path.name:
        raise CacheMissingError(f"{path}: is the temporary folder of an unfinished or interrupted prefill, not a cache")
    for _attempt in range(5):  # a concurrent replace can remove files between two opens: start over
        try:
            return _open_once(path, shards)
        except FileNotFoundError:
            continue
    raise CacheMissingError(f"{path}: cache changed while being opened; try again")


def _cache_of(path: Path) -> str | None:
    """What to do when a document was given where its cache belongs: name its cache if it is there; nothing for a
    file named like a cache (a damaged cache, not a document)."""
    for cache in (path.with_suffix(".kv"), path.with_name(path.name + ".kv")):
        if cache != path and (cache / mf.MANIFEST_NAME).is_file():
            return f"did you mean {cache}?"
    return None if path.suffix == ".kv" else f"a cache is a folder that 'kvcli prefill {path}' writes"


def _open_once(path: Path, shards: bool) -> OpenedCache:
    try:
        dir_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CacheMissingError(f"{path}: no cache here (run 'kvcli prefill' first)") from None
    except NotADirectoryError:
        raise CacheMissingError(f"{path}: is a file, not a cache directory", hint=_cache_of(path)) from None
    except OSError as exc:
        raise CacheMissingError(f"{path}: cannot open ({exc.strerror})") from None
    fds: list[int] = []
    try:
        try:
            mfd = _open_in(dir_fd, mf.MANIFEST_NAME, path)
        except FileNotFoundError:
            if not _still_same(path, dir_fd):  # replaced (and the old one being removed) since we opened it
                raise
            raise CacheMissingError(f"{path}: no {mf.MANIFEST_NAME} (not a cache, or an incomplete one)") from None
        try:
            if os.fstat(mfd).st_size > mf.MAX_MANIFEST_BYTES:
                raise CacheCorruptError(f"{path / mf.MANIFEST_NAME}: manifest is implausibly large")
            raw = _read_fd(mfd, mf.MAX_MANIFEST_BYTES + 1)
        finally:
            os.close(mfd)
        if len(raw) > mf.MAX_MANIFEST_BYTES:
            raise CacheCorruptError(f"{path / mf.MANIFEST_NAME}: manifest is implausibly large")
        manifest = mf.parse(raw, str(path / mf.MANIFEST_NAME))
        for layer in manifest.layers if shards else ():
            try:
                fds.append(_open_in(dir_fd, layer.file, path))
            except FileNotFoundError:
                if _still_same(path, dir_fd):
                    raise CacheCorruptError(f"{path / layer.file}: shard is missing") from None
                raise
        return OpenedCache(path=path, manifest=manifest, shards=fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        os.close(dir_fd)


def _still_same(path: Path, dir_fd: int) -> bool:
    """Whether `path` still names the directory we opened (false after a concurrent replace)."""
    try:
        a, b = os.stat(path), os.fstat(dir_fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def verify(path: str | os.PathLike, *, decode: bool = True, threads: int | None = None) -> mf.Manifest:
    """Check the manifest and every shard's size and digest; raise CacheError naming the first bad file (in
    layer order, however many threads check them).

    With decode (the default) each shard is also decompressed and its safetensors layout checked
    against the manifest, as a restore would, but streamed in small chunks and without building
    tensors: memory stays small whatever the manifest claims (one shard per thread), and no torch is
    needed. Shards are checked in `threads` threads (default: one per usable core, at most 8, or one
    when a shard is larger than PARALLEL_VERIFY_MAX): hashing and zstd release the GIL.
    """
    from concurrent.futures import ThreadPoolExecutor

    with open_cache(path) as top:
        work = [(cache, i) for cache in top.chain() for i in range(len(cache.manifest.layers))]  # every link's shards

        def one(cache: OpenedCache, i: int) -> None:
            m, entry = cache.manifest, cache.manifest.layers[i]
            data = cache.read_shard(i)
            if decode:
                check_payload(data, where=str(cache.path / entry.file), transform=m.transform, dtype=m.dtype,
                              key_shape=entry.key_shape, value_shape=entry.value_shape, decoded_bytes=entry.decoded_bytes,
                              quant=m.quant)

        largest = max(c.manifest.layers[i].stored_bytes for c, i in work)
        workers = threads or (1 if largest > PARALLEL_VERIFY_MAX else min(usable_cores(), 8))
        with ThreadPoolExecutor(max_workers=max(1, min(len(work), workers))) as pool:
            futures = [pool.submit(one, c, i) for c, i in work]
            try:
                for f in futures:  # in layer order: the first bad shard is the one reported
                    f.result()
            finally:
                for f in futures:
                    f.cancel()
        return top.manifest


PARALLEL_VERIFY_MAX = 256 << 20  # stored bytes of the largest shard up to which verify holds one shard per thread


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def check_payload(data: bytes, *, where: str, transform: str, dtype: str, key_shape: tuple[int, ...],
                  value_shape: tuple[int, ...], decoded_bytes: int, quant: dict | None = None) -> None:
    """Decompress one shard in bounded chunks and check it holds exactly what the manifest describes.

    The same streaming reader as codec.decode_layer (payload.PayloadReader): a zstd frame that declares
    no other size, a safetensors header naming the layout's tensors with the expected dtype, shape and
    adjacent offsets, finite quantization scales, and exactly decoded_bytes in all. Nothing larger than
    a chunk is held.
    """
    with payload.PayloadReader(data, where=where, transform=transform, dtype=dtype, key_shape=key_shape,
                               value_shape=value_shape, decoded_bytes=decoded_bytes, quant=quant) as src:
        src.drain()
        src.finish()


def is_cache(path: Path) -> bool:
    return path.is_dir() and (path / mf.MANIFEST_NAME).is_file() and TMP_MARK not in path.name
