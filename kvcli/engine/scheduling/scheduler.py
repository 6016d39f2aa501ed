"""One engine per loaded model: the only thread that runs the model, stepping every row of every document.

Askers (the CLI in-process, a socket client's thread, an HTTP request) submit questions and get a Request:
they read its events back in their own thread (settled text, finished answers, then done or failed). Each step of the loop runs one forward
pass per document with rows (the joining rows' own ids, else one new token for every running row, in a
batch, or one row at a time where the batched path was not proven exact: engine/decoding/protocol.py),
then hands one turn to other work waiting for the model (a prefill chunk, a --check recompute). So a
long prefill pauses running answers for one chunk at a time, a new question joins at the next step, and
a cancelled request (request.cancel(), from a front end whose client left) takes its rows out at the next step.
A thread that waits while another computes gives back its OpenMP workers first (the engine's CpuTuning:
engine/model/cpu.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from ..decoding import batch, questions as qs
from ..decoding.request import DEFAULT_BATCH as DEFAULT_WIDTH
from ..decoding.lone import LoneOrBatchDecoder
from ..decoding.protocol import Decoder
from ..decoding.solo import OneRowDecoder
from ..model.cpu import CpuTuning
from .requests import Answered, Cancelled, Done, EngineBusy, EngineClosed, Failed, Request, Text  # noqa: F401  (the request API)


class _Turn:
    def __init__(self) -> None:
        self.granted, self.done = threading.Event(), threading.Event()


class Engine:
    """Every row decoding on one model, stepped by one thread; turns for other work on the model in between."""

    def __init__(self, lm: Any, *, width: int | None = None, batched: bool | None = None):
        self.lm = lm
        self.width = width  # rows per document (a server's --batch-size); None: as wide as each asker asks
        self.max_queue: int | None = None  # requests that may wait beyond those decoding (a server's); None: any
        self._batched = batched  # None: decided by the model's probe (engine/scheduling/probe.py) when the first row arrives
        self.why = "" if batched is None else "set by the caller"  # the probe's reason, once it ran
        self.eos = batch.eos_ids(lm.model)
        self.pad_id = batch.padding_id(lm.tokenizer, lm.model)
        self._cv = threading.Condition()
        self._incoming: list[tuple[Request, qs.Question]] = []  # rows submitted, joining at the next step
        self._cancels: list[Request] = []  # requests cancelled, their rows out at the next step (_take_in)
        self._turns: deque[_Turn] = deque()
        self._decoders: dict[int, tuple[Any, Decoder]] = {}  # id(session) -> (session, its decoder)
        self._owners: dict[int, Request] = {}  # id(row) -> the request it answers
        self._askers: dict[int, int] = {}  # id(session) -> askers with questions on it (its decoder stays while any)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._inside = threading.local()  # set in the engine thread and in a granted turn: turns nest
        self.asked = self.steps = self.peak_rows = 0
        self.cpu = CpuTuning()  # how this model's steps use the CPU (OpenMP pools, split products), measured here

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
    def batched(self, value: bool) -> None:  # tests pin the path
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
            return self.decoding or bool(self._turns)

    @property
    def in_use(self) -> bool:
        """Whether busy, or any request is not yet read to its end (its reader still sends what it read: a server's
        idle timer counts that as use)."""
        with self._cv:
            return self.busy or bool(self._askers)

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
            self.cpu.release()  # before the engine steps again
            t.done.set()

    def submit(self, session: Any, texts: Sequence[str], options: Any, *, history: Sequence[Any] = (),
               limit: int | None = None, check: bool = False, prompts: Sequence[list[int]] | None = None) -> Request:
        """Ask `texts` on the session's document, at most `limit` of them decoding at once (default: the width),
        each after `history`; returns the Request to read their events from (its first rows are in already).
        EngineBusy when the engine's queue is full (max_queue). prompts: the questions' prompt ids when already
        tokenized (Session.check_prompt)."""
        limit = max(1, min(limit or self.width or DEFAULT_WIDTH, self.width or limit or DEFAULT_WIDTH))
        self.attach(session)
        try:
            return Request(self, session, texts, options, history=history, limit=limit, check=check,
                           prompts=prompts)
        except BaseException:
            self.detach(session)
            raise

    def ask(self, session: Any, texts: Sequence[str], options: Any, *, on_text: Callable[[int, str], None] | None = None,
            on_answer: Callable[[int, Any], None] | None = None, **kw: Any) -> list[Any]:
        """submit(), then read its events here: on_text(i, text), on_answer(i, answer); the answers, in order."""
        return self.submit(session, texts, options, **kw).result(on_text, on_answer)

    def close(self, timeout: float = 30.0) -> None:
        """Stop: every request still waiting or decoding ends with EngineClosed; returns once the thread has ended."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.cpu.close()

    # ---- what a Request calls
    def attach(self, session: Any) -> None:
        """Count a request on `session` (its decoder stays while any is counted); EngineBusy when max_queue requests
        already wait beyond those decoding at once (the width, or 1 where rows run one at a time)."""
        with self._cv:
            held = sum(self._askers.values())
            slots = 1 if self._batched is False else (self.width or DEFAULT_WIDTH)
            if self.max_queue is not None and held >= slots + self.max_queue:
                raise EngineBusy(f"busy: {held} requests already running or waiting for this model; retry later")
            self._askers[id(session)] = self._askers.get(id(session), 0) + 1

    def enqueue(self, request: Request, new: list[qs.Question]) -> None:
        """The request's next questions join at the engine's next step (EngineClosed once closing)."""
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine is stopping")
            self.asked += len(new)
            request.session.stats["asked"] += len(new)
            self._incoming += [(request, q) for q in new]
            self._start()
            self._cv.notify()

    def withdraw(self, request: Request) -> None:
        """The request's rows leave at the engine's next wake-up (its one point for cancels, in _take_in)."""
        with self._cv:
            self._cancels.append(request)
            self._cv.notify()

    def detach(self, session: Any) -> None:
        """A request on `session` was read to its end (or left): its decoder goes once no other request holds it."""
        with self._cv:
            self._askers[id(session)] -= 1
            if not self._askers[id(session)]:
                del self._askers[id(session)]
                held = self._decoders.get(id(session))
                if held is not None and not held[1].busy and not self._cancels:
                    del self._decoders[id(session)]  # its suffix buffers go now, not at the engine's next wake-up
            self._cv.notify()

    # ---- the engine thread
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
            return OneRowDecoder(self.lm.model, session.cache, eos=self.eos, length=length, cpu=self.cpu)
        if LoneOrBatchDecoder.suits(session.cache):  # a lone row on the model's own attention; joined, batched
            return LoneOrBatchDecoder(self.lm.model, session.cache, width=width, eos=self.eos, pad_id=self.pad_id,
                                      length=length, cpu=self.cpu)
        session.cache.settle(self.lm.model)  # the batch reads the document's states: none left pending
        return batch.BatchDecoder(self.lm.model, session.states, width=width, eos=self.eos, pad_id=self.pad_id, length=length)

    def _take_in(self) -> tuple[list[tuple[Any, Decoder]], _Turn | None]:
        """Under _cv: new rows in, leaving rows out; the documents to step and the turn to grant."""
        if self._cancels:  # the one point where cancelled requests leave: queued rows and decoding rows alike
            gone = {id(r) for r in self._cancels}
            self._incoming = [(r, q) for r, q in self._incoming if id(r) not in gone]
            for _session, decoder in self._decoders.values():
                for row in list(decoder.rows):
                    owner = self._owners.get(id(row))
                    if owner is not None and id(owner) in gone:
                        del self._owners[id(row)]
                        decoder.drop(row)
            self._cancels.clear()
        for request, q in self._incoming:
            session = request.session
            key = id(session)
            if key not in self._decoders:
                try:
                    self._decoders[key] = (session, self._decoder(session, self.width or request.limit))
                except Exception as exc:  # states that cannot be decoded: this asker hears why, the engine goes on
                    request.put("error", q.row.index, exc)
                    continue
            self._decoders[key][1].add(q.row)
            self._owners[id(q.row)] = request
        self._incoming.clear()
        for key in [k for k, (_s, d) in self._decoders.items() if not d.busy and k not in self._askers]:
            del self._decoders[key]  # its suffix buffers go; the document's states are the Session's
        work = [(s, d) for s, d in self._decoders.values() if d.busy]
        return work, (self._turns.popleft() if self._turns else None)

    def _run(self) -> None:
        self._inside.held = True
        while True:
            with self._cv:
                if not self._has_work():
                    self.cpu.release()  # idle: whoever computes next (a prefill, a restore) has the cores
                while not self._has_work():
                    self._cv.wait()
                if self._closed:
                    self._stop_all()
                    return
                work, turn = self._take_in()
            for session, decoder in work:
                self._step(session, decoder)
            if turn is not None:
                self.cpu.release()  # the turn's thread computes while this one waits
                turn.granted.set()
                turn.done.wait()

    def _has_work(self) -> bool:
        """Under _cv: anything for the engine thread to do (rows in or out, a turn, rows to step, closing)."""
        return self.busy or bool(self._cancels or self._closed)

    def _step(self, session: Any, decoder: Decoder) -> None:
        try:
            finished = decoder.step()
        except Exception as exc:  # handed to every asker in this document's batch; the engine goes on
            for row in list(decoder.rows):
                self._owners.pop(id(row)).put("error", row.index, exc)
                decoder.drop(row)
            return
        self.steps += 1
        session.stats["steps"] += 1
        self.peak_rows = max(self.peak_rows, decoder.last_rows)
        session.stats["peak_rows"] = max(session.stats["peak_rows"], decoder.last_rows)
        for row in finished:
            self._owners.pop(id(row)).put("done", row.index, row)

    def _stop_all(self) -> None:
        """Under _cv, closing: every request still waiting ends with EngineClosed; turns are granted so nobody hangs."""
        rows = [(q.row, r) for r, q in self._incoming]
        rows += [(row, self._owners[id(row)]) for _s, d in self._decoders.values() for row in d.rows if id(row) in self._owners]
        for row, request in rows:
            request.put("error", row.index, EngineClosed("the server stopped before the answer was complete"))
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


def close_engine(lm: Any) -> None:
    """Close the model's engine (if it has one) and forget it: its thread ends and it no longer holds the model."""
    with _engines_lock:
        engine = _engines.pop(id(lm), None)
    if engine is not None:
        engine.close()
