"""kvcli serve and ps: the warm server on a unix socket (and HTTP), and what it holds (library: kvcli.serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ServerError, UsageError
from ..generation import DEFAULT_BATCH, DEFAULT_HTTP_MAX_TOKENS
from .output import Output, human_bytes
from .app import command
from .common import human_age
from .options import JsonOpt, QuietOpt, SocketOpt


@command
def serve(
    socket: SocketOpt = None,
    max_memory: Annotated[Optional[str], typer.Option(metavar="SIZE", help="Most memory for models and caches, on their device (on a GPU: GPU memory), e.g. 8G or 512M (default: half the RAM).", show_default=False)] = None,
    max_host_memory: Annotated[Optional[str], typer.Option(metavar="SIZE", help="On a GPU, most pinned host memory for caches pushed out of --max-memory, copied back up instead of restored from disk (default: none).", show_default=False)] = None,
    idle_timeout: Annotated[Optional[str], typer.Option(metavar="DURATION", help="Exit after this long unused, e.g. 30s, 10m, 2h (default: never).", show_default=False)] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Run in the background: print its pid once it answers; log to $KVCLI_HOME/serve.log.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the server running on the socket.")] = False,
    http_at: Annotated[Optional[str], typer.Option("--http", metavar="HOST:PORT", help="Also serve the caches under --docs as OpenAI-compatible models at HOST:PORT (needs kvcli[serve]).", show_default=False)] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", metavar="KEY", envvar="KVCLI_API_KEY", help="Bearer token HTTP clients must send; required unless HOST is loopback ($KVCLI_API_KEY).", show_default=False)] = None,
    docs: Annotated[list[Path], typer.Option("--docs", metavar="DIR", show_default=False, help="Folder whose caches --http offers as models (repeatable; default: the current folder).")] = [],  # noqa: B006
    batch_size: Annotated[int, typer.Option(min=1, metavar="N", help="Questions on one document decoded together, from any clients (1: one at a time).")] = DEFAULT_BATCH,
    allow_host: Annotated[list[str], typer.Option("--allow-host", metavar="NAME", show_default=False, help="Also answer HTTP requests whose Host header is NAME (repeatable; default: loopback names and the bound address only).")] = [],  # noqa: B006
    allow_origin: Annotated[list[str], typer.Option("--allow-origin", metavar="ORIGIN", show_default=False, help="Let web pages from ORIGIN (e.g. https://app.example.org) call the HTTP endpoint (repeatable; default: none).")] = [],  # noqa: B006
    autostarted: Annotated[bool, typer.Option("--autostarted", hidden=True, help="Started by a command for the ones after it: a later `kvcli serve` takes its place.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, metavar="N", help="Most answer tokens one HTTP request may ask for (max_tokens); a request asking for more is refused with HTTP 400.")] = DEFAULT_HTTP_MAX_TOKENS,
    quiet: QuietOpt = False,
) -> int:
    """Keep models and restored caches warm on a unix socket; ask and prefill use it when it runs."""
    from .. import units
    from ..serve import client, server as sv

    out = Output(quiet=quiet)
    path = client.socket_path(socket)
    size = units.parse_size(max_memory) if max_memory else None
    host_size = units.parse_size(max_host_memory, "--max-host-memory") if max_host_memory else None
    idle = units.parse_duration(idle_timeout) if idle_timeout else None
    web = _web_options(http_at, api_key, docs, allow_host, allow_origin, max_tokens)  # checked before anything starts
    if stop:
        pid = sv.stop_server(path)
        if pid is None:
            raise ServerError(f"{path}: no kvcli server answers here")
        out.note(f"stopped the server on {path} (pid {pid})")
        return 0
    if not autostarted:  # the warm server a command started by itself gives way; one the user started is named
        replaced = sv.take_over(path)
        if replaced is not None:
            out.note(f"kvcli: note: stopped the warm server that a command started by itself (pid {replaced}); this one takes its place")
    if detach:
        args = (["--max-memory", max_memory] if max_memory else []) + (["--idle-timeout", idle_timeout] if idle_timeout else [])
        args += ["--autostarted"] if autostarted else []
        args += ["--max-host-memory", max_host_memory] if max_host_memory else []
        args += ["--batch-size", str(batch_size), *_web_args(web)]
        return _detach(out, path, args, api_key)
    from ..serve.warm import Warm

    server = sv.Server(path, Warm(size, batch_size=batch_size, host_memory=host_size), idle_timeout=idle, log=out.note, autostarted=autostarted)
    with out.status("starting"):
        server.start()
    return _serve(out, server, web)


def _web_options(http_at: Optional[str], api_key: Optional[str], docs: list[Path], allow_host: list[str],
                 allow_origin: list[str], max_tokens: int) -> Optional[dict]:
    """--http and the options that go with it, checked (UsageError), as http.start's keywords; None without --http."""
    if not http_at:
        if docs or allow_host or allow_origin:
            raise UsageError(f"{'--docs' if docs else '--allow-host' if allow_host else '--allow-origin'} goes with --http HOST:PORT")
        return None
    from ..serve import http

    host, port = http.parse_address(http_at)
    http.require_extra()  # before anything starts, here or detached
    http.check_bind(host, api_key)
    http.allowed_hosts(host, allow_host), http.check_origins(allow_origin)
    docs = [d.resolve() for d in (docs or [Path(".")])]
    for d in docs:
        if not d.is_dir():
            raise UsageError(f"--docs {d}: not a folder")
    return {"host": host, "port": port, "at": http_at, "docs": docs, "api_key": api_key, "allow_hosts": allow_host,
            "allow_origins": allow_origin, "max_tokens": max_tokens}


