"""One request -> a stream of typed events, the same whichever front end runs it.

The in-process CLI and the socket server both run `ask_events` and `prefill_events`; the CLI renders the events
(kvcli/cli/rendering.py) exactly as it renders the events a server sends (their wire form: `to_wire`, read back
by `from_wire`), so a served ask prints what an in-process one prints: warnings, per-cache errors, streamed
text, answers, checks. Stdlib only at import: the served client reads events without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, closing, nullcontext
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from .errors import CHECK_DIFFERS_EXIT, KvcliError
from .requests import AskRequest, SessionSpec


@dataclass(frozen=True)
class Event:
    """An event of a request, as front ends send and render it; `kind` is its name on the wire."""

    kind: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {"event": self.kind, **asdict(self)}


@dataclass(frozen=True)
class Note(Event):
    kind: ClassVar[str] = "note"
    message: str


@dataclass(frozen=True)
class Warn(Event):
    """A warning line; about="cache" for a cache's own warnings (a chat shows them once)."""

    kind: ClassVar[str] = "warning"
    message: str
    about: str | None = None


@dataclass(frozen=True)
class ItemError(Event):
    """One item of several failed (a cache of an ask, a document of a prefill); the others go on."""

    kind: ClassVar[str] = "error"
    message: str
    hint: str | None = None
    exit_code: int = 1


@dataclass(frozen=True)
class Begin(Event):
    """An answer begins: which cache (index), the question, the cache as messages name it."""

    kind: ClassVar[str] = "begin"
    index: int
    question: str
    cache: str = ""


@dataclass(frozen=True)
class TextOut(Event):
    """Answer text that is now final (plain output only)."""

    kind: ClassVar[str] = "text"
    text: str


@dataclass(frozen=True)
class AnswerOut(Event):
    """One finished answer (Answer.to_json()); index: the cache's position."""

    kind: ClassVar[str] = "answer"
    index: int
    answer: dict[str, Any]


@dataclass(frozen=True)
class CheckOut(Event):
    """What --check measured for an answer, as its stderr line."""

    kind: ClassVar[str] = "check"
    index: int
    message: str


@dataclass(frozen=True)
class Progress(Event):
    kind: ClassVar[str] = "progress"
    index: int
    done: int
    total: int


@dataclass(frozen=True)
class Prefilled(Event):
    """One document's record (engine.corpus.DocResult.to_json()); message and hint: its failure."""

    kind: ClassVar[str] = "prefilled"
    index: int
    record: dict[str, Any]
    message: str | None = None
    hint: str | None = None


KINDS: dict[str, type[Event]] = {k.kind: k for k in (Note, Warn, ItemError, Begin, TextOut, AnswerOut, CheckOut, Progress, Prefilled)}


def from_wire(ev: Mapping[str, Any]) -> Event | None:
    """The typed event of a wire message (None for a kind this side does not know: a newer server's)."""
    kind = KINDS.get(str(ev.get("event")))
    if kind is None:
        return None
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in ev.items() if k in names})


Emit = Callable[[Event], None]
Opener = Callable[[SessionSpec], AbstractContextManager]  # -> a context lending the Session (or a Lease) for it


def room_warning(path: str, room: int, max_new_tokens: int) -> str | None:
    """The warning for an answer whose room (Session.check_prompt) is short of --max-new-tokens."""
    if room < max_new_tokens:
        return (f"{path}: only {room} positions are left after this question; the answer stops at {room} tokens, "
                f"not --max-new-tokens {max_new_tokens}")
    return None


@dataclass
class _Asking:
    """What ask_events keeps across caches: the request, how to emit and name things, and what went wrong."""

    request: AskRequest
    emit: Emit
    shown: Callable[[str], str]
    watch: Callable[[Any], AbstractContextManager]
    first_error: KvcliError | None = None
    differs: bool = False

    def label(self, spec: SessionSpec) -> str:
        return " + ".join(self.shown(c) for c in spec.caches)

    def history(self, session: Any) -> Sequence[Any]:
        r = self.request
        if r.follow_up is None:
            return r.history
        from .engine.prompt import conversation

        return conversation.from_answer_json(r.follow_up, session.token_ids, r.follow_up_name)


