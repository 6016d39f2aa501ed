"""kvcli's OpenAI-compatible HTTP endpoint: each prefilled document (a cache) is a "model".

GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions and the legacy POST /v1/completions (streamed as
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`). Errors are OpenAI error objects, never a traceback.
Each request is an AskRequest answered through events.ask_events, as the CLI and the socket server answer
(serve/answering.py); its row joins its model's engine (engine/scheduling/scheduler.py), decoded together with
every other request on that document up to the batch width. The engine admits at most `max_queue` more
requests waiting per model; more get 503. A request's blocking work (its cache opened, then its answer read in the
app's one pool) holds one of `workers` threads, taken only while one is free: past that it is answered 503 at once,
never queued in front of a pool (anyio's shared limiter or the executor's queue) where the engine's admission cannot
see it. A client that disconnects, streaming or not, takes its row out at
the next step. The session stays lent until the response is sent, so the server counts as in use until then.
Binding anything but loopback requires an API key (Bearer token).

What a request must be (the rest is refused before any model work): a Host header naming the server
(loopback names, the bound address, or a name given with `--allow-host`: 400 otherwise, which stops DNS
rebinding); for POST, a `Content-Type: application/json` body (415 otherwise: no HTML form can send
one without a CORS preflight) of at most `max_body` bytes (413, read no further); no browser origin
is allowed by CORS unless `--allow-origin` names it; `max_tokens` at most the server's `--max-tokens`
(400). Answers name no server path: model ids are relative to their `--docs` folder, and error
messages have the folders taken out.
Needs the `serve` extra (starlette, sse-starlette, uvicorn), imported only when a server is built.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheError, KvcliError, PromptTooLongError, extra_hint
from ..generation import DEFAULT_HTTP_MAX_TOKENS
from . import openai_api as oa
from .answering import Answering, ask_request, answer_record, chunks, refusal
from ..engine.scheduling.requests import EngineBusy
from .docs import DocsProvider, NotSectioned, Opened, Provider
from .protocol import MAX_LINE
from .warm import DEFAULT_MAX_QUEUE
from ..requests import Blend, Sections
from .guard import LOOPBACK_NAMES, allowed_hosts, check_bind, check_origins, is_loopback, parse_address, scrub  # noqa: F401

log = logging.getLogger("kvcli.serve.http")
DEFAULT_MAX_BODY = MAX_LINE  # bytes of a request body: the socket server's longest request line
DEFAULT_MAX_TOKENS = DEFAULT_HTTP_MAX_TOKENS  # most answer tokens one request may ask for (--max-tokens)
WORKERS = 256  # threads of the app's one pool opening caches and reading answers (each blocks on its engine's events)


def _once(fn):
    """fn, callable many times from any thread, run the first time only."""
    first = threading.Lock()

    def call() -> None:
        if first.acquire(blocking=False):
            fn()

    return call


def _check_key(request, token: bytes | None) -> None:
    if token is None:
        return
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token):
        raise oa.ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")


async def _read_json(request, max_body: int) -> Any:
    """The body as JSON, refused (415) unless JSON and (413) once past max_body bytes, never read further."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise oa.ApiError(415, f"Content-Type must be application/json (got {kind or 'none'})", code="unsupported_media_type")
    too_large = oa.ApiError(413, f"the request body is larger than {max_body:,} bytes", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_body):
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_body:
            raise too_large
    try:
        return json.loads(bytes(body))
    except ValueError:
        raise oa.ApiError(400, "the request body is not valid JSON") from None


def _open_failure(exc: KvcliError, documents: list[str] | None, hidden: Callable[[str], str]) -> oa.ApiError:
    if isinstance(exc, EngineBusy):  # as many requests already wait for this cache's restore as its engine would admit
        return refusal(exc, hidden)
    if isinstance(exc, NotSectioned):
        return oa.ApiError(400, f"sections: {exc}", param="sections")
    if isinstance(exc, CacheError):
        return oa.ApiError(409, hidden(str(exc)), param="documents" if documents else "model", code="cache_unusable")
    if isinstance(exc, PromptTooLongError):  # blended documents past the model's positions
        return oa.ApiError(400, f"documents: {exc.reason}", param="documents", code="context_length_exceeded")
    return oa.ApiError(500, hidden(str(exc)), type="server_error", code="model_unavailable")


