"""The kvcli socket protocol: JSON lines over a unix stream socket. Stdlib only (the client imports it).

One request per connection. The client sends one JSON object on one line; the server answers with
JSON objects, one per line, until a final `done` or `fail` event, then closes. Every message carries
`"v": PROTOCOL_VERSION`; a server that gets another version answers one `fail` event saying so.

Requests (`op`); every reply starts with an `accepted` event:
  ping     -> {"event": "done", "exit_code": 0, "pid", "version", "socket"}
  status   -> {"event": "done", "exit_code": 0, "status": {...}}   (what `kvcli ps` shows)
  stop     -> {"event": "done", "exit_code": 0, "pid"}, then the server shuts down
  ask      caches: [abs path], questions: [str], options: {max_new_tokens, temperature, top_p, seed,
           stop}, model, revision, device, dtype, convert_dtype, trust_remote_code, stream: bool,
           and optionally the conversation the questions follow: history: [[question, answer], ...],
           or follow_up: an `ask --json` answer object (follow_up_name: its file, for messages)
           blend: a fraction: the caches blended into one prompt (`ask --blend --recompute`), echoed in
           `accepted` (a client that sees no echo asks in its own process)
  prefill  docs: [[abs doc path, abs cache path]], model, revision, device, dtype, system, framing,
           chunk_size, encoding, force, trust_remote_code, kv_bits (8, 4 or null: lossless),
           compression ("small", "fast" or null: small)

Events streamed for ask/prefill (mirroring what `kvcli` writes in-process):
  accepted {"op", "blend"?}          the server took the request (sent first; blend: an ask's, echoed)
  note / warning {"message"}         stderr lines
  error {"message", "hint", "exit_code"}   a per-item failure (the batch goes on)
  text {"text"}                      answer text as it settles (plain output only)
  answer {"index", "answer": {...}}  one finished answer (Answer.to_json()), index = cache position
  progress {"index", "done", "total"}      a prefill's tokens done so far
  prefilled {"index", "record": {...}, "message", "hint"}   one document's record (engine.corpus.DocResult;
                                     message and hint: its failure)
  done {"exit_code"}                 the request finished
  fail {"message", "hint", "exit_code", "error"}   the request failed as a whole (one error line, exit code;
                                     error: the kvcli.errors class, so a client raises the same kind)

A client that closes its connection cancels its request (generation stops at the next token).
"""

from __future__ import annotations

import json
from typing import Any

from ..requests import ProtocolError  # noqa: F401  (a message that is not valid JSON lines of this protocol version)

PROTOCOL_VERSION = 2
MAX_LINE = 4 << 20  # longest request line the server reads (bytes); longer ones are refused
MAX_EVENT_LINE = 64 << 20  # longest event line a client accepts (an answer with every prompt id)
SOCKET_NAME = "kvcli.sock"
OPS = ("ping", "status", "stop", "ask", "prefill")




def encode(obj: dict[str, Any]) -> bytes:
    """One message as a line: compact JSON, the protocol version added, newline-terminated."""
    return (json.dumps({"v": PROTOCOL_VERSION, **obj}, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def decode(line: bytes) -> dict[str, Any]:
    """Parse one line into a message; raise ProtocolError for garbage or another protocol version."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"not a JSON line ({exc.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a JSON object")
    v = obj.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r} is not supported (this side speaks version {PROTOCOL_VERSION})")
    return obj


def event(kind: str, **fields: Any) -> bytes:
    return encode({"event": kind, **fields})


def fail(message: str, exit_code: int = 1, hint: str | None = None, error: str | None = None) -> bytes:
    return event("fail", message=message, exit_code=exit_code, hint=hint, error=error)
