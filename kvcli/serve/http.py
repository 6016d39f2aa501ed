"""kvcli's OpenAI-compatible HTTP endpoint: each prefilled document (a cache) is a "model".

GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions and the legacy POST /v1/completions (streamed as
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`). Errors are OpenAI error objects, never a traceback.
Each request's answer joins its model's engine (engine/scheduling/scheduler.py), decoded together with every
other request on that document up to the batch width; at most `max_queue` more requests wait per
model, more get 503. A client that disconnects, streaming or not, takes its row out at the next step.
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

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CacheError, KvcliError, PromptTooLongError, extra_hint
from ..generation import DEFAULT_HTTP_MAX_TOKENS
from . import openai_api as oa
from .docs import DocsProvider, Opened, Provider
from .protocol import MAX_LINE
from ..requests import Blend
from .guard import LOOPBACK_NAMES, allowed_hosts, check_bind, check_origins, is_loopback, parse_address, scrub  # noqa: F401
from ..engine.scheduling.requests import Cancelled, EngineClosed

log = logging.getLogger("kvcli.serve.http")
DEFAULT_MAX_QUEUE = 32  # requests waiting per model before 503
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there
DEFAULT_MAX_BODY = MAX_LINE  # bytes of a request body: the socket server's longest request line
DEFAULT_MAX_TOKENS = DEFAULT_HTTP_MAX_TOKENS  # most answer tokens one request may ask for (--max-tokens)


class _Gate:
    """Admission for one model: at most `slots` requests decoding (the batch width) plus `limit` waiting in
    the engine; `held` counts both. Each admitted request waits for its answer in a thread of its own."""

    def __init__(self, limit: int, slots: int = 1):
        self.limit, self.slots, self.held = limit, slots, 0
        self.pool = ThreadPoolExecutor(max_workers=slots + limit, thread_name_prefix="kvcli-answer")

    def reserve(self) -> None:
        if self.held >= self.slots + self.limit:
            raise oa.ApiError(503, f"busy: {self.held} requests already running or waiting for this model; retry later",
                              type="server_error", code="busy", headers={"Retry-After": "1"})
        self.held += 1

    async def start(self, work) -> asyncio.Future:
        """Run `work` (it blocks on the engine's events) in a thread; the reservation ends when it does."""
        fut = asyncio.get_running_loop().run_in_executor(self.pool, work)
        fut.add_done_callback(self._release)
        return fut

    def _release(self, fut: asyncio.Future) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved here: an abandoned answer's Cancelled is expected, not "never retrieved"
        self.held -= 1


def _once(fn):
    """fn, callable many times from any thread, run the first time only."""
    first = threading.Lock()

    def call() -> None:
        if first.acquire(blocking=False):
            fn()

    return call


def create_app(provider: Provider, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               hosts: Sequence[str] = LOOPBACK_NAMES, origins: Sequence[str] = (), max_body: int = DEFAULT_MAX_BODY,
               max_tokens: int = DEFAULT_MAX_TOKENS):
    """The ASGI (starlette) app over `provider`. hosts: the Host header names answered (allowed_hosts());
    origins: browser origins CORS allows (none by default); max_body: bytes of a request body;
    max_tokens: most answer tokens a request may ask for."""
    from sse_starlette import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from ..engine import answer as an
    from ..engine.prompt import conversation

    gates: dict[int, _Gate] = {}
    token = api_key.encode() if api_key else None
    folders = [str(f) for f in getattr(provider, "folders", ())]
    folders += [str(Path(f).resolve()) for f in folders]

    def hidden(text: str) -> str:
        return scrub(text, folders)

    def error(exc: oa.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def endpoint(fn):
        async def wrapped(request):
            try:
                if token is not None:
                    given = request.headers.get("authorization", "")
                    scheme, _, value = given.partition(" ")
                    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token):
                        raise oa.ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")
                return await fn(request)
            except oa.ApiError as exc:
                return error(exc)
            except Exception as exc:  # a bug: logged here, one line to the client
                log.exception("unexpected error answering %s", request.url.path)  # the log is the server's: paths may stay
                return error(oa.ApiError(500, f"internal error ({exc.__class__.__name__})", type="server_error"))

        return wrapped

    async def open_model(model_id: str, documents: list[str] | None = None, blend: Blend | None = None) -> Opened:
        try:
            if documents is not None:  # several caches blended into one prompt (engine/cache/blend.py)
                opened = await run_in_threadpool(provider.open_blend, documents, blend)
            else:
                opened = await run_in_threadpool(provider.open, model_id)
        except CacheError as exc:
            raise oa.ApiError(409, hidden(str(exc)), param="documents" if documents else "model", code="cache_unusable") from None
        except PromptTooLongError as exc:  # blended documents past the model's positions
            raise oa.ApiError(400, f"documents: {exc.reason}", param="documents", code="context_length_exceeded") from None
        except KvcliError as exc:
            raise oa.ApiError(500, hidden(str(exc)), type="server_error", code="model_unavailable") from None
        if opened is None and documents is not None:
            raise oa.ApiError(404, "documents: a document names no cache (see GET /v1/models)", param="documents",
                              code="model_not_found")
        if opened is None:
            raise oa.ApiError(404, f"model '{model_id}' does not exist: no such cache (see GET /v1/models)",
                              param="model", code="model_not_found")
        return opened

    async def list_models(request):
        rows = await run_in_threadpool(provider.models)
        return JSONResponse({"object": "list", "data": [oa.model_entry(i, row, hidden) for i, row in rows]})

    async def get_model(request):
        model_id = request.path_params["model_id"]
        rows = dict(await run_in_threadpool(provider.models))
        if model_id not in rows:
            raise oa.ApiError(404, f"model '{model_id}' does not exist", param="model", code="model_not_found")
        return JSONResponse(oa.model_entry(model_id, rows[model_id], hidden))

    async def read_body(request) -> bytes:
        """The body, refused (415) unless JSON and (413) once past max_body bytes, never read further."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise oa.ApiError(415, f"Content-Type must be application/json (got {kind or 'none'})", code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            raise oa.ApiError(413, f"the request body is larger than {max_body:,} bytes", code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_body:
                raise oa.ApiError(413, f"the request body is larger than {max_body:,} bytes", code="request_too_large")
        return bytes(body)

    async def chat(request):
        return await answer(request, oa.parse_chat)

    async def completions(request):
        return await answer(request, oa.parse_completion)

    async def answer(request, parse):
        raw = await read_body(request)
        try:
            body = json.loads(raw)
        except ValueError:
            raise oa.ApiError(400, "the request body is not valid JSON") from None
        req = parse(body, max_tokens=max_tokens)
        opened = await open_model(req.model, req.documents, req.blend)
        release = _once(opened.release)
        try:
            session = opened.session
            history, question = conversation.with_system(session.framing, req.system, req.history, req.question)
            try:
                prompt = await run_in_threadpool(session.prompt_ids, question, history)
            except KvcliError as exc:  # a chat template that cannot hold a conversation
                raise oa.ApiError(400, hidden(str(exc)), param="messages") from None
            opts = req.options
            try:
                an.prompt_room(session.lm, prompt, opts)
            except PromptTooLongError as exc:
                raise oa.ApiError(400, f"messages: {exc.reason}", param="messages", code="context_length_exceeded") from None
            gate = gates.setdefault(id(session.lm), _Gate(max_queue, opened.concurrency))
            gate.reserve()
            try:
                submitted = opened.submit(question, opts, history=history, prompt=prompt)  # the row joins the engine now
            except BaseException:
                gate.held -= 1
                raise
        except BaseException:
            release()
            raise
        cid = oa.completion_id(req.text)

        def work(on_text=None):
            try:
                return submitted.result(on_text)[0]
            finally:
                release()

        async def run(work) -> asyncio.Future:
            try:
                return await gate.start(work)
            except BaseException:
                submitted.cancel()
                release()
                raise

        if not req.stream:
            fut = await run(work)
            try:
                while not fut.done():  # a client that hangs up takes its row out at the next step
                    await asyncio.wait({fut}, timeout=DISCONNECT_POLL_S)
                    if not fut.done() and await request.is_disconnected():
                        submitted.cancel()
                result = await fut
            except (Cancelled, EngineClosed):
                raise oa.ApiError(503, "the server stopped before the answer was complete", type="server_error",
                                  code="stopped") from None
            return JSONResponse(oa.completion(cid, req.model, result, text=req.text))
        started = [False]

        async def events():
            started[0] = True
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            def on_text(_i: int, text: str) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, text)

            def data(obj) -> dict[str, str]:
                return {"data": json.dumps(obj, ensure_ascii=False)}

            try:
                fut = await run(lambda: work(on_text))
                fut.add_done_callback(lambda _f: queue.put_nowait(None))
                if not req.text:
                    yield data(oa.chunk(cid, req.model, delta={"role": "assistant", "content": ""}))
                while (text := await queue.get()) is not None:
                    yield data(oa.chunk(cid, req.model, delta={"content": text}, text=req.text))
                try:
                    result = fut.result()
                except KvcliError as exc:
                    yield data(oa.ApiError(500, hidden(str(exc)), type="server_error").body())
                    return
                except Exception as exc:
                    log.error("unexpected error while streaming: %r", exc)
                    yield data(oa.ApiError(500, f"internal error ({exc.__class__.__name__})", type="server_error").body())
                    return
                yield data(oa.chunk(cid, req.model, finish_reason=result.finish_reason, text=req.text))
                if req.include_usage:
                    yield data(oa.chunk(cid, req.model, answer=result, with_choice=False, text=req.text))
                yield {"data": "[DONE]"}
            finally:
                submitted.cancel()  # a client gone mid-answer: its row leaves at the next step (done: nothing happens)

        def never_started() -> None:
            if not started[0]:
                submitted.cancel()
                gate.held -= 1
                release()

        return EventSourceResponse(events(), sep="\n", ping=15, background=BackgroundTask(never_started))

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def not_found(request, exc):
        status = getattr(exc, "status_code", 404)
        text = "no such endpoint" if status == 404 else f"{request.method} is not allowed here"
        return error(oa.ApiError(status, f"{request.url.path[:200]}: {text}", code="not_found" if status == 404 else "method_not_allowed"))

    routes = [
        Route("/v1/models", endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(get_model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/health", endpoint(health), methods=["GET"]),
    ]
    middleware = [
        Middleware(TrustedHostMiddleware, allowed_hosts=list(hosts), www_redirect=False),
        Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                   allow_headers=["authorization", "content-type"], max_age=600),
    ]
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: not_found})


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


def _server(provider: Provider, sock: socket.socket, api_key: str | None, max_queue: int, **limits):
    require_extra()
    import uvicorn

    host, port = sock.getsockname()[:2]
    hosts = allowed_hosts(host, limits.pop("allow_hosts", ()))
    origins = check_origins(limits.pop("allow_origins", ()))
    app = create_app(provider, api_key=api_key, max_queue=max_queue, hosts=hosts, origins=origins, **limits)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


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


def start(host: str, port: int, *, provider: Provider | None = None, docs: Sequence[str] = (), api_key: str | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, ready_timeout: float = 30.0, allow_hosts: Sequence[str] = (),
          allow_origins: Sequence[str] = (), max_body: int = DEFAULT_MAX_BODY, max_tokens: int = DEFAULT_MAX_TOKENS) -> Running:
    """Serve in a daemon thread; returns once it accepts connections (port 0 picks a free port).
    allow_hosts/allow_origins/max_body/max_tokens: see create_app and allowed_hosts."""
    check_bind(host, api_key)
    allowed_hosts(host, allow_hosts), check_origins(allow_origins)  # a bad name is a usage error before binding
    sock = _listen(host, port)
    server = _server(provider or DocsProvider(docs), sock, api_key, max_queue, allow_hosts=allow_hosts,
                     allow_origins=allow_origins, max_body=max_body, max_tokens=max_tokens)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvcli-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        raise KvcliError(f"--http {host}:{port}: the server did not start")
    return Running(server, sock, thread)


def run(host: str, port: int, *, provider: Provider | None = None, docs: Sequence[str] = (), api_key: str | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE, allow_hosts: Sequence[str] = (), allow_origins: Sequence[str] = (),
        max_body: int = DEFAULT_MAX_BODY, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM (in-flight answers end first, up to 5 s)."""
    check_bind(host, api_key)
    allowed_hosts(host, allow_hosts), check_origins(allow_origins)
    sock = _listen(host, port)
    _server(provider or DocsProvider(docs), sock, api_key, max_queue, allow_hosts=allow_hosts, allow_origins=allow_origins,
            max_body=max_body, max_tokens=max_tokens).run(sockets=[sock])
