"""The client side of a served command: ask a running `kvcli serve` and render its events through Output
exactly as the in-process path renders the same results (paths spelled as the user gave them).
Imports nothing heavy: this is the path where the CLI must start fast (no torch, numpy, pydantic)."""

from __future__ import annotations

import functools
import os
from typing import Optional

from dataclasses import replace

from ..errors import ServerError
from ..events import from_wire
from ..requests import AskRequest, PrefillRequest
from .output import Output
from .rendering import message


def run(out: Output, require: Optional[bool], request: AskRequest | PrefillRequest, spellings: list[Optional[str]], *,
        render=None) -> Optional[int]:
    """Run an ask or prefill on a running server (None when none answers and none is required), handing its events
    to `render` (cli/rendering.py: what the in-process path renders its own events with), messages with
    paths spelled as the user gave them."""
    from ..serve import client

    op = "ask" if isinstance(request, AskRequest) else "prefill"
    blend = getattr(request, "blend", None)
    where = client.socket_path()
    conn = client.open_request(where, op, request.to_wire())
    if conn is None and require is None and autostart(out, where):
        conn = client.open_request(where, op, request.to_wire())
    if conn is not None and blend is not None and conn.accepted.get("blend") is None:
        conn.close()  # a server that does not echo the blend would answer each cache alone: this process blends
        if require:
            raise ServerError(f"{where}: this server cannot blend caches", hint="restart it ('kvcli serve --stop'), or drop --server")
        return None
    if conn is None:
        if require:
            raise ServerError(f"{where}: no kvcli server answers here", hint="start one with 'kvcli serve --detach', or drop --server")
        return None
    own = _spelling(spellings)
    render = render or functools.partial(message, out)
    with conn:
        for ev in conn.events():
            kind = ev.get("event")
            if kind == "done":
                return int(ev.get("exit_code", 1))
            if kind == "fail":
                raise client.failure(ev, own)
            typed = from_wire(ev)
            if typed is not None:
                render(replace(typed, message=own(typed.message)) if isinstance(getattr(typed, "message", None), str) else typed)
    raise ServerError(f"{where}: the server stopped before the answer was complete")


def _spelling(spellings: list[Optional[str]]):
    """text -> text with the absolute paths the server names spelled as the user gave them."""
    spelled = sorted({(os.path.abspath(n), n) for n in spellings if n and os.path.abspath(n) != n}, key=lambda p: -len(p[0]))

    def own(text: str) -> str:
        for absolute, given in spelled:
            text = text.replace(absolute, given)
        return text

    return own


AUTOSTART_IDLE = "10m"  # how long a server started for a shell loop stays up unused


def autostart_allowed() -> bool:
    """KVCLI_AUTOSTART=0 never starts a server, =1 always does; unset, it does unless CI is set."""
    value = os.environ.get("KVCLI_AUTOSTART", "").strip().lower()
    if value in ("0", "no", "off", "false", "never"):
        return False
    if value in ("1", "yes", "on", "true", "always"):
        return True
    return not os.environ.get("CI")


def autostart(out: Output, where) -> bool:
    """Start a server in the background for the commands that follow (a shell loop of asks), unless
    autostart is off; True once one answers on `where`. Two shells starting at once get one server: the
    start is serialised by a lock beside the socket, and the second finds the first's server."""
    if not autostart_allowed():
        return False
    from .. import units
    from ..serve import client, server as sv

    idle = os.environ.get("KVCLI_AUTOSTART_IDLE") or AUTOSTART_IDLE
    units.parse_duration(idle, "KVCLI_AUTOSTART_IDLE")  # a bad value is a usage error here, not a server that dies at start
    with sv.start_lock(where):
        if client.ping(where, timeout=2.0):
            return True
        pid = sv.detach(where, ["--idle-timeout", idle, "--autostarted"], cwd="/")
    out.note(f"kvcli: note: started a warm server (pid {pid}; it exits after {idle} unused; 'kvcli serve --stop' stops it, "
             f"--no-server or KVCLI_AUTOSTART=0 keeps a command in-process)")
    return True


def answers(out: Output, require: Optional[bool]) -> bool:
    """Whether a server answers on the socket, started here if none does and autostart allows
    (ServerError if none does and one is required)."""
    from ..serve import client

    where = client.socket_path()
    if client.ping(where) or (require is None and autostart(out, where)):
        return True
    if require:
        raise ServerError(f"{where}: no kvcli server answers here", hint="start one with 'kvcli serve --detach', or drop --server")
    return False

