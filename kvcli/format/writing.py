"""Writing cache directories atomically. No torch here.

A cache is written into a hidden temporary sibling (".NAME.kvtmp-PID-..."), every file fsynced, and
swapped into place in one step (renameat2 RENAME_EXCHANGE when replacing), so a crash, kill or full
disk leaves the previous cache intact; leftovers of dead writers are removed by the next write.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CacheBusyError, CacheExistsError, KvcliError
from .store import TMP_MARK, is_cache

LOCK_SUFFIX = ".kvlock"  # ".NAME.kvlock" beside a cache: a prefill is writing NAME
BUSY_WAIT_S = 5.0  # how long a second writer waits for a lock: a prefill interrupted mid-chunk ends its chunk, then cleans up
_thread = threading.local()

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


def hidden_sibling(path: Path, tag: str = "") -> Path:
    """A kvcli writer's temporary name beside `path`, '.NAME.kvtmp-PID-[TAG-]HEX': remove_if_stale reads its pid."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{tag + '-' if tag else ''}{uuid.uuid4().hex[:8]}")


def clean_stale(target: Path) -> None:
    """Remove temporary siblings of `target` left by killed runs (their process is gone, their lock free)."""
    for entry in list(target.parent.glob(f".{glob.escape(target.name)}{TMP_MARK}*")):  # an unreadable folder: none
        remove_if_stale(entry)


def is_leftover(entry: Path) -> bool:
    """A hidden temporary folder (or file) of a kvcli writer: '.NAME.kvtmp-PID-...', or its lock '.NAME.kvlock'."""
    return entry.name.startswith(".") and (TMP_MARK in entry.name or entry.name.endswith(LOCK_SUFFIX))


def remove_if_stale(entry: Path, *, dry_run: bool = False) -> bool:
    """Remove a temporary sibling whose writer is gone (process dead, lock free); True if it was (or would be)."""
    if TMP_MARK in entry.name:
        pid = entry.name.split(TMP_MARK, 1)[1].split("-")[0]
        if pid.isdigit() and _alive(int(pid)):
            return False
        if entry.is_symlink() or not entry.is_dir():
            if not dry_run:
                _remove(entry)
            return True
    # a writer lock file (stale once no process holds its flock), or a folder a writer (perhaps on another
    # host sharing this folder) may still hold
    fd = None if entry.is_symlink() else _lock(entry, block=False)
    if fd is None:
        return False
    try:
        if not dry_run:
            _remove(entry)
    finally:
        os.close(fd)
    return True


def _lock(path: Path, *, block: bool) -> int | None:
    """An fd holding an exclusive flock on the folder or file `path` (released when the process dies), or None
    if held or gone."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def check_target(target: str | os.PathLike, *, force: bool) -> None:
    """Whether a cache may be written at `target` (a reserved name, an existing cache without force, a file,
    a missing output folder): asked again before any model loads, so a refusal costs no load."""
    target = Path(target)
    if TMP_MARK in target.name:
        raise KvcliError(f"{target}: names containing '{TMP_MARK}' are reserved for kvcli's temporary folders")
    if target.exists() and not target.is_dir():  # --force or not: a file is never replaced by a cache
        raise KvcliError(f"{target}: a file, not a cache; kvcli never replaces a file with a cache, not even with --force",
                         hint="give -o another path, or remove the file yourself")
    if target.exists() and not force:
        raise CacheExistsError(f"{target}: already exists (use --force to replace it)")
    parent = target.parent
    if not parent.is_dir():
        raise KvcliError(f"{parent}: output folder {'is not a folder' if parent.exists() else 'does not exist'}")


def _held() -> dict[str, list[int]]:
    """This thread's writer locks: lock path -> [fd, depth]."""
    return _thread.__dict__.setdefault("locks", {})


def lock_path(target: str | os.PathLike) -> Path:
    target = Path(target)
    return target.parent / f".{target.name}{LOCK_SUFFIX}"


