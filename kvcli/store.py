"""Cache directories on disk: atomic write, consistent read, verification. No torch here.

A cache is a directory holding manifest.json and one shard per layer. It is written in a hidden
temporary sibling and swapped into place in one step, so readers see the old cache or the new one,
complete, and never a mix. Readers open the directory once and every file relative to it.

Test hook: with KVCLI_TEST_STOP_AT=<point> in the environment, a writer stops itself (SIGSTOP) at
that point so a test can kill it there: "tmp-created", "wrote:<file name>", "before-install",
"installed" (new cache in place, old one not yet removed). Nothing else reads that variable.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import signal
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import manifest as mf, payload
from .errors import CacheCorruptError, CacheExistsError, CacheMissingError, KvcliError

TMP_MARK = ".kvtmp-"


@dataclass
class OpenedCache:
    """A validated manifest plus open handles to its shards (immune to a concurrent replace)."""

    path: Path
    manifest: mf.Manifest
    shards: list[int]  # file descriptors, one per layer, in layer order

    def read_shard(self, i: int) -> bytes:
        """The stored bytes of layer i, checked against the manifest's size and sha256."""
        entry = self.manifest.layers[i]
        where = f"{self.path / entry.file}"
        size = os.fstat(self.shards[i]).st_size
        if size != entry.stored_bytes:  # checked before reading: an extended shard is never read into memory
            raise CacheCorruptError(f"{where}: {size} bytes on disk, manifest says {entry.stored_bytes} (truncated or extended)")
        data = _read_fd(self.shards[i], entry.stored_bytes + 1)
        if len(data) != entry.stored_bytes:
            raise CacheCorruptError(f"{where}: {len(data)} bytes on disk, manifest says {entry.stored_bytes} (truncated or extended)")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CacheCorruptError(f"{where}: checksum mismatch (the shard is damaged)")
        return data

    def close(self) -> None:
        for fd in self.shards:
            os.close(fd)
        self.shards = []

    def __enter__(self) -> "OpenedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def read_manifest(path: str | os.PathLike) -> mf.Manifest:
    """Validate and return the manifest of the cache at `path` without touching the shards."""
    with open_cache(path) as cache:
        return cache.manifest


def open_cache(path: str | os.PathLike) -> OpenedCache:
    """Open a cache: validated manifest and open shard handles, all from one directory snapshot."""
    path = Path(path)
    if TMP_MARK in path.name:
        raise CacheMissingError(f"{path}: is the temporary folder of an unfinished or interrupted prefill, not a cache")
    for _attempt in range(5):  # a concurrent replace can remove files between two opens: start over
        try:
            return _open_once(path)
        except FileNotFoundError:
            continue
    raise CacheMissingError(f"{path}: cache changed while being opened; try again")


def _open_once(path: Path) -> OpenedCache:
    try:
        dir_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CacheMissingError(f"{path}: no cache here (run 'kvcli prefill' first)") from None
    except NotADirectoryError:
        raise CacheMissingError(f"{path}: is a file, not a cache directory") from None
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
        for layer in manifest.layers:
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


def verify(path: str | os.PathLike, *, decode: bool = True) -> mf.Manifest:
    """Check the manifest and every shard's size and sha256; raise CacheError naming the first bad file.

    With decode (the default) each shard is also decompressed and its safetensors layout checked
    against the manifest, as a restore would, but streamed in small chunks and without building
    tensors: memory stays small whatever the manifest claims, and no torch is needed.
    """
    with open_cache(path) as cache:
        m = cache.manifest
        for i, entry in enumerate(m.layers):
            data = cache.read_shard(i)
            if decode:
                check_payload(data, where=str(cache.path / entry.file), transform=m.transform, dtype=m.dtype,
                              key_shape=entry.key_shape, value_shape=entry.value_shape, decoded_bytes=entry.decoded_bytes)
            del data
        return m


_CHUNK = 1 << 20


def check_payload(data: bytes, *, where: str, transform: str, dtype: str, key_shape: tuple[int, ...],
                  value_shape: tuple[int, ...], decoded_bytes: int) -> None:
    """Decompress one shard in bounded chunks and check it holds exactly what the manifest describes.

    The same rules as codec.decode_layer (which the fuzz tests hold both to): a zstd frame that
    declares no other size, a safetensors header naming keys and values with the expected dtype,
    shape and adjacent offsets, and exactly decoded_bytes in all. Nothing larger than a chunk is held.
    """
    import zstandard

    def bad(what: str) -> CacheCorruptError:
        return CacheCorruptError(f"{where}: {what}")

    payload.check_declared_size(data, decoded_bytes, where)
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:

            def take(n: int) -> bytes:
                parts, got = [], 0
                while got < n:
                    part = reader.read(min(n - got, _CHUNK))
                    if not part:
                        break
                    parts.append(part)
                    got += len(part)
                return b"".join(parts)

            n = payload.header_length(take(8), decoded_bytes, where)
            raw = take(n)
            if len(raw) < n:
                raise bad(f"decompresses to {8 + len(raw)} bytes, manifest says {decoded_bytes}")
            payload.check_header(raw, where=where, transform=transform, dtype=dtype, key_shape=key_shape,
                                 value_shape=value_shape, decoded_bytes=decoded_bytes)
            got = 8 + n
            while True:  # the tensors: counted, not kept
                part = reader.read(min(_CHUNK, decoded_bytes + 1 - got))
                if not part:
                    break
                got += len(part)
                if got > decoded_bytes:
                    raise bad(f"decompresses to more bytes, manifest says {decoded_bytes}")
            if got != decoded_bytes:
                raise bad(f"decompresses to {got} bytes, manifest says {decoded_bytes}")
    except zstandard.ZstdError as exc:
        raise bad(f"not a valid zstandard stream ({exc})") from None


