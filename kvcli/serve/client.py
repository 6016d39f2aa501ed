"""Talk to a running `kvcli serve`: find its socket, send one request, yield its events. Stdlib only.

The CLI (kvcli/cli/) uses this before anything heavy is imported, so a served `kvcli ask` never loads torch.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import protocol
from ..errors import KvcliError, ServerError

CONNECT_TIMEOUT = 10.0  # seconds to connect and to get the server's first event (a loaded machine can be slow)
FINAL = ("done", "fail")


def kvcli_home() -> Path:
    """$KVCLI_HOME, else the per-user cache folder (the rule of kvcli.engine.model.models.kvcli_home, without its imports)."""
    if os.environ.get("KVCLI_HOME"):
        return Path(os.environ["KVCLI_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcli"


def socket_path(explicit: str | os.PathLike | None = None) -> Path:
    """The server's socket: the one named, else $KVCLI_SOCKET, else $KVCLI_HOME/kvcli.sock (absolute)."""
    where = explicit or os.environ.get("KVCLI_SOCKET") or kvcli_home() / protocol.SOCKET_NAME
    return Path(os.path.abspath(os.path.expanduser(str(where))))


class ProtocolMismatch(ServerError):
    """The server speaks another protocol version (or not this protocol at all)."""


class Connection:
    """One request on one connection: events are read line by line until `done` or `fail`."""

    def __init__(self, sock: socket.socket, path: Path):
        self.sock, self.path = sock, path
        self._reader = sock.makefile("rb")
        self.accepted: dict[str, Any] = {}  # the server's `accepted` event (open_request)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(protocol.encode(message))

    def next_event(self) -> dict[str, Any]:
        """The next event; ServerError if the server went away or spoke another protocol."""
        try:
            line = self._reader.readline(protocol.MAX_EVENT_LINE + 1)
        except TimeoutError:
            raise ServerError(f"{self.path}: the server did not answer in time") from None
        except OSError as exc:
            raise ServerError(f"{self.path}: the server connection broke ({exc.strerror or exc})") from None
        if not line.endswith(b"\n"):
            raise ServerError(f"{self.path}: the server stopped before finishing the answer")
        try:
            return protocol.decode(line)
        except protocol.ProtocolError as exc:
            raise ProtocolMismatch(f"{self.path}: the server's reply is not understood: {exc}",
                              hint="restart the server with this kvcli: kvcli serve --stop; kvcli serve --detach") from None

    def events(self) -> Iterator[dict[str, Any]]:
        """Every event up to and including the final one."""
        self.sock.settimeout(None)  # answers may wait behind other clients' questions
        while True:
            ev = self.next_event()
            yield ev
            if ev.get("event") in FINAL:
                return

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(path: Path, timeout: float = CONNECT_TIMEOUT) -> Connection | None:
    """A connection to the server on `path`, or None when nothing listens there (absent or stale socket)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:  # absent, refused (stale), not a socket, no permission, path too long: no server to use
        sock.close()
        return None
    return Connection(sock, path)


def open_request(path: Path, op: str, fields: dict[str, Any] | None = None, *, timeout: float = CONNECT_TIMEOUT) -> Connection | None:
    """Send one request and wait for the server to accept it; None when no server answers in time.

    A `fail` as the first event (another protocol version, a bad request) raises ServerError.
    """
    conn = connect(path, timeout)
    if conn is None:
        return None
    try:
        conn.send({"op": op, **(fields or {})})
        first = conn.next_event()
    except ProtocolMismatch:
        conn.close()
        raise
    except (ServerError, OSError):
        conn.close()
        return None
    if first.get("event") == "fail":
        conn.close()
        raise ServerError(f"{path}: {first.get('message')}", hint=first.get("hint"))
    if first.get("event") != "accepted":
        conn.close()
        raise ServerError(f"{path}: unexpected first event {first.get('event')!r} from the server")
    conn.accepted = first
    return conn


def call(path: Path, op: str, fields: dict[str, Any] | None = None, *, timeout: float = CONNECT_TIMEOUT) -> dict[str, Any] | None:
    """A one-reply request (ping, status, stop): the final event, or None when no server answers."""
    conn = open_request(path, op, fields, timeout=timeout)
    if conn is None:
        return None
    with conn:
        last: dict[str, Any] = {}
        for ev in conn.events():
            last = ev if ev.get("event") not in ("note",) else last
        return last


def ping(path: Path, timeout: float = CONNECT_TIMEOUT) -> dict[str, Any] | None:
    """The server's pong ({pid, version, socket}) or None."""
    reply = call(path, "ping", timeout=timeout)
    return reply if reply and reply.get("event") == "done" else None


def failure(ev: dict[str, Any], spell=lambda text: text) -> KvcliError:
    """The error a `fail` event stands for: of the kvcli error class the server named (else ServerError), with the
    exit code the server gave (3 for a cache that does not fit)."""
    from .. import errors

    kind = getattr(errors, str(ev.get("error")), None)
    kind = kind if isinstance(kind, type) and issubclass(kind, KvcliError) else ServerError
    exc = kind(spell(str(ev.get("message"))), hint=ev.get("hint"))
    exc.exit_code = int(ev.get("exit_code") or 1)
    return exc
