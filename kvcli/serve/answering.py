"""One HTTP question answered as every other front end answers: events.ask_events, its events read in asyncio.

ask_events runs in a worker thread of the app's one pool (it blocks on the engine's events); each event it emits
is handed to the event loop in order, then None once it ended. The engine admits the request or refuses it at
once (EngineBusy: its queue is full), so the HTTP status is known before a response starts: `admitted()` waits
for that. cancel() (a client gone) takes the request's row out of the engine at its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from . import openai_api as oa
from .docs import Opened
from ..engine.scheduling.requests import Cancelled, EngineBusy, EngineClosed
from ..errors import KvcliError, PromptTooLongError
from ..events import AnswerOut, Event, TextOut, ask_events
from ..requests import AskRequest

log = logging.getLogger("kvcli.serve.http")
ADMITTED = object()  # queued once the engine holds the request's row
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class Answering:
    """One AskRequest on an opened session (a warm Lease, or a Session), run in `executor`."""

    def __init__(self, request: AskRequest, asker: Any):
        self._request, self._asker = request, asker
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._lock = threading.Lock()
        self._submitted: Any = None  # the engine's Request, once admitted
        self._cancelled = False
        self._future: asyncio.Future | None = None

    def start(self, executor: Any) -> None:
        self._future = self._loop.run_in_executor(executor, self._run)
        self._future.add_done_callback(self._ended)

    def _ended(self, future: asyncio.Future) -> None:
        if not future.cancelled():
            future.exception()  # retrieved: a reader gone (Cancelled) is expected, and error() reports the rest
        self._queue.put_nowait(None)  # after every event it emitted

    async def admitted(self) -> bool:
        """True once the engine holds the row; False if ask_events ended first (error() says why)."""
        while (event := await self._queue.get()) is not ADMITTED:
            if event is None:
                return False
        return True

    async def next(self) -> Event | None:
        """The next event, None once ask_events ended."""
        return await self._queue.get()

    def error(self) -> BaseException | None:
        """What ask_events raised (once next() or admitted() saw its end)."""
        return self._future.exception() if self._future is not None and not self._future.cancelled() else None

    def after(self, fn) -> None:
        """fn() once ask_events has ended (now, if it has): a session is given back only when nothing reads it."""
        if self._future is None or self._future.done():
            fn()
        else:
            self._future.add_done_callback(lambda _f: fn())

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            submitted = self._submitted
        if submitted is not None:
            submitted.cancel()

    def _run(self) -> int:
        return ask_events(self._request, lambda _spec: nullcontext(self._asker), emit=self._emit, watch=self._watch)

    def _emit(self, event: Any) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    @contextmanager
    def _watch(self, submitted: Any) -> Iterator[None]:
        with self._lock:
            self._submitted = submitted
            cancelled = self._cancelled
        if cancelled:  # the client left before the row joined
            submitted.cancel()
        self._emit(ADMITTED)
        yield


def ask_request(req: oa.ChatRequest, opened: Opened) -> AskRequest:
    """The chat as the AskRequest every front end answers (a foreign system message goes before the first question)."""
    from ..engine.prompt import conversation

    history, question = conversation.with_system(opened.session.framing, req.system, req.history, req.question)
    return AskRequest(caches=(req.model,), questions=(question,), options=req.options, stream=req.stream,
                      history=tuple(history), sections=req.sections)


def refusal(exc: BaseException | None, hidden: Callable[[str], str]) -> oa.ApiError:
    """Why a request never joined the engine, as the HTTP error."""
    if isinstance(exc, EngineBusy):
        return oa.ApiError(503, str(exc), type="server_error", code="busy", headers={"Retry-After": "1"})
    if isinstance(exc, (Cancelled, EngineClosed)):
        return stopped()
    if isinstance(exc, PromptTooLongError):
        return oa.ApiError(400, f"messages: {exc.reason}", param="messages", code="context_length_exceeded")
    if isinstance(exc, KvcliError):  # a chat template that cannot hold the conversation
        return oa.ApiError(400, hidden(str(exc)), param="messages")
    raise exc if exc is not None else RuntimeError("the answer ended before it began")


def stopped() -> oa.ApiError:
    return oa.ApiError(503, "the server stopped before the answer was complete", type="server_error", code="stopped")


async def answer_record(run: Answering, request) -> dict[str, Any]:
    """Read a non-streamed answer to its end (a client that hangs up takes its row out at the next step)."""
    record = None
    while True:
        get = asyncio.ensure_future(run.next())
        while not get.done():
            await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
            if not get.done() and await request.is_disconnected():
                run.cancel()
        event = get.result()
        if event is None:
            break
        if isinstance(event, AnswerOut):
            record = event.answer
    error = run.error()
    if isinstance(error, (Cancelled, EngineClosed)):
        raise stopped() from None
    if error is not None:
        raise error
    return record


async def chunks(run: Answering, req: oa.ChatRequest, cid: str, release: Callable[[], None], hidden: Callable[[str], str]):
    """The streamed answer's server-sent events; the session is given back once the last is sent."""
    def data(obj) -> dict[str, str]:
        return {"data": json.dumps(obj, ensure_ascii=False)}

    try:
        if not req.text:
            yield data(oa.chunk(cid, req.model, delta={"role": "assistant", "content": ""}))
        record = None
        while (event := await run.next()) is not None:
            if isinstance(event, TextOut):
                yield data(oa.chunk(cid, req.model, delta={"content": event.text}, text=req.text))
            elif isinstance(event, AnswerOut):
                record = event.answer
        error = run.error()
        if error is not None:
            if not isinstance(error, KvcliError):
                log.error("unexpected error while streaming: %r", error)
            message = hidden(str(error)) if isinstance(error, KvcliError) else f"internal error ({error.__class__.__name__})"
            yield data(oa.ApiError(500, message, type="server_error").body())
            return
        yield data(oa.chunk(cid, req.model, finish_reason=record["finish_reason"], text=req.text, kvcli=oa.sources(record)))
        if req.include_usage:
            yield data(oa.chunk(cid, req.model, answer=record, with_choice=False, text=req.text))
        yield {"data": "[DONE]"}
    finally:
        run.cancel()  # a client gone mid-answer: its row leaves at the next step (done: nothing happens)
        run.after(release)