@dataclass
class _Context:
    """What the app's endpoints share."""

    provider: Provider
    folders: list[str]  # the --docs folders as given and resolved, taken out of every message
    workers: ThreadPoolExecutor  # the app's one pool of threads opening caches and reading answers
    max_body: int
    max_tokens: int
    threads: int  # the pool's threads: a request holds one from its open to its answer's end
    opening: Any = None  # anyio CapacityLimiter with a token per thread (opens never wait for one), made in the event loop

    def __post_init__(self) -> None:
        self.free = threading.BoundedSemaphore(self.threads)  # the pool's threads not held by a request

    def hidden(self, text: str) -> str:
        return scrub(text, self.folders)

    def take_thread(self) -> Callable[[], None]:
        """One of the pool's threads for a request (its open, then its answer), or 503 at once when all are taken:
        a request never waits in a queue in front of the pool, where the engine's admission cannot see it.
        Returns the call that gives it back (once)."""
        if not self.free.acquire(blocking=False):
            raise oa.ApiError(503, "busy: every answer thread of the server is in use; retry later", type="server_error",
                              code="busy", headers={"Retry-After": "1"})
        return _once(self.free.release)


def _error(exc: oa.ApiError):
    from starlette.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _open(ctx: _Context, model_id: str, documents: list[str] | None, blend: Blend | None,
                sections: Sections | None = None) -> Opened:
    """The session a request names, lent by the provider (404 for no such cache, 409 for one that does not fit), opened
    in a thread the request has taken (take_thread); the opening limiter has a token for every such thread."""
    from anyio import CapacityLimiter, to_thread

    if ctx.opening is None:
        ctx.opening = CapacityLimiter(ctx.threads)
    try:
        if documents is not None:  # several caches blended into one prompt (engine/cache/blend.py)
            opened = await to_thread.run_sync(ctx.provider.open_blend, documents, blend, limiter=ctx.opening)
        elif sections is not None:  # only then: a provider need not know sections for any other request
            opened = await to_thread.run_sync(ctx.provider.open, model_id, sections, limiter=ctx.opening)
        else:
            opened = await to_thread.run_sync(ctx.provider.open, model_id, limiter=ctx.opening)
    except KvcliError as exc:
        raise _open_failure(exc, documents, ctx.hidden) from None
    if opened is None and documents is not None:
        raise oa.ApiError(404, "documents: a document names no cache (see GET /v1/models)", param="documents",
                          code="model_not_found")
    if opened is None:
        raise oa.ApiError(404, f"model '{model_id}' does not exist: no such cache (see GET /v1/models)",
                          param="model", code="model_not_found")
    return opened


