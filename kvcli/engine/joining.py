"""Questions from many threads answered together: one decoding thread per document, joining between steps.

A server keeps one Batcher per warm Session (serve/warm.py). Any thread asks through it; each question
becomes a batch row (built and checked in the asking thread, so a question too long fails there) and
joins the running batch at the next step (engine/batch.py's Decoder), leaving when it finishes or its
asker goes away. Every step runs under `turn` (the server's per-model FIFO lock), so the batches of
several documents on one model take turns step by step and a prefill waits at most one step. Text and
answers travel back through a queue and reach the asker's callbacks in the asker's own thread: a slow
reader never stalls the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from . import batch, questions

POLL_S = 0.05  # how often a waiting asker checks whether it is still wanted


class Left(Exception):
    """The asker went away (its `cancelled()` said so): its questions left the batch."""


class Batcher:
    """Continuous batching on one Session: at most `width` rows decode together, from any number of askers."""

    def __init__(self, session: Any, *, width: int, turn: Callable[[], Any] | None = None):
        self.session, self.width = session, width
        self._turn = turn or nullcontext
        self._lock = threading.Lock()
        self._incoming: list[tuple[questions.Question, queue.SimpleQueue, float]] = []
        self._leaving: list[batch.Row] = []
        self._running = False
        self.asked = 0  # questions submitted
        self.steps = 0  # forward passes run
        self.peak_rows = 0  # most rows decoding in one step

    @property
    def running(self) -> bool:
        """Whether the decoding thread is alive (it ends when no question is left)."""
        return self._running

    def ask(self, question: str, options: Any, on_text: Callable[[str], None] | None = None, *, history: Sequence[Any] = (),
            cancelled: Callable[[], bool] | None = None) -> Any:
        """One question in the running batch (see ask_many); on_text(text) as it settles."""
        return self.ask_many([question], options, history=history, cancelled=cancelled,
                             on_text=(lambda _i, t: on_text(t)) if on_text else None)[0]

    def ask_many(self, questions: Sequence[str], options: Any, *, history: Sequence[Any] = (), batch_size: int | None = None,
                 on_text: Callable[[int, str], None] | None = None, on_answer: Callable[[int, Any], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> list[Any]:
        """Answer the questions in the running batch, at most batch_size of them at once (default: width),
        each after `history`. Callbacks run in this thread: on_text(i, text) as text settles,
        on_answer(i, answer) as each completes. Raises Left once cancelled() says the asker is gone, and
        whatever a callback raises; either way this asker's rows leave the batch."""
        limit = max(1, min(batch_size or self.width, self.width))
        start = self.session.clock()
        events: queue.SimpleQueue = queue.SimpleQueue()
        pending = list(enumerate(questions))
        mine: dict[int, questions.Question] = {}
        answers: list[Any] = [None] * len(questions)
        next_check = 0.0
        try:
            while pending or mine:
                while pending and len(mine) < limit:
                    i, q = pending.pop(0)
                    mine[i] = self._submit(i, q, options, history, events, start)
                if cancelled and time.monotonic() >= next_check:
                    if cancelled():
                        raise Left()
                    next_check = time.monotonic() + POLL_S
                try:
                    kind, i, value = events.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if kind == "text":
                    if on_text:
                        on_text(i, value)
                elif kind == "answer":
                    del mine[i]
                    answers[i] = value
                    if on_answer:
                        on_answer(i, value)
                else:  # "error": the step failed for every row in it
                    mine.pop(i, None)
                    raise value
        finally:
            if mine:
                with self._lock:
                    self._leaving.extend(q.row for q in mine.values())
        return answers

    def _submit(self, index: int, text: str, options: Any, history: Sequence[Any], events: queue.SimpleQueue,
                start: float) -> questions.Question:
        q = questions.question(self.session, index, text, options, history=history,
                           on_text=lambda t: events.put(("text", index, t)))
        with self._lock:
            self.asked += 1
            self._incoming.append((q, events, start))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="kvcli-batch", daemon=True).start()
        return q

    def _run(self) -> None:
        """The decoding thread: take in new rows, let leaving ones go, step; ends when nothing is left."""
        owners: dict[int, tuple[questions.Question, queue.SimpleQueue, float]] = {}  # id(row) -> its question
        try:
            self._loop(owners)
        except BaseException as exc:  # a bug here: every waiting asker hears of it, the next question starts afresh
            with self._lock:
                self._running = False
                waiting = [(item[0].row, item[1]) for item in self._incoming] + [(q.row, ev) for q, ev, _ in owners.values()]
                self._incoming.clear()
            for row, events in waiting:
                events.put(("error", row.index, exc))

    def _loop(self, owners: dict[int, tuple[questions.Question, queue.SimpleQueue, float]]) -> None:
        model = self.session.lm.model
        decoder = batch.Decoder(model, self.session.states, width=self.width, eos=batch.eos_ids(model),
                                pad_id=batch.padding_id(self.session.lm.tokenizer, model))
        while True:
            with self._lock:
                for item in self._incoming:
                    owners[id(item[0].row)] = item
                    decoder.add(item[0].row)
                self._incoming.clear()
                for row in self._leaving:
                    if owners.pop(id(row), None) is not None:
                        decoder.drop(row)
                self._leaving.clear()
                if not decoder.busy:
                    self._running = False
                    return
            try:
                with self._turn():
                    finished = decoder.step()
                self.steps += 1
                self.peak_rows = max(self.peak_rows, decoder.last_rows)
            except Exception as exc:  # handed to every asker in the batch; the thread goes on
                for row in decoder.waiting + decoder.active:
                    _q, events, _start = owners.pop(id(row))
                    events.put(("error", row.index, exc))
                    decoder.drop(row)
                continue
            for row in finished:
                q, events, start = owners.pop(id(row))
                try:
                    events.put(("answer", row.index, q.answer(self.session, start)))
                except Exception as exc:
                    events.put(("error", row.index, exc))