def is_cache(path: Path) -> bool:
    return path.is_dir() and (path / mf.MANIFEST_NAME).is_file() and TMP_MARK not in path.name


# ---------------------------------------------------------------- writing


def _test_point(name: str) -> None:
    """Test hook (see the module docstring): stop here when KVCLI_TEST_STOP_AT names this point."""
    if os.environ.get("KVCLI_TEST_STOP_AT") == name:
        os.kill(os.getpid(), signal.SIGSTOP)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(directory: Path, name: str, data: bytes) -> None:
    with open(directory / name, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _test_point(f"wrote:{name}")


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2(a, b, flags). False where unsupported (other OS, old kernel, filesystem)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    rc = renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    return _renameat2(a, b, RENAME_EXCHANGE)


def clean_stale(target: Path) -> None:
    """Remove temporary siblings of `target` left by killed runs (their process is gone, their lock free)."""
    parent = target.parent
    prefix = f".{target.name}{TMP_MARK}"
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid = entry.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        if entry.is_symlink() or not entry.is_dir():
            _remove(entry)
            continue
        lock = _lock(entry, block=False)
        if lock is None:  # a writer (perhaps on another host sharing this folder) still holds it
            continue
        try:
            _remove(entry)
        finally:
            os.close(lock)


def _lock(directory: Path, *, block: bool) -> int | None:
    """An fd holding an exclusive flock on `directory` (released when the process dies), or None if held."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove(path: Path) -> None:
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def atomic_cache_dir(target: str | os.PathLike, *, force: bool) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success swap it into `target`, else remove it.

    An existing cache is replaced only with force, and in one atomic step where the OS allows.
    """
    target = Path(target)
    if TMP_MARK in target.name:
        raise KvcliError(f"{target}: names containing '{TMP_MARK}' are reserved for kvcli's temporary folders")
    if target.exists() and not force:
        raise CacheExistsError(f"{target}: already exists (use --force to replace it)")
    if target.exists() and not target.is_dir():
        raise KvcliError(f"{target}: exists and is not a cache directory; refusing to replace it")
    parent = target.parent
    if not parent.is_dir():
        raise KvcliError(f"{parent}: output folder {'is not a folder' if parent.exists() else 'does not exist'}")
    clean_stale(target)
    tmp = parent / f".{target.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise KvcliError(f"{parent}: cannot write here ({exc.strerror})") from None
    lock = _lock(tmp, block=True)  # tells clean_stale in other processes that this folder is in use
    try:
        _test_point("tmp-created")
        yield tmp
        _fsync_dir(tmp)
        _test_point("before-install")
        _install(tmp, target, force=force)
    except OSError as exc:
        raise KvcliError(f"{target}: write failed ({exc.strerror or exc}); nothing was changed") from None
    finally:
        if lock is not None:
            os.close(lock)
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)


def _install(tmp: Path, target: Path, *, force: bool) -> None:
    if target.exists():
        if not force:
            raise CacheExistsError(f"{target}: appeared while writing (use --force to replace it)")
        if not is_cache(target) and any(target.iterdir()):
            raise KvcliError(f"{target}: is a non-empty folder that is not a kvcli cache; refusing to replace it")
        if _exchange(tmp, target):  # tmp now holds the old cache; the finally clause removes it
            _installed(target)
            return
        old = target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)  # fallback: a brief moment without a cache, never a mix
        os.rename(tmp, target)
        _installed(target)
        _remove(old)
        return
    try:
        done = _renameat2(tmp, target, RENAME_NOREPLACE)
    except FileExistsError:
        raise CacheExistsError(f"{target}: appeared while writing (use --force to replace it)") from None
    if not done:
        os.rename(tmp, target)
    _installed(target)


def _installed(target: Path) -> None:
    """The new cache is in place: make the rename durable (best effort: it has happened either way)."""
    try:
        _fsync_dir(target.parent)
    except OSError:
        pass
    _test_point("installed")