def _web_args(web: Optional[dict]) -> list[str]:
    """The --http options again, for a detached server's command line (the API key travels in its environment)."""
    if web is None:
        return []
    args = ["--http", web["at"], *[a for d in web["docs"] for a in ("--docs", str(d))], "--max-tokens", str(web["max_tokens"])]
    return args + [a for h in web["allow_hosts"] for a in ("--allow-host", h)] + [a for o in web["allow_origins"] for a in ("--allow-origin", o)]


def _detach(out: Output, path: Path, args: list[str], api_key: Optional[str]) -> int:
    from ..serve import client, server as sv

    pid = sv.detach(path, args, env={"KVCLI_API_KEY": api_key} if api_key else None)  # the key never on a command line
    out.write(f"{pid}\n")
    reply = client.call(path, "status") or {}
    addresses = (reply.get("status") or {}).get("addresses") or {"socket": str(path)}
    out.note(f"serving on {_addresses(addresses)} (log: {sv.log_path()})")
    return 0


def _serve(out: Output, server, web: Optional[dict]) -> int:
    """Serve in the foreground (with the HTTP endpoint beside the socket, when asked) until stopped."""
    running = None
    if web is not None:
        from ..serve import http
        from ..serve.docs import WarmProvider

        running = http.start(web["host"], web["port"], provider=WarmProvider(server.warm, web["docs"], on_use=server.touch),
                             api_key=web["api_key"], allow_hosts=web["allow_hosts"], allow_origins=web["allow_origins"],
                             max_tokens=web["max_tokens"])
        server.listening("http", running.base_url)
        out.note(f"OpenAI-compatible endpoint on {running.base_url} for the caches in {', '.join(map(str, web['docs']))}")
    try:
        server.serve_forever()
    finally:
        if running is not None:
            running.stop()
    return 0


def _addresses(addresses: dict) -> str:
    """Every address a server listens on: `socket PATH and http http://HOST:PORT`."""
    return " and ".join(f"{kind} {where}" for kind, where in addresses.items())


@command
def ps(
    socket: SocketOpt = None,
    json_out: JsonOpt = False,
) -> int:
    """Show what the running server holds: models, caches, bytes, last use, answers served."""
    import time

    from rich.table import Table
    from rich.text import Text

    from ..serve import client

    out = Output()
    path = client.socket_path(socket)
    reply = client.call(path, "status")
    if reply is None:
        raise ServerError(f"{path}: no kvcli server answers here", hint="start one with 'kvcli serve --detach'")
    s = reply.get("status") or {}
    if json_out:
        out.json_doc(s)
        return 0
    now = time.time()
    from ..serve.server import counters_line

    out.table(Text(f"pid {s['pid']} on {_addresses(s.get('addresses') or {'socket': s['socket']})}, up {human_age(s['uptime_s'])}, "
                   f"{human_bytes(s['bytes'])} of {human_bytes(s['max_memory'])} held, {s['active']} active"))
    out.table(Text(counters_line(s)))
    if s.get("host_tier"):  # on a GPU: caches pushed out of device memory, kept in pinned host memory
        h = s["host_tier"]
        out.table(Text(f"host tier: {h['caches']} cache(s), {human_bytes(h['bytes'])} of {human_bytes(h['limit'])}, "
                       f"{h['hits']} copied back up, {h['dropped']} dropped"))
    models = Table("model", "dtype", "device", "memory", "last used", "answers", "prefills", "decoding", title="models")
    for m in s["models"]:
        models.add_row(Text(str(m["name"])), m["dtype"], m["device"], human_bytes(m["bytes"]), human_age(now - m["last_used"]) + " ago",
                       str(m["answers"]), str(m.get("prefills", 0)), m.get("decoding") or "idle")
    caches = Table("cache", "tokens", "model", "memory", "last used", "answers", "most together", title="caches")
    for c in s["caches"]:
        b = c.get("batch")  # questions one decoding step ran at most, of the batch's width
        caches.add_row(Text(c["path"]), f"{c['num_tokens']:,}", Text(str(c["model"])), human_bytes(c["bytes"]), human_age(now - c["last_used"]) + " ago",
                       str(c["answers"]), f"{b['peak_rows']} of {b['width']}" if b else "1")
    out.table(models)
    out.table(caches)
    return 0
