"""kvcli chat: a conversation about one cached document, a question per line (library: engine.prompt.conversation).

One loop, in-process and served: each turn is one ask request carrying the conversation so far, sent to the running
server or run here by events.ask_events on the session loaded once; the loop renders its events with one AskRenderer.
Questions from a pipe get their answers labelled as ask labels several (`==> Q <==`). A conversation that fills
the model's positions ends the chat (exit 0, the reason on stderr)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from . import served
from ..errors import PromptTooLongError, UsageError
from ..generation import DEFAULT_MAX_NEW_TOKENS, DEFAULT_STOP_LOOPS
from .output import Output, is_terminal
from .rendering import AskRenderer, Look, positions_ran_out
from .app import command
from .common import cache_formats, local_opener, read_answer_json, shown
from .options import (CacheDtypeOpt, CacheModelOpt, ConvertDtypeOpt, DeviceOpt, FollowUpOpt, IdsOpt, JsonOpt, NoRepeatNgramOpt, QuietOpt,
                      RepetitionPenaltyOpt, RevisionOpt, SeedOpt, ServerOpt, StopLoopsOpt, TemperatureOpt, TopPOpt, TrustOpt)


@command
def chat(
    cache: Annotated[str, typer.Option("--cache", "-c", metavar="CACHE", help="Cache of the document to talk about: a folder or a URL.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most tokens per answer.")] = DEFAULT_MAX_NEW_TOKENS,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    no_repeat_ngram_size: NoRepeatNgramOpt = 0,
    stop_loops: StopLoopsOpt = DEFAULT_STOP_LOOPS,
    seed: SeedOpt = None,
    stop: Annotated[list[str], typer.Option(metavar="TEXT", help="End an answer at this string (repeatable).", show_default=False)] = [],  # noqa: B006
    follow_up: FollowUpOpt = None,
    model: CacheModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: CacheDtypeOpt = None,
    convert_dtype: ConvertDtypeOpt = False,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    ids: IdsOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Talk about a cached document: one question per line (interactive or stdin); each follows the earlier ones."""
    from ..requests import AskRequest, ModelSpec, options_from

    out = Output(quiet=quiet)
    if str(follow_up) == "-":
        raise UsageError("chat reads its questions from stdin: give --follow-up a file")
    first = AskRequest(caches=(cache,), questions=("",), model=ModelSpec(model, revision, device, dtype, trust_remote_code),
                       options=options_from({"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                             "seed": seed, "stop": list(stop), "repetition_penalty": repetition_penalty,
                                             "no_repeat_ngram_size": no_repeat_ngram_size, "stop_loops": stop_loops}),
                       convert_dtype=convert_dtype, stream=not json_out,
                       follow_up=read_answer_json(follow_up) if follow_up else None, follow_up_name=str(follow_up))
    return _chat(out, first, server=server, json_out=json_out, ids=ids)


def _chat(out: Output, first, *, server, json_out: bool, ids: bool) -> int:
    """The conversation loop: each line one ask request carrying the conversation so far (first: the first turn's)."""
    from dataclasses import replace

    from ..remote import is_url

    cache = first.caches[0]
    through = server is not False and not is_url(cache) and served.answers(out, server)  # the turns go through the running server
    look = Look(json_out=json_out, labelled=not is_terminal(sys.stdin), ids=ids, formats=tuple(cache_formats(out, [cache])))
    render = AskRenderer(out, [shown(cache)], questions=1, look=look, max_new_tokens=first.options.max_new_tokens,
                         served=through, once=set())  # once: the cache's warnings once per chat
    turn = _served_turn(out, render) if through else _local_turn(out, render, first)
    history = None  # [[question, answer], ...] once a turn has answered
    while (line := out.read_line("> ")) is not None:
        if not line.strip():
            continue
        before = len(render.answers)
        request = replace(first, questions=(line,)) if history is None else replace(
            first, questions=(line,), follow_up=None, history=tuple((q, a) for q, a in history))
        try:  # a prompt that does not fit is refused before its answer begins
            code = turn(request)
        except PromptTooLongError as exc:
            if not (history or first.follow_up is not None):
                raise
            return _full(out, exc.reason)
        if code or len(render.answers) == before:
            raise typer.Exit(code or 1)
        a = render.answers[-1]
        history = [[h["question"], h["answer"]] for h in a.get("history", [])] + [[a["question"], a["answer"]]]
        if positions_ran_out(a, first.options.max_new_tokens):
            return _full(out, "the last answer used the model's last positions")
    return 0


def _served_turn(out: Output, render):
    def turn(request) -> int:  # one request per turn, carrying the conversation so far
        return served.run(out, True, request, [str(request.caches[0]), request.model.source], render=render)

    return turn


def _local_turn(out: Output, render, first):
    """In-process: the model and the cache load here once; each turn runs the served turn's events (kvcli/events.py)."""
    from contextlib import nullcontext

    from ..engine import answer as an
    from ..events import Warn, ask_events

    pool = an.ModelPool(first.model, progress=out.note)
    with local_opener(out, pool)(first.sessions()[0]) as session:
        pass  # a chat's session stays open for its whole life
    for warning in session.warnings:  # before the first question; each turn's repeat is dropped by render.once
        render(Warn(warning, "cache"))

    def turn(request) -> int:
        return ask_events(request, lambda _spec: nullcontext(session), emit=render, shown=shown)

    return turn
def _full(out: Output, why: str) -> int:
    """End a chat whose conversation fills the model: no later question can fit."""
    out.note(f"kvcli: note: the conversation is full ({why}); the chat ends here")
    return 0
