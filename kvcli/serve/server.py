"""`kvcli serve`: a unix-socket server that keeps models and restored caches warm for many clients.

One thread per connection (at most MAX_CLIENTS at once); every question and prefill chunk runs through
its model's engine (engine/scheduling/scheduler.py), shared with the HTTP front end through one Warm (warm.py).
The socket is private to its owner (0600, in a 0700 folder when kvcli makes the folder). A flock on
SOCKET.lock makes a second server on the same path refuse to start; a socket left by a dead server is
replaced. SIGTERM or SIGINT: stop accepting, let in-flight requests finish (up to GRACE_S, then cancel
them with a clear error), remove the socket, return.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import client, handlers, protocol
from .warm import Warm
from .. import __version__
from ..errors import ServerError

MAX_CLIENTS = 64  # connections served at once; more get a "busy" error at once
GRACE_S = 30.0  # on stop, how long in-flight requests may take to finish before they are cancelled
LOG_NAME = "serve.log"

Log = Callable[[str], None]


def _heavy_imports() -> None:
    """Import torch and transformers before listening, so the first request does not pay for them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: F401

    from ..engine import answer, prefilling  # noqa: F401


class Server:
    """Bind with start(), run with serve_forever() (in the main thread for signals), end with stop()."""

    def __init__(self, path: str | os.PathLike, warm: Warm | None = None, *, idle_timeout: float | None = None, log: Log | None = None,
                 autostarted: bool = False):
        self.path = Path(os.path.abspath(path))
        self.autostarted = autostarted  # started by a command for the ones after it (kvcli serve may take its place)
        self.warm = warm or Warm()
        self.idle_timeout = idle_timeout
        self.log = log or (lambda message: None)
        self.started = time.time()
        # socket requests (ask, prefill; not ping/status/stop, so looking with `ps` changes nothing), and how
        # those that did not end well ended; answers, prefills and HTTP requests are counted by the Warm
        self.counts = {"socket_requests": 0, "failed": 0, "refused": 0, "cancelled": 0, "busy": 0}
        self.addresses: dict[str, str] = {"socket": str(self.path)}  # every address it listens on (`ps`, --detach)
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._stop = threading.Event()
        self._hard = threading.Event()
        self._active: set[threading.Thread] = set()
        self._mutex = threading.Lock()
        self._last_activity = time.monotonic()
        self._inode: tuple[int, int] | None = None

    # ---- lifecycle
    def start(self, preload: bool = True) -> None:
        """Take the socket path (refusing a live server), import the heavy modules, bind and listen."""
        _prepare_folder(self.path)
        self._lock_fd = _take_lock(self.path)
        try:
            if self.path.exists() or self.path.is_symlink():
                st = os.lstat(self.path)
                if not stat.S_ISSOCK(st.st_mode):
                    raise ServerError(f"{self.path}: exists and is not a socket; remove it or choose another --socket")
                if client.ping(self.path, timeout=2.0):  # cannot happen while we hold the lock, unless the lock file was removed
                    raise ServerError(f"{self.path}: a kvcli server is already running here")
                self.path.unlink()  # stale: left by a server that died
            if preload:
                _heavy_imports()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # the socket is born 0600: no moment where others may connect
            try:
                sock.bind(str(self.path))
            except OSError as exc:
                sock.close()
                raise ServerError(f"{self.path}: cannot listen here ({exc.strerror or exc})") from None
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
            sock.listen(128)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            self._listener = sock
        except BaseException:
            self._release_lock()
            raise

    def serve_forever(self) -> None:
        """Accept clients until stop() or a signal; then finish in-flight requests and clean up."""
        assert self._listener is not None, "start() first"
        restore = self._install_signals()
        self.log(f"kvcli {__version__} serving on {self.path} (pid {os.getpid()}, protocol {protocol.PROTOCOL_VERSION}, "
                 f"max memory {self.warm.max_memory / 1e9:.1f} GB)")
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([self._listener], [], [], 0.2)
                if readable:
                    try:
                        sock, _ = self._listener.accept()
                    except OSError:
                        continue
                    self._spawn(sock)
                elif self._idle_expired():
                    self.log(f"idle for {self.idle_timeout:g} s: stopping")
                    self._stop.set()
        finally:
            self._shutdown()
            restore()

    def stop(self, hard: bool = False) -> None:
        """Ask the server to stop (from any thread); hard also cancels in-flight requests at once."""
        self._stop.set()
        if hard:
            self._hard.set()

    def listening(self, kind: str, address: str) -> None:
        """Record another address this server answers on (the HTTP endpoint), for `ps` and --detach."""
        self.addresses[kind] = address

    def counters(self) -> dict[str, int]:
        """The one set of counters, named alike in `ps`, `ps --json` and the log (see COUNTERS)."""
        with self._mutex:
            mine = dict(self.counts)
        w = self.warm.counters()
        return {"requests": mine["socket_requests"] + w["http_requests"], "socket_requests": mine["socket_requests"],
                "http_requests": w["http_requests"], "answers": w["answers"], "prefills": w["prefills"],
                "failed": mine["failed"], "refused": mine["refused"], "cancelled": mine["cancelled"], "busy": mine["busy"]}

    def touch(self) -> None:
        """Count activity from outside the socket (HTTP requests) against --idle-timeout."""
        with self._mutex:
            self._last_activity = time.monotonic()

    def status(self) -> dict[str, Any]:
        with self._mutex:
            active = len(self._active - {threading.current_thread()})  # not counting the one asking
        return {"pid": os.getpid(), "socket": str(self.path), "version": __version__, "protocol": protocol.PROTOCOL_VERSION,
                "started": self.started, "uptime_s": round(time.time() - self.started, 3), "active": active,
                "idle_timeout": self.idle_timeout, "autostarted": self.autostarted, "addresses": dict(self.addresses),
                **self.warm.status(), **self.counters()}

    # ---- internals
    def _spawn(self, sock: socket.socket) -> None:
        with self._mutex:
            self._last_activity = time.monotonic()
            if len(self._active) >= MAX_CLIENTS:
                self.counts["socket_requests"] += 1
                self.counts["busy"] += 1
                try:
                    sock.settimeout(1.0)
                    sock.sendall(protocol.fail(f"busy: {MAX_CLIENTS} clients are being served; try again"))
                except OSError:
                    pass
                sock.close()
                return
            t = threading.Thread(target=self._serve_one, args=(sock,), daemon=True, name="kvcli-client")
            self._active.add(t)
        t.start()

    def _serve_one(self, sock: socket.socket) -> None:
        outcome = "failed"
        try:
            conn = handlers.Connection(sock, self._hard.is_set)
            outcome = handlers.handle(conn, self.warm, self.status, self.stop, self.log)
        finally:
            with self._mutex:
                if outcome != "control":  # ping, status, stop
                    self.counts["socket_requests"] += 1
                if outcome in self.counts:
                    self.counts[outcome] += 1
                self._active.discard(threading.current_thread())
                self._last_activity = time.monotonic()

    def _idle_expired(self) -> bool:
        if not self.idle_timeout:
            return False
        with self._mutex:
            if self._active:
                return False
            quiet = time.monotonic() - self._last_activity > self.idle_timeout
        if quiet and self.warm.busy:  # an answer in flight on another front end (HTTP) is activity too
            self.touch()
            return False
        return quiet

    def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._remove_socket()
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and not self._hard.is_set():
            with self._mutex:
                if not self._active:
                    break
            time.sleep(0.05)
        self._hard.set()  # whatever still runs stops at its next token, with an error to its client
        self.warm.close()  # every engine stops: no row of any front end keeps computing after this
        for t in list(self._active):
            t.join(timeout=5.0)
        self._release_lock()
        self.log(f"stopped ({counters_line(self.counters())})")

    def _remove_socket(self) -> None:
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:  # never remove a socket another server made meanwhile
                self.path.unlink()
        except OSError:
            pass

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum, _frame):
            if self._stop.is_set():  # a second Ctrl-C: do not wait for in-flight answers
                self.stop(hard=True)
            else:
                busy = len(self._active)  # no lock here: the main thread may hold it when the signal lands
                self.log(f"{signal.Signals(signum).name}: finishing {busy} in-flight request(s), then stopping")
                self.stop()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]


