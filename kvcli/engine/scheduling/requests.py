"""A request to the engine and what it reads back: typed events, and the two ways a request ends early.

An engine call (Engine.submit, Session.submit) returns a Request: iterating it yields Text and Answered events
as the answers settle, then exactly one Done or Failed, and nothing after. The Request talks to its engine
(engine/scheduling/scheduler.py) through the engine's attach/enqueue/withdraw/detach. Imports nothing heavy at
module level, so front ends may catch these names without importing torch.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ServerError


class Cancelled(Exception):
    """The request was cancelled (its asker left: request.cancel()); its rows left the engine."""


class EngineClosed(Exception):
    """The engine was closed (the server is stopping) before the answer was complete."""


class EngineBusy(ServerError):
    """Refused at once: the model's engine already holds as many requests as its queue allows (a server's
    max_queue); nothing of it ran. Retry later."""


@dataclass(frozen=True)
class Text:
    index: int  # which of the request's questions
    text: str  # answer text that is now final


@dataclass(frozen=True)
class Answered:
    index: int
    answer: Any  # engine.decoding.request.Answer


@dataclass(frozen=True)
class Failed:
    error: BaseException  # Cancelled, EngineClosed, or what the step or the question raised


@dataclass(frozen=True)
class Done:
    answers: list[Any]  # every question's Answer, in question order


class Request:
    """One submission's questions on one document, read as events in the reader's thread; cancel() from any thread.

    Iterating yields Text(i, text) as text settles and Answered(i, answer) as each completes, then Done(answers)
    or Failed(error) (Cancelled after cancel(), EngineClosed when the engine closes, else what a step raised),
    and ends. Questions beyond the limit join as earlier ones finish. Used as a context manager, leaving it
    early (an exception in the reader, a break) cancels; cancelling a finished request does nothing."""

    def __init__(self, engine: Any, session: Any, texts: Sequence[str], options: Any, *, history: Sequence[Any],
                 limit: int, check: bool, prompts: Sequence[list[int]] | None):
        self.engine, self.session, self.limit = engine, session, limit
        self._texts, self._options, self._history, self._check, self._prompts = texts, options, history, check, prompts
        self._start = session.clock()  # the answers' timings count from here
        self._served: Callable[[int, Any], None] | None = None  # on_answer's
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = list(enumerate(texts))
        self._mine: dict[int, Any] = {}  # row index -> its decoding.questions.Question
        self.answers: list[Any] = [None] * len(texts)
        self.finished = False
        try:
            self._feed()  # together: questions asked at once join the batch in one step
        except BaseException:
            self.finished = True  # Engine.submit uncounts it
            raise

    def on_answer(self, fn: Callable[[int, Any], None]) -> None:
        """fn(i, answer) as each answer completes, in the reader's thread, before its event (a warm server counts
        the answers it served so); set before reading."""
        self._served = fn

    def put(self, kind: str, index: int, value: Any) -> None:
        """From the engine thread: a row's outcome ("done" with the row, or "error")."""
        self._events.put((kind, index, value))

    def cancel(self) -> None:
        """Take this request's rows out of the engine at its next step; the events end with Failed(Cancelled)."""
        if not self.finished:
            self.engine.withdraw(self)
            self._events.put(("cancel", -1, None))

    def _feed(self) -> None:
        from ..decoding import questions as qs

        new = []
        while self._pending and len(self._mine) + len(new) < self.limit:
            i, text = self._pending.pop(0)
            new.append(qs.question(self.session, i, text, self._options, history=self._history, check=self._check,
                                   prompt=self._prompts[i] if self._prompts else None,
                                   on_text=lambda t, i=i: self._events.put(("text", i, t))))
        if new:
            self.engine.enqueue(self, new)
            self._mine.update((q.row.index, q) for q in new)
            self.engine.cpu.release()  # this thread waits now; the engine thread computes

    def __iter__(self) -> Iterator[Text | Answered | Done | Failed]:
        if self.finished:
            return
        try:
            while self._pending or self._mine:
                kind, i, value = self._events.get()
                if kind == "text":
                    yield Text(i, value)
                elif kind == "done":
                    answer = self.answers[i] = self._mine.pop(i).answer(self.session, self._start, self.engine.turn)
                    answer.decoding = self.engine.mode
                    if self._served:
                        self._served(i, answer)
                    self._feed()
                    yield Answered(i, answer)
                else:  # "error": the step failed for every row in it, or the engine closed; "cancel"
                    self._mine.pop(i, None)
                    self._leave()
                    yield Failed(Cancelled("the request was cancelled") if kind == "cancel" else value)
                    return
            self._leave()
            yield Done(self.answers)
        finally:
            self._leave()

    def _leave(self) -> None:
        if not self.finished:
            self.finished = True
            if self._mine:
                self.engine.withdraw(self)
            self.engine.detach(self.session)

    def result(self, on_text: Callable[[int, str], None] | None = None,
               on_answer: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Read every event here: on_text(i, text), on_answer(i, answer); the answers in order, or Failed's error
        raised (a callback that raises cancels the rest)."""
        with self:
            for event in self:
                if isinstance(event, Text):
                    if on_text:
                        on_text(event.index, event.text)
                elif isinstance(event, Answered):
                    if on_answer:
                        on_answer(event.index, event.answer)
                elif isinstance(event, Failed):
                    raise event.error
        return self.answers

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()
        self._leave()
