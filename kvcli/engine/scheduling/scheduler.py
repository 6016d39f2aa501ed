"""One engine per loaded model: the only thread that runs the model, stepping every row of every document.

Askers (the CLI in-process, a socket client's thread, an HTTP request) submit questions and read events
back in their own thread: settled text, finished answers, errors. Each step of the loop runs one forward
pass per document with rows (the joining rows' own ids, else one new token for every running row, in a
batch, or one row at a time where the batched path was not proven exact: engine/decoding/protocol.py),
then hands one turn to other work waiting for the model (a prefill chunk, a --check recompute). So a
long prefill pauses running answers for one chunk at a time, a new question joins at the next step, and
an asker that leaves (cancelled, an exception in its callbacks, Ctrl-C) takes its rows out at the next step.
A thread that waits while another computes gives back its OpenMP workers first (openmp.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from ..decoding import batch, questions as qs
from ..decoding.request import DEFAULT_BATCH as DEFAULT_WIDTH
from ..decoding.lone import LoneOrBatchDecoder
from ..decoding.protocol import Decoder, Row
from ..decoding.solo import OneRowDecoder
from . import openmp

POLL_S = 0.05  # how often a waiting asker checks whether it is still wanted


class Left(Exception):
    """The asker went away (its `cancelled()` said so): its questions left the engine."""


class Stopped(Exception):
    """The engine was closed (the server is stopping) before the answer was complete."""


class _Turn:
    def __init__(self) -> None:
        self.granted, self.done = threading.Event(), threading.Event()


class Engine:
    """Every row decoding on one model, stepped by one thread; turns for other work on the model in between."""

    def __init__(self, lm: Any, *, width: int | None = None, batched: bool | None = None):
        self.lm = lm
        self.width = width  # rows per document (a server's --batch-size); None: as wide as each asker asks
        self._batched = batched  # None: decided by the model's probe (engine/scheduling/probe.py) when the first row arrives
        self.why = "" if batched is None else "set by the caller"  # the probe's reason, once it ran
        self.eos = batch.eos_ids(lm.model)
        self.pad_id = batch.padding_id(lm.tokenizer, lm.model)
        self._cv = threading.Condition()
        self._incoming: list[tuple[Any, qs.Question, queue.SimpleQueue, int]] = []
        self._leaving: list[Row] = []
        self._turns: deque[_Turn] = deque()
        self._decoders: dict[int, tuple[Any, Decoder]] = {}  # id(session) -> (session, its decoder)
        self._owners: dict[int, tuple[Any, queue.SimpleQueue]] = {}  # id(row) -> (session, its asker's events)
        self._askers: dict[int, int] = {}  # id(session) -> askers with questions on it (its decoder stays while any)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._inside = threading.local()  # set in the engine thread and in a granted turn: turns nest
        self.asked = self.steps = self.peak_rows = 0

    # ---- what askers call
    @property
    def batched(self) -> bool:
        """Whether rows of one document share forward passes: the loaded model's probe said it is exact."""
        if self._batched is None:
            from .probe import remembered

            with self.turn():  # the probe runs the model: between two steps, like any other model work
                if self._batched is None:
                    found = remembered(self.lm)
                    self.why = found.reason
                    self._batched = found.ok
        return self._batched

    @batched.setter
    def batched(self, value: bool) -> None:
        self._batched = value

    @property
    def mode(self) -> str:
        """"batched" (rows of one document share each forward pass), "one at a time", or "undecided" (no row yet)."""
        if self._batched is None:
            return "undecided"
        return "batched" if self._batched else "one at a time"

    @property
    def busy(self) -> bool:
        """Whether any row is waiting or decoding, or any turn is wanted."""
        with self._cv:
            return bool(self._incoming or self._turns or any(d.busy for _s, d in self._decoders.values()))

    @property
    def decoding(self) -> bool:
        """Whether any row is waiting or decoding (a prefill then cuts its chunks: engine/prefilling.py)."""
        with self._cv:
            return bool(self._incoming or any(d.busy for _s, d in self._decoders.values()))

    @contextmanager
    def turn(self):
        """The model to the calling thread alone, between two steps (FIFO among turns); nests."""
        if getattr(self._inside, "held", False):
            yield
            return
        t = _Turn()
        with self._cv:
            self._start()
            self._turns.append(t)
            self._cv.notify()
        t.granted.wait()
        self._inside.held = True
        try:
            yield
        finally:
            self._inside.held = False
            openmp.release()  # before the engine steps again
            t.done.set()

    def ask(self, session: Any, texts: Sequence[str], options: Any, *, history: Sequence[Any] = (),
            limit: int | None = None, check: bool = False, start: float | None = None,
            on_text: Callable[[int, str], None] | None = None, on_answer: Callable[[int, Any], None] | None = None,
            cancelled: Callable[[], bool] | None = None, prompts: Sequence[list[int]] | None = None) -> list[Any]:
        """Answer `texts` on the session's document, at most `limit` of them decoding at once (default: the
        width), each after `history`. Callbacks run in this thread: on_text(i, text) as text settles,
        on_answer(i, answer) as each completes. Raises Left once cancelled() says the asker is gone, and
        whatever a callback raises; either way this asker's rows leave at the next step.
        prompts: the questions' prompt ids when already tokenized (Session.check_prompt)."""
        limit = max(1, min(limit or self.width or DEFAULT_WIDTH, self.width or limit or DEFAULT_WIDTH))
        start = session.clock() if start is None else start
        events: queue.SimpleQueue = queue.SimpleQueue()
        pending = list(enumerate(texts))
        mine: dict[int, qs.Question] = {}
        answers: list[Any] = [None] * len(texts)
        next_check = 0.0
        with self._cv:
            self._askers[id(session)] = self._askers.get(id(session), 0) + 1
        try:
            while pending or mine:
                new = []
                while pending and len(mine) + len(new) < limit:
                    i, text = pending.pop(0)
                    new.append(qs.question(session, i, text, options, history=history, check=check,
                                           prompt=prompts[i] if prompts else None, on_text=lambda t, i=i: events.put(("text", i, t))))
                if new:  # together: questions asked at once join the batch in one step
                    self._submit(session, new, events, limit)
                    mine.update((q.row.index, q) for q in new)
                    openmp.release()  # this thread waits now; the engine thread computes
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
                elif kind == "done":
                    answers[i] = mine.pop(i).answer(session, start, self.turn)
                    answers[i].decoding = self.mode
                    if on_answer:
                        on_answer(i, answers[i])
                else:  # "error": the step failed for every row in it, or the engine closed
                    mine.pop(i, None)
                    raise value
        finally:
            with self._cv:
                self._leaving.extend(q.row for q in mine.values())
                self._askers[id(session)] -= 1
                if not self._askers[id(session)]:
                    del self._askers[id(session)]
                    held = self._decoders.get(id(session))
                    if held is not None and not held[1].busy and not self._leaving:
                        del self._decoders[id(session)]  # its suffix buffers go now, not at the engine's next wake-up
                self._cv.notify()
        return answers

    def close(self, timeout: float = 30.0) -> None:
        """Stop: every row still waiting or decoding gets Stopped; returns once the thread has ended."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---- the engine thread
    def _submit(self, session: Any, new: list[qs.Question], events: queue.SimpleQueue, limit: int) -> None:
        with self._cv:
            if self._closed:
                raise Stopped("the engine is stopping")
            self.asked += len(new)
            session.stats["asked"] += len(new)
            self._incoming += [(session, q, events, limit) for q in new]
            self._start()
            self._cv.notify()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():  # caller holds _cv
            self._thread = threading.Thread(target=self._run, name="kvcli-engine", daemon=True)
            self._thread.start()

    def suffix_bytes(self, session: Any) -> int:
        """Bytes of the suffix buffers the batch of this document holds now (0 one at a time, or when idle)."""
        with self._cv:
            held = self._decoders.get(id(session))
        return held[1].bytes() if held else 0

    def _decoder(self, session: Any, width: int) -> Decoder:
        length = len(session.token_ids)
        if width == 1 or not self.batched:  # rows one at a time, on the model's own attention
            return OneRowDecoder(self.lm.model, session.cache, eos=self.eos, length=length)
        if LoneOrBatchDecoder.suits(session.cache):  # a lone row on the model's own attention; joined, batched
            return LoneOrBatchDecoder(self.lm.model, session.cache, width=width, eos=self.eos, pad_id=self.pad_id, length=length)
        return batch.BatchDecoder(self.lm.model, session.states, width=width, eos=self.eos, pad_id=self.pad_id, length=length)

    def _take_in(self) -> tuple[list[tuple[Any, Decoder]], _Turn | None]:
        """Under _cv: new rows in, leaving rows out; the documents to step and the turn to grant."""
        for session, q, events, limit in self._incoming:
            key = id(session)
            if key not in self._decoders:
                try:
                    self._decoders[key] = (session, self._decoder(session, self.width or limit))
                except Exception as exc:  # states that cannot be decoded: this asker hears why, the engine goes on
                    events.put(("error", q.row.index, exc))
                    continue
            self._decoders[key][1].add(q.row)
            self._owners[id(q.row)] = (session, events)
        self._incoming.clear()
        for row in self._leaving:
            owner = self._owners.pop(id(row), None)
            if owner is not None:
                self._decoders[id(owner[0])][1].drop(row)
        self._leaving.clear()
        for key in [k for k, (_s, d) in self._decoders.items() if not d.busy and k not in self._askers]:
            del self._decoders[key]  # its suffix buffers go; the document's states are the Session's
        work = [(s, d) for s, d in self._decoders.values() if d.busy]
        return work, (self._turns.popleft() if self._turns else None)

    def _run(self) -> None:
        self._inside.held = True
        while True:
            with self._cv:
                if not self._has_work():
                    openmp.release()  # idle: whoever computes next (a prefill, a restore) has the cores
                while not self._has_work():
                    self._cv.wait()
                if self._closed:
                    self._stop_all()
                    return
                work, turn = self._take_in()
            for session, decoder in work:
                self._step(session, decoder)
            if turn is not None:
                openmp.release()  # the turn's thread computes while this one waits
                turn.granted.set()
                turn.done.wait()

    def _has_work(self) -> bool:
        """Under _cv: anything for the engine thread to do (rows in or out, a turn, rows to step, closing)."""
        return bool(self._incoming or self._leaving or self._turns or self._closed
                    or any(d.busy for _s, d in self._decoders.values()))

    def _step(self, session: Any, decoder: Decoder) -> None:
        try:
            finished = decoder.step()
        except Exception as exc:  # handed to every asker in this document's batch; the engine goes on
            for row in decoder.rows:
                _s, events = self._owners.pop(id(row))
                events.put(("error", row.index, exc))
                decoder.drop(row)
            return
        self.steps += 1
        session.stats["steps"] += 1
        self.peak_rows = max(self.peak_rows, decoder.last_rows)
        session.stats["peak_rows"] = max(session.stats["peak_rows"], decoder.last_rows)
        for row in finished:
            _s, events = self._owners.pop(id(row))
            events.put(("done", row.index, row))

    def _stop_all(self) -> None:
        """Under _cv, closing: every asker still waiting hears Stopped; turns are granted so nobody hangs."""
        rows = [(q.row, events) for _s, q, events, _l in self._incoming]
        rows += [(r, self._owners[id(r)][1]) for _s, d in self._decoders.values() for r in d.rows if id(r) in self._owners]
        for row, events in rows:
            events.put(("error", row.index, Stopped("the server stopped before the answer was complete")))
        self._incoming.clear()
        self._decoders.clear()
        self._owners.clear()
        while self._turns:
            self._turns.popleft().granted.set()


_engines_lock = threading.Lock()
_engines: dict[int, Engine] = {}  # id(model) -> its engine, which holds the model: the id stays that model's


def engine_for(lm: Any, width: int | None = None) -> Engine:
    """The model's one engine (made on first use); `width` sets its rows per document."""
    with _engines_lock:
        engine = _engines.get(id(lm))
        if engine is None:
            engine = _engines[id(lm)] = Engine(lm)
        if width is not None:
            engine.width = width
        return engine