async def _list_models(ctx: _Context, request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    rows = await run_in_threadpool(ctx.provider.models)
    return JSONResponse({"object": "list", "data": [oa.model_entry(i, row, ctx.hidden) for i, row in rows]})


async def _get_model(ctx: _Context, request):
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    model_id = request.path_params["model_id"]
    rows = dict(await run_in_threadpool(ctx.provider.models))
    if model_id not in rows:
        raise oa.ApiError(404, f"model '{model_id}' does not exist", param="model", code="model_not_found")
    return JSONResponse(oa.model_entry(model_id, rows[model_id], ctx.hidden))


async def _answer(ctx: _Context, parse, request):
    """A chat or text completion: the session lent, the AskRequest admitted by its engine (or refused at once),
    then one JSON response or the SSE stream; the session is given back once the response is sent."""
    from sse_starlette import EventSourceResponse
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse

    req = parse(await _read_json(request, ctx.max_body), max_tokens=ctx.max_tokens)
    thread = ctx.take_thread()
    run = None
    try:
        opened = await _open(ctx, req.model, req.documents, req.blend, req.sections)
    except BaseException:
        thread()
        raise
    release = _once(opened.release)
    try:
        run = Answering(ask_request(req, opened), opened.asker)
        run.start(ctx.workers)
        run.after(thread)  # the thread is free again once ask_events has ended in it
        if not await run.admitted():  # refused before its row joined the engine
            raise refusal(run.error(), ctx.hidden)
    except BaseException:
        if run is None:
            release()
            thread()
        else:
            run.cancel()
            run.after(release)
        raise
    cid = oa.completion_id(req.text)
    if not req.stream:
        try:
            return JSONResponse(oa.completion(cid, req.model, await answer_record(run, request), text=req.text))
        finally:
            release()
    started = [False]

    async def events():
        started[0] = True
        async for part in chunks(run, req, cid, release, ctx.hidden):
            yield part

    def never_started() -> None:
        if not started[0]:
            run.cancel()
            run.after(release)

    return EventSourceResponse(events(), sep="\n", ping=15, background=BackgroundTask(never_started))


def create_app(provider: Provider, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               hosts: Sequence[str] = LOOPBACK_NAMES, origins: Sequence[str] = (), max_body: int = DEFAULT_MAX_BODY,
               max_tokens: int = DEFAULT_MAX_TOKENS, workers: int = WORKERS):
    """The ASGI (starlette) app over `provider`. max_queue: requests waiting per model beyond those decoding
    (the engine's admission; set on the provider's Warm); hosts: the Host header names answered
    (allowed_hosts()); origins: browser origins CORS allows (none by default); max_body: bytes of a request
    body; max_tokens: most answer tokens a request may ask for; workers: threads opening caches and reading
    answers, one per request at a time (a request finding none free is answered 503 at once)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if getattr(provider, "warm", None) is not None:
        provider.warm.max_queue = max_queue
    folders = [str(f) for f in getattr(provider, "folders", ())]
    ctx = _Context(provider, folders + [str(Path(f).resolve()) for f in folders],
                   ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcli-answer"), max_body, max_tokens,
                   workers)
    token = api_key.encode() if api_key else None

    def endpoint(fn, *args):
        async def wrapped(request):
            try:
                _check_key(request, token)
                return await fn(ctx, *args, request)
            except oa.ApiError as exc:
                return _error(exc)
            except Exception as exc:  # a bug: logged here, one line to the client
                log.exception("unexpected error answering %s", request.url.path)  # the log is the server's: paths may stay
                return _error(oa.ApiError(500, f"internal error ({exc.__class__.__name__})", type="server_error"))

        return wrapped

    async def health(_ctx, request):
        return JSONResponse({"status": "ok"})

    async def not_found(request, exc):
        status = getattr(exc, "status_code", 404)
        text = "no such endpoint" if status == 404 else f"{request.method} is not allowed here"
        return _error(oa.ApiError(status, f"{request.url.path[:200]}: {text}", code="not_found" if status == 404 else "method_not_allowed"))

    routes = [
        Route("/v1/models", endpoint(_list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(_get_model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(_answer, oa.parse_chat), methods=["POST"]),
        Route("/v1/completions", endpoint(_answer, oa.parse_completion), methods=["POST"]),
        Route("/health", endpoint(health), methods=["GET"]),
    ]
    middleware = [
        Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts), www_redirect=False),
        Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                   allow_headers=["authorization", "content-type"], max_age=600),
    ]
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: not_found})
    app.state.workers = ctx.workers  # shut down with the server (Running.stop)
    return app


def require_extra() -> None:
    """KvcliError naming the serve extra and how to install it, when one of its packages cannot be imported."""
    try:
        import sse_starlette, starlette, uvicorn  # noqa: F401, E401
    except ImportError as exc:
        raise KvcliError(f"--http: the serve extra is not installed (no module named {exc.name!r})",
                         hint=extra_hint("OpenAI-compatible endpoints", "serve")) from None


def _listen(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so a taken port is one clear error rather than uvicorn's exit."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise KvcliError(f"--http {host}:{port}: cannot listen ({exc.strerror or exc})") from None


def _bound(host: str, port: int, provider: Provider | None, docs: Sequence[str], *, api_key: str | None = None,
           allow_hosts: Sequence[str] = (), allow_origins: Sequence[str] = (), **app_options):
    """(the uvicorn server, its bound socket): every name checked (a usage error) before binding."""
    check_bind(host, api_key)
    allowed_hosts(host, allow_hosts), check_origins(allow_origins)
    sock = _listen(host, port)
    require_extra()
    import uvicorn

    bound_host, bound_port = sock.getsockname()[:2]
    app = create_app(provider or DocsProvider(docs), api_key=api_key, hosts=allowed_hosts(bound_host, allow_hosts),
                     origins=check_origins(allow_origins), **app_options)
    config = uvicorn.Config(app, host=bound_host, port=bound_port, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config), sock


class Running:
    """An HTTP server answering in a background thread (tests, or next to another server)."""

    def __init__(self, server, sock: socket.socket, thread: threading.Thread):
        self.server, self.thread = server, thread
        self.host, self.port = sock.getsockname()[:2]

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.server.config.app.state.workers.shutdown(wait=False)  # its idle answer threads end


def start(host: str, port: int, *, provider: Provider | None = None, docs: Sequence[str] = (), ready_timeout: float = 30.0,
          **options) -> Running:
    """Serve in a daemon thread; returns once it accepts connections (port 0 picks a free port). options: create_app's
    (api_key, max_queue, max_body, max_tokens, workers) and allow_hosts/allow_origins (allowed_hosts, check_origins)."""
    server, sock = _bound(host, port, provider, docs, **options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvcli-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        raise KvcliError(f"--http {host}:{port}: the server did not start")
    return Running(server, sock, thread)


def run(host: str, port: int, *, provider: Provider | None = None, docs: Sequence[str] = (), **options) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM (in-flight answers end first, up to 5 s); options as start's."""
    server, sock = _bound(host, port, provider, docs, **options)
    server.run(sockets=[sock])
