"""One `ask` request -> a stream of events, the same whichever front end runs it.

The in-process CLI and the socket server both run `ask_events`; the CLI renders the events it emits
(kvcli/cli/rendering.py) exactly as it renders the events a server sends, so a served ask prints what an
in-process one prints: warnings, per-cache errors, streamed text, answers, checks.

Events (dicts, JSON-ready): warning {message, about: "cache" for the cache's own, once per chat};
error {message, hint, exit_code} (one cache of several failed); begin {index, question, cache}; text {text};
answer {index, answer}; check {index, message}.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, closing, nullcontext
from typing import Any

from .errors import CHECK_DIFFERS_EXIT, KvcliError

Emit = Callable[[dict[str, Any]], None]
Opener = Callable[[Any], AbstractContextManager]  # cache path (a tuple of paths when blended) -> a context lending its Session


def room_warning(path: str, room: int, max_new_tokens: int) -> str | None:
    """The warning for an answer whose room (Session.check_prompt) is short of --max-new-tokens."""
    if room < max_new_tokens:
        return (f"{path}: only {room} positions are left after this question; the answer stops at {room} tokens, "
                f"not --max-new-tokens {max_new_tokens}")
    return None


def ask_events(open_session: Opener, caches: Sequence[str], questions: Sequence[str], options: Any, *, emit: Emit,
               history_for: Callable[[Any], Sequence[Any]] = lambda _s: (), batch_size: int | None = None,
               check: bool = False, stream: bool = True, watch: Callable[[Any], AbstractContextManager] = lambda _r: nullcontext(),
               shown: Callable[[str], str] = str, blend: bool = False) -> int:
    """Answer every question from every cache, emitting events; returns the exit code.

    One cache that fails is an error event and the next cache goes on (the only cache failing raises);
    answers come in question order, the first unfinished one streaming (text events) while later ones,
    decoded in the same batch, are held until it completes. shown(path): a path as messages print it.
    watch(request): a context held while each cache's request is read (a socket server's: it cancels the
    request when the client hangs up); the events are read in this thread. blend: the caches make one prompt
    (open_session receives them as one tuple; messages name them joined by " + ")."""
    from .engine.decoding.questions import in_order

    first_error: KvcliError | None = None
    differs = False
    groups: list[Any] = [tuple(caches)] if blend else list(caches)
    label = (lambda p: " + ".join(shown(c) for c in p)) if blend else shown
    for index, path in enumerate(groups):
        held = open_session(path)
        try:
            session = held.__enter__()
        except KvcliError as exc:
            if len(groups) == 1:
                raise
            emit({"event": "error", "message": str(exc), "hint": exc.hint, "exit_code": exc.exit_code})
            first_error = first_error or exc
            continue
        try:
            for warning in session.warnings:
                emit({"event": "warning", "message": warning, "about": "cache"})
            history = history_for(session)
            prompts = []
            for q in questions:
                ids, room = session.check_prompt(q, history, options)  # a prompt that does not fit: refused before any answer begins
                prompts.append(ids)
                warning = room_warning(label(path), room, options.max_new_tokens)
                if warning:
                    emit({"event": "warning", "message": warning})

            def finish(i: int, a: Any, index: int = index, path: str = path) -> None:
                nonlocal differs
                emit({"event": "answer", "index": index, "answer": a.to_json()})
                if a.check is not None:
                    differs = differs or not a.check.identical
                    emit({"event": "check", "index": index, "message": f"kvcli: check: {label(path)}: {a.check.describe()}"})

            on_text, on_answer = in_order(
                len(questions), lambda i, index=index, path=path: emit({"event": "begin", "index": index, "question": questions[i],
                                                                        "cache": label(path) if blend else path}),
                finish, (lambda t: emit({"event": "text", "text": t})) if stream else None)
            request = session.submit(list(questions), options, batch_size=batch_size, check=check, history=history, prompts=prompts)
            with watch(request):
                request.result(on_text, on_answer)
        finally:
            held.__exit__(None, None, None)
    if first_error:
        return first_error.exit_code
    return CHECK_DIFFERS_EXIT if differs else 0


def prefill_events(jobs: Sequence[Any], *, emit: Emit, raise_single: bool = True, **run_options: Any) -> int:
    """Prefill every job (engine.corpus.Job) through the one driver (engine.corpus.run, run_options its options),
    emitting events; returns the exit code (1 if any document failed). Events: progress {index, done, total};
    prefilled {index, record: DocResult.to_json(), message and hint for a failure}. With raise_single, the only
    job failing raises its error instead (a plain `prefill DOC`)."""
    from .engine import corpus

    failed = 0
    records = corpus.run(jobs=jobs, progress=lambda i, done, total: emit({"event": "progress", "index": i, "done": done, "total": total}),
                         **run_options)
    with closing(records):  # a raise here releases the run's locks and model at once
        for r in records:
            if r.status == "failed":
                if raise_single and len(jobs) == 1 and r.exc is not None:
                    raise r.exc
                failed += 1
            ev = {"event": "prefilled", "index": r.index, "record": r.to_json()}
            if r.status == "failed":
                ev.update(message=r.error, hint=getattr(r.exc, "hint", None))
            emit(ev)
    return 1 if failed else 0
