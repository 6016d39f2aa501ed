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


def _options(req: dict[str, Any]):
    """The request's generation options, checked as the CLI checks its own (kvcli/generation.py): a bad
    value is the CLI's message and exit 2, never a silent reinterpretation (a string `stop`)."""
    from ..engine.answer import GenerationOptions
    from ..generation import check_options

    o = req.get("options") or {}
    if not isinstance(o, dict):
        raise protocol.ProtocolError("options must be an object")
    return GenerationOptions(**check_options(o))


def _strings(req: dict[str, Any], name: str) -> list[str]:
    value = req.get(name)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise protocol.ProtocolError(f"{name} must be a non-empty list of strings")
    return value


def _history(req: dict[str, Any], session: Any) -> list[tuple[str, str]]:
    """The conversation the questions follow: `history` ([[question, answer], ...]) or `follow_up` (an
    `ask --json` answer, checked against this cache as the in-process `ask --follow-up` does)."""
    from ..engine.prompt import conversation

    if req.get("follow_up") is not None:
        return conversation.from_answer_json(req["follow_up"], session.token_ids, str(req.get("follow_up_name") or "--follow-up"))
    history = req.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 and all(isinstance(t, str) for t in h) for h in history):
        raise protocol.ProtocolError("history must be a list of [question, answer] pairs")
    return [(q, a) for q, a in history]


def ask(conn: Connection, warm: Warm, req: dict[str, Any]) -> int:
    """Answer every question from every cache with the events the in-process `kvcli ask` renders (kvcli/events.py);
    returns the exit code. The questions join their model's engine with everyone else's."""
    from ..events import ask_events

    from ..generation import check_trust

    caches, questions = _strings(req, "caches"), _strings(req, "questions")
    opts = _options(req)
    blend = req.get("blend")
    if blend is not None:
        from ..engine.cache.blend import check_fraction

        if isinstance(blend, bool) or not isinstance(blend, (int, float)):
            raise protocol.ProtocolError("blend must be a fraction from 0 to 1")
        blend = check_fraction(blend)
    check_trust(req.get("trust_remote_code"), req.get("model"))
    batch_size = req.get("batch_size")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise protocol.ProtocolError("batch_size must be a whole number of at least 1")

    def note(message: str) -> None:
        conn.send(protocol.event("note", message=message))

    def open_session(path: str):
        return warm.session(path, model=req.get("model"), revision=req.get("revision"), device=req.get("device") or "auto",
                            dtype=req.get("dtype"), trust_remote_code=bool(req.get("trust_remote_code")),
                            convert_dtype=bool(req.get("convert_dtype")), progress=note, blend=blend)

    def emit(ev: dict[str, Any]) -> None:
        conn.send(protocol.event(ev.pop("event"), **ev))

    return ask_events(open_session, caches, questions, opts, emit=emit, history_for=lambda lease: _history(req, lease.session),
                      batch_size=batch_size, stream=bool(req.get("stream", True)), watch=conn.watch, blend=blend is not None)


def prefill(conn: Connection, warm: Warm, req: dict[str, Any]) -> int:
    """Prefill every document into its cache with the warm model, as cli.prefill does in-process."""
    from .. import documents
    from ..format import manifest as mf

    pairs = req.get("docs")
    if not isinstance(pairs, list) or not pairs or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in pairs):
        raise protocol.ProtocolError("docs must be a non-empty list of [document, cache] paths")
    kv_bits = mf.check_kv_bits(req.get("kv_bits"), "kv_bits")
    after = req.get("after")
    if after is not None and not isinstance(after, str):
        raise protocol.ProtocolError("after must be a cache path")
    compression = req.get("compression")
    if compression not in (None, "small", "fast"):
        raise protocol.ProtocolError("compression must be small or fast")
    from ..engine import corpus
    from ..events import prefill_events

    def note(message: str) -> None:
        conn.send(protocol.event("note", message=message))

    def open_model():
        return warm.model(req.get("model"), revision=req.get("revision"), device=req.get("device") or "auto",
                          dtype=req.get("dtype") or "auto", trust_remote_code=bool(req.get("trust_remote_code")), progress=note,
                          weights=req.get("weights") or None)

    def emit(ev: dict[str, Any]) -> None:
        conn.send(protocol.event(ev.pop("event"), **ev))

    return prefill_events([corpus.Job(d, corpus.LocalTarget(Path(t))) for d, t in pairs], emit=emit, model=open_model,
                          read=lambda doc: documents.read(doc, req.get("encoding") or "utf-8"), incremental=False, upfront=True,
                          fit=lambda: _fit_check(req), cancelled=conn.cancelled, system=req.get("system"),
                          framing=req.get("framing") or "auto", chunk_size=req.get("chunk_size"), force=bool(req.get("force")),
                          kv_bits=kv_bits, after=after, compression=compression)


def _fit_check(req: dict[str, Any]):
    """A document too long for the requested model is refused from its tokenizer and config, before any load."""
    from ..engine import counting

    return counting.fit_check(req.get("model"), revision=req.get("revision"), framing=req.get("framing") or "auto",
                              system=req.get("system"), trust_remote_code=bool(req.get("trust_remote_code")))


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