@contextmanager
def writer_lock(target: str | os.PathLike) -> Iterator[None]:
    """Hold the one lock on writing `target` (a flock on '.NAME.kvlock' beside it, removed on exit): another
    writer, in any process or thread, is waited for BUSY_WAIT_S (an interrupted one cleaning up), then refused
    (CacheBusyError). A killed writer's lock file is free
    (flock ends with its process). Reentrant within a thread."""
    path = lock_path(target)
    key = os.path.abspath(path)
    held = _held()
    if key in held:
        held[key][1] += 1
        try:
            yield
        finally:
            held[key][1] -= 1
        return
    if not path.parent.is_dir():  # an output folder made later: the write itself takes the lock
        yield
        return
    fd = _take(path)
    deadline = time.monotonic() + BUSY_WAIT_S
    while fd is None and time.monotonic() < deadline:  # a writer just interrupted still cleaning up: free in a moment
        time.sleep(0.1)
        fd = _take(path)
    if fd is None:
        pid = _read_pid(path)
        raise CacheBusyError(f"{target}: another prefill{f' (pid {pid})' if pid else ''} is writing this cache now; "
                             "wait until it has finished")
    held[key] = [fd, 1]
    try:
        yield
    finally:
        del held[key]
        try:
            path.unlink()  # before closing: a waiter that opened this file sees it is gone and takes a new one
        except OSError:
            pass
        os.close(fd)


def wait_for_writer(target: str | os.PathLike) -> None:
    """Return once no other writer holds `target`'s lock (at once when none does); creates nothing."""
    path = lock_path(target)
    if os.path.abspath(path) in _held():
        return
    while path.exists():
        fd = _lock(path, block=False)
        if fd is not None:
            os.close(fd)
            return
        time.sleep(0.2)


def _take(path: Path) -> int | None:
    """An fd holding the flock of the lock file at `path`, or None while another writer holds it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise KvcliError(f"{path.parent}: cannot write here ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if same:
            try:
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
            except OSError:
                pass  # the pid only names the writer in a refusal
            return fd
        os.close(fd)  # its last holder removed it meanwhile: take the new one


def _read_pid(path: Path) -> str:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return ""
    return text if text.isdigit() else ""


@contextmanager
def atomic_cache_dir(target: str | os.PathLike, *, force: bool) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success swap it into `target`, else remove it.

    An existing cache is replaced only with force, and in one atomic step where the OS allows.
    """
    target = Path(target)
    check_target(target, force=force)
    with writer_lock(target):  # a second writer of this cache is refused here, before any work
        parent = target.parent
        clean_stale(target)
        tmp = hidden_sibling(target)
        try:
            tmp.mkdir()
        except OSError as exc:
            raise KvcliError(f"{parent}: cannot write here ({exc.strerror})") from None
        lock = _lock(tmp, block=True)  # tells clean_stale in other processes that this folder is in use
        try:
            yield tmp
            _fsync_dir(tmp)
            _install(tmp, target, force=force)
        except OSError as exc:
            raise KvcliError(f"{target}: write failed ({exc.strerror or exc}); nothing was changed") from None
        finally:
            if lock is not None:
                os.close(lock)
            if tmp.exists() or tmp.is_symlink():
                _remove(tmp)


def _install(tmp: Path, target: Path, *, force: bool) -> None:
    old = None
    if target.exists():
        if not force:
            raise CacheExistsError(f"{target}: appeared while writing (use --force to replace it)")
        if not is_cache(target) and any(target.iterdir()):
            raise KvcliError(f"{target}: is a non-empty folder that is not a kvcli cache; refusing to replace it")
        if not _renameat2(tmp, target, RENAME_EXCHANGE):  # swapped: tmp holds the old cache, the finally clause removes it
            old = hidden_sibling(target, "old")
            os.rename(target, old)  # fallback: a brief moment without a cache, never a mix
            os.rename(tmp, target)
    else:
        try:
            done = _renameat2(tmp, target, RENAME_NOREPLACE)
        except FileExistsError:
            raise CacheExistsError(f"{target}: appeared while writing (use --force to replace it)") from None
        if not done:
            os.rename(tmp, target)
    _installed(target)
    if old is not None:
        _remove(old)


def _installed(target: Path) -> None:
    """The new cache is in place: make the rename durable (best effort: it has happened either way)."""
    try:
        _fsync_dir(target.parent)
    except OSError:
        pass


def make_folder(folder: Path) -> None:
    """-o DIR for several documents: create it (and its parents) like mkdir -p."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvcliError(f"{folder}: cannot create the output folder ({exc.strerror or exc})") from None
