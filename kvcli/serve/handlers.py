"""One client connection: read its request line (bounded), answer it with events, notice it leaving.

The ask and prefill handlers follow the in-process commands step by step (same order of notes,
warnings, per-item errors and answers), so the client renders exactly what `kvcli ask` would print.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import protocol
from .warm import Warm
from ..engine.scheduling.requests import Cancelled, EngineClosed
from ..errors import KvcliError

REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request line
SEND_TIMEOUT = 30.0  # seconds a client may leave an event unread before it counts as gone


class Connection:
    """The server's side of one client: bounded reads, timed writes, a cheap check for a hang-up."""

    def __init__(self, sock: socket.socket, stopping: Callable[[], bool]):
        self.sock, self._stopping = sock, stopping
        self.gone = False

    def read_request(self) -> dict[str, Any]:
        """The request line: at most MAX_LINE bytes within REQUEST_TIMEOUT, valid JSON of our version."""
        self.sock.settimeout(REQUEST_TIMEOUT)
        buf = bytearray()
        while b"\n" not in buf:
            try:
                chunk = self.sock.recv(65536)
            except (TimeoutError, socket.timeout):
                raise protocol.ProtocolError(f"no complete request line within {REQUEST_TIMEOUT:.0f} s") from None
            if not chunk:
                raise Cancelled("the client left")
            buf += chunk
            if len(buf) > protocol.MAX_LINE and b"\n" not in buf[: protocol.MAX_LINE + 1]:
                raise protocol.ProtocolError(f"request line longer than {protocol.MAX_LINE} bytes")
        line = bytes(buf[: buf.index(b"\n")])
        request = protocol.decode(line)
        if request.get("op") not in protocol.OPS:
            raise protocol.ProtocolError(f"unknown op {request.get('op')!r} (one of {', '.join(protocol.OPS)})")
        return request

    def send(self, data: bytes) -> None:
        if self.gone:
            raise Cancelled("the client left")
        try:
            self.sock.settimeout(SEND_TIMEOUT)
            self.sock.sendall(data)
        except OSError:
            self.gone = True
            raise Cancelled("the client left") from None

    def cancelled(self) -> bool:
        """Whether the client hung up (polled without blocking), or the server must stop now."""
        if self.gone or self._stopping():
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
                if not data:  # end of file: the client closed; anything else it sends is ignored
                    self.gone = True
        except BlockingIOError:
            pass
        except OSError:
            self.gone = True
        return self.gone

    @contextmanager
    def watch(self, request: Any):
        """While `request` is read: a thread that waits on the socket and cancels the request once the client hangs up."""
        wake, woken = os.pipe()

        def run() -> None:
            while True:
                readable, _, _ = select.select([self.sock, wake], [], [])
                if wake in readable:
                    return
                if self.cancelled():
                    request.cancel()
                    return

        watcher = threading.Thread(target=run, name="kvcli-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            os.write(woken, b"x")
            watcher.join()
            os.close(wake), os.close(woken)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def ask(conn: Connection, warm: Warm, req: dict[str, Any]) -> int:
    """Answer every question from every cache with the events the in-process `kvcli ask` renders (kvcli/events.py);
    returns the exit code. The questions join their model's engine with everyone else's."""
    from ..events import ask_events
    from ..requests import AskRequest

    request = AskRequest.from_wire(req)
    emit = _Emitter(conn)
    return ask_events(request, lambda spec: warm.session(spec, progress=emit.note), emit=emit, watch=conn.watch)


def prefill(conn: Connection, warm: Warm, req: dict[str, Any]) -> int:
    """Prefill every document into its cache with the warm model, as cli.prefill does in-process."""
    from .. import documents
    from ..engine import corpus, counting
    from ..events import prefill_events
    from ..requests import PrefillRequest

    request = PrefillRequest.from_wire(req)
    emit, m = _Emitter(conn), request.model

    def fit():  # a document too long for the requested model is refused from its tokenizer and config, before any load
        return counting.fit_check(m.source, revision=m.revision, framing=request.framing, system=request.system,
                                  trust_remote_code=m.trust_remote_code)

    return prefill_events([corpus.Job(d, corpus.LocalTarget(Path(t))) for d, t in request.docs], emit=emit,
                          model=lambda: warm.model(m, progress=emit.note), read=lambda doc: documents.read(doc, request.encoding),
                          incremental=False, upfront=True, fit=fit, cancelled=conn.cancelled, **request.options())


class _Emitter:
    """Events to the client as JSON lines (note: a progress line of the server's own)."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def __call__(self, ev: Any) -> None:
        self.conn.send(protocol.encode(ev.to_wire()))

    def note(self, message: str) -> None:
        self.conn.send(protocol.event("note", message=message))


def _control(conn: Connection, op: str, status: Callable[[], dict[str, Any]], stop: Callable[[], None]) -> None:
    """ping, status and stop: answered at once, not counted as requests (looking with `ps` changes no counter)."""
    if op == "ping":
        s = status()
        conn.send(protocol.event("done", exit_code=0, pid=s["pid"], version=s["version"], socket=s["socket"]))
    elif op == "status":
        conn.send(protocol.event("done", exit_code=0, status=status()))
    else:
        conn.send(protocol.event("done", exit_code=0, pid=status()["pid"]))
        stop()


def handle(conn: Connection, warm: Warm, status: Callable[[], dict[str, Any]], stop: Callable[[], None],
           log: Callable[[str], None]) -> str:
    """Serve one connection from request to final event; returns how it ended (for the counters)."""
    try:
        try:
            req = conn.read_request()
        except protocol.ProtocolError as exc:
            conn.send(protocol.fail(f"bad request: {exc}"))
            return "refused"
        op = req["op"]
        # a blend is echoed: a client seeing no echo (an older server) answers in its own process instead
        conn.send(protocol.event("accepted", op=op, **({"blend": req["blend"]} if op == "ask" and req.get("blend") is not None else {})))
        if op in ("ping", "status", "stop"):
            _control(conn, op, status, stop)
            return "control"
        try:
            code = (ask if op == "ask" else prefill)(conn, warm, req)
        except protocol.ProtocolError as exc:
            conn.send(protocol.fail(f"bad request: {exc}"))
            return "refused"
        except KvcliError as exc:
            conn.send(protocol.fail(str(exc), exc.exit_code, exc.hint, type(exc).__name__))
            return "failed"
        conn.send(protocol.event("done", exit_code=code))
        return "done"
    except (Cancelled, EngineClosed):
        if not conn.gone:  # the server is stopping: say so instead of leaving the client guessing
            try:
                conn.send(protocol.fail("the server stopped before the answer was complete"))
            except Cancelled:
                pass
        return "cancelled"
    except Exception as exc:  # a bug: one line to the client, the traceback to the server's log
        log(traceback.format_exc().rstrip())
        try:
            conn.send(protocol.fail(f"unexpected {exc.__class__.__name__} in the server: {exc}"))
        except Cancelled:
            pass
        return "failed"
    finally:
        conn.close()
