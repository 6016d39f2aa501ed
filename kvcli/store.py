"""Cache directories on disk: atomic write, consistent read, verification. No torch here.

A cache is a directory holding manifest.json and one shard per layer. It is written in a hidden
temporary sibling and swapped into place in one step, so readers see the old cache or the new one,
complete, and never a mix. Readers open the directory once and every file relative to it.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import manifest as mf
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
    """Open a regular file inside the directory, refusing symlinks and anything not a plain file."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheCorruptError(f"{where / name}: is a symbolic link; caches hold plain files only") from None
        raise CacheCorruptError(f"{where / name}: cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
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
    for _attempt in range(3):  # a concurrent replace can remove files between two opens: start over
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
            raise CacheMissingError(f"{path}: no {mf.MANIFEST_NAME} (not a cache, or an incomplete one)") from None
        try:
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


def verify(path: str | os.PathLike) -> mf.Manifest:
    """Check the manifest and every shard's size and sha256; raise CacheError naming the first bad file."""
    with open_cache(path) as cache:
        for i in range(len(cache.manifest.layers)):
            cache.read_shard(i)
        return cache.manifest


def is_cache(path: Path) -> bool:
    return path.is_dir() and (path / mf.MANIFEST_NAME).is_file() and TMP_MARK not in path.name


# ---------------------------------------------------------------- writing


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


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def clean_stale(target: Path) -> None:
    """Remove temporary siblings of `target` left by killed runs (their process is gone)."""
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
        shutil.rmtree(entry, ignore_errors=True)


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
    if target.exists() and not force:
        raise CacheExistsError(f"{target}: already exists (use --force to replace it)")
    if target.exists() and not target.is_dir():
        raise KvcliError(f"{target}: exists and is not a cache directory; refusing to replace it")
    parent = target.parent
    if not parent.is_dir():
        raise KvcliError(f"{parent}: output folder does not exist")
    clean_stale(target)
    tmp = parent / f".{target.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise KvcliError(f"{parent}: cannot write here ({exc.strerror})") from None
    try:
        yield tmp
        _fsync_dir(tmp)
        _install(tmp, target, force=force)
    except OSError as exc:
        raise KvcliError(f"{target}: write failed ({exc.strerror or exc}); nothing was changed") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, target: Path, *, force: bool) -> None:
    if target.exists():
        if not force:
            raise CacheExistsError(f"{target}: appeared while writing (use --force to replace it)")
        if not is_cache(target) and any(target.iterdir()):
            raise KvcliError(f"{target}: is a non-empty folder that is not a kvcli cache; refusing to replace it")
        if _exchange(tmp, target):  # tmp now holds the old cache; the finally clause removes it
            _fsync_dir(target.parent)
            return
        old = target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)  # fallback: a brief moment without a cache, never a mix
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    _fsync_dir(target.parent)