def ask_events(request: AskRequest, open_session: Opener, *, emit: Emit, shown: Callable[[str], str] = str,
               watch: Callable[[Any], AbstractContextManager] = lambda _r: nullcontext()) -> int:
    """Answer every question of `request` from every cache (or from their blend), emitting events; returns the exit code.

    One cache that fails is an error event and the next cache goes on (the only cache failing raises);
    answers come in question order, the first unfinished one streaming (text events) while later ones,
    decoded in the same batch, are held until it completes. shown(path): a path as messages print it.
    watch(request): a context held while each cache's engine request is read (a socket server's: it cancels
    it when the client hangs up); the events are read in this thread."""
    asking = _Asking(request, emit, shown, watch)
    specs = request.sessions()
    for index, spec in enumerate(specs):
        with ExitStack() as held:
            try:
                session = held.enter_context(open_session(spec))
            except KvcliError as exc:
                if len(specs) == 1:
                    raise
                emit(ItemError(str(exc), exc.hint, exc.exit_code))
                asking.first_error = asking.first_error or exc
                continue
            _answer(asking, index, spec, session)
    if asking.first_error:
        return asking.first_error.exit_code
    return CHECK_DIFFERS_EXIT if asking.differs else 0


def _answer(asking: _Asking, index: int, spec: SessionSpec, session: Any) -> None:
    """Every question from one opened session: warnings, each prompt checked, then the answers in order."""
    from .engine.decoding.questions import in_order

    r, emit = asking.request, asking.emit
    for warning in session.warnings:
        emit(Warn(warning, "cache"))
    history = asking.history(session)
    prompts = []
    for q in r.questions:
        ids, room = session.check_prompt(q, history, r.options)  # a prompt that does not fit: refused before any answer begins
        prompts.append(ids)
        warning = room_warning(asking.label(spec), room, r.options.max_new_tokens)
        if warning:
            emit(Warn(warning))

    def finish(_i: int, a: Any) -> None:
        emit(AnswerOut(index, {**a.to_json(), "format": " + ".join(getattr(session, "formats", ())) or None}))
        if a.check is not None:
            asking.differs = asking.differs or not a.check.identical
            emit(CheckOut(index, f"kvcli: check: {asking.label(spec)}: {a.check.describe()}"))

    cache = asking.label(spec) if r.blend else spec.caches[0]
    on_text, on_answer = in_order(len(r.questions), lambda i: emit(Begin(index, r.questions[i], cache)), finish,
                                  (lambda t: emit(TextOut(t))) if r.stream else None)
    submitted = session.submit(list(r.questions), r.options, batch_size=r.batch_size, check=r.check, history=history,
                               prompts=prompts)
    with asking.watch(submitted):
        submitted.result(on_text, on_answer)


def prefill_events(jobs: Sequence[Any], *, emit: Emit, raise_single: bool = True, **run_options: Any) -> int:
    """Prefill every job (engine.corpus.Job) through the one driver (engine.corpus.run, run_options its options),
    emitting Progress and Prefilled events; returns the exit code (1 if any document failed). With raise_single,
    the only job failing raises its error instead (a plain `prefill DOC`)."""
    from .engine import corpus

    failed = 0
    records = corpus.run(jobs=jobs, progress=lambda i, done, total: emit(Progress(i, done, total)), **run_options)
    with closing(records):  # a raise here releases the run's locks and model at once
        for r in _records(records, raise_single and len(jobs) == 1):
            failed += r.status == "failed"
            failure = r.status == "failed"
            emit(Prefilled(r.index, r.to_json(), r.error if failure else None, getattr(r.exc, "hint", None) if failure else None))
    return 1 if failed else 0


def _records(records: Iterator[Any], raise_failure: bool) -> Iterator[Any]:
    for r in records:
        if r.status == "failed" and raise_failure and r.exc is not None:
            raise r.exc
        yield r