COUNTERS = ("requests", "socket_requests", "http_requests", "answers", "prefills", "failed", "refused", "cancelled", "busy")


def counters_line(counters: dict[str, Any]) -> str:
    """The counters as `ps` and the log print them: `requests 3, socket_requests 2, ..., busy 0`."""
    return ", ".join(f"{name} {counters.get(name, 0)}" for name in COUNTERS)


def _prepare_folder(path: Path) -> None:
    """Make the socket's folder (0700) if missing; make $KVCLI_HOME private if the socket lives there."""
    folder = path.parent
    if len(os.fsencode(str(path))) >= 104:
        raise ServerError(f"{path}: socket path too long for a unix socket; pass a shorter --socket or set KVCLI_SOCKET")
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
        os.chmod(folder, 0o700)
    elif folder == client.kvcli_home().resolve() or folder == client.kvcli_home():
        if folder.stat().st_uid == os.getuid():
            os.chmod(folder, 0o700)


def _take_lock(path: Path) -> int:
    """Hold an exclusive flock on PATH.lock for the server's life: a second server refuses at once."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pong = client.ping(path, timeout=2.0)
        who = f" (pid {pong['pid']})" if pong else ""
        raise ServerError(f"{path}: a kvcli server is already running here{who}", hint="kvcli serve --stop stops it") from None
    return fd


def log_path() -> Path:
    return client.kvcli_home() / LOG_NAME


def detach(path: Path, args: list[str], *, timeout: float = 300.0, env: dict[str, str] | None = None, cwd: str | None = None) -> int:
    """Start `kvcli serve ARGS` in the background (its own session, output to the log, `env` added to its
    environment); return its pid once it answers on `path`. ServerError (with the log's last line) if it
    exits or does not answer."""
    logfile = log_path()
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as log:
        start = log.tell()  # this server's lines begin here
        proc = subprocess.Popen([sys.executable, "-m", "kvcli", "serve", "--socket", str(path), *args],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
                                env={**os.environ, **env} if env else None, cwd=cwd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            reason, hint = _reason(logfile, start)
            reason = reason.removeprefix(f"{path}: ")
            raise ServerError(f"{path}: the server exited with code {code} before answering: {reason}", hint=hint or f"its log: {logfile}")
        pong = client.ping(path, timeout=1.0)
        if pong and pong.get("pid") == proc.pid:
            return proc.pid
        time.sleep(0.1)
    proc.terminate()
    raise ServerError(f"{path}: the server did not answer within {timeout:.0f} s (see {logfile})")


@contextmanager
def start_lock(path: Path, timeout: float = 330.0) -> Iterator[None]:
    """Hold PATH.start.lock while a client starts a server, so that clients starting at once start one
    (the lock goes with the holder's process: a client that dies mid-start never blocks the next)."""
    _prepare_folder(path)
    fd = os.open(path.with_name(path.name + ".start.lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ServerError(f"{path}: another kvcli has been starting a server here for {timeout:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _reason(logfile: Path, start: int) -> tuple[str, str | None]:
    """Why a server that wrote the log from byte `start` on stopped: its last error line and the hint after it
    (else its last line, such as a traceback's), without the `kvcli: error: ` prefix."""
    try:
        with open(logfile, "rb") as f:
            f.seek(start)
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)", None
    errors = [i for i, ln in enumerate(lines) if ln.startswith("kvcli: error: ")]
    if not errors:
        return (lines[-1] if lines else "(nothing in its log)"), None
    i = errors[-1]
    hint = lines[i + 1].removeprefix("hint: ") if i + 1 < len(lines) and lines[i + 1].startswith("hint: ") else None
    return lines[i].removeprefix("kvcli: error: "), hint


def take_over(path: Path) -> int | None:
    """Before `kvcli serve` starts on `path`: stop the server there if a command started it by itself (its pid),
    None when none runs; ServerError naming the command that frees the socket if the user started it."""
    reply = client.call(path, "status")
    if reply is None:
        return None
    status = reply.get("status") or {}
    if not status.get("autostarted"):
        raise ServerError(f"{path}: a kvcli server is already running here (pid {status.get('pid')})",
                          hint="'kvcli serve --stop' stops it (then run this again), or --socket PATH starts one beside it")
    return stop_server(path)


def stop_server(path: Path, timeout: float = GRACE_S + 10) -> int | None:
    """Ask the server on `path` to stop and wait until it has exited (its lock is free); its pid, or None."""
    reply = client.call(path, "stop")
    if reply is None:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _locked(path):
        time.sleep(0.05)
    return reply.get("pid")


def _locked(path: Path) -> bool:
    """Whether a server still holds PATH.lock."""
    try:
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
