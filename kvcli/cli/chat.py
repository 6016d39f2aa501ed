"""kvcli chat: a conversation about one cached document, a question per line (library: engine.prompt.conversation).

One loop, in-process and served: each turn is one ask request carrying the conversation so far, sent to the running
server or run here by events.ask_events on the session loaded once; the loop renders its events with one AskRenderer.
Questions from a pipe get their answers labelled as ask labels several (`==> Q <==`). A conversation that fills
the model's positions ends the chat (exit 0, the reason on stderr)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from . import served
from ..errors import PromptTooLongError, UsageError
from ..generation import DEFAULT_MAX_NEW_TOKENS, DEFAULT_STOP_LOOPS
from .output import Output, is_terminal
from .rendering import AskRenderer, positions_ran_out
from .app import command
from .common import cache_formats, local_cache, read_answer_json, shown
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
    out = Output(quiet=quiet)
    if str(follow_up) == "-":
        raise UsageError("chat reads its questions from stdin: give --follow-up a file")
    from ..generation import check_options, check_trust

    check_trust(trust_remote_code, model)
    earlier = read_answer_json(follow_up) if follow_up else None
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop),
               "repetition_penalty": repetition_penalty, "no_repeat_ngram_size": no_repeat_ngram_size, "stop_loops": stop_loops}
    checked = check_options(options)
    from ..remote import is_url

    through = server is not False and not is_url(cache) and served.answers(out, server)  # the turns go through the running server
    render = AskRenderer(out, [shown(cache)], questions=1, json_out=json_out, max_new_tokens=max_new_tokens, served=through,
                         labelled=not is_terminal(sys.stdin), once=set(), formats=cache_formats(out, [cache]), ids=ids)  # once: the cache's warnings once per chat, not per turn
    if through:
        fields = {"caches": [os.path.abspath(cache)], "options": options, "model": served.client_model(model), "revision": revision,
                  "device": device, "dtype": dtype, "convert_dtype": convert_dtype, "trust_remote_code": trust_remote_code,
                  "stream": not json_out}
        start = {"follow_up": earlier, "follow_up_name": str(follow_up)} if earlier is not None else {}

        def turn(question: str, history: list | None) -> int:  # one request per turn, carrying the conversation so far
            conv = start if history is None else {"history": history}
            return served.run(out, True, "ask", {**fields, **conv, "questions": [question]}, [str(cache), model], render=render)
    else:  # in-process: the model and the cache load here, and each turn runs the served turn's events (kvcli/events.py)
        from contextlib import nullcontext

        from ..engine import answer as an
        from ..engine.prompt import conversation
        from ..events import ask_events

        opts = an.GenerationOptions(**checked)
        loader = an.ModelPool(model=model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                              progress=out.note)
        local = local_cache(cache, out, check=lambda m: loader.fits(m, shown(cache), convert_dtype=convert_dtype))
        with out.status(f"loading {shown(cache)}"):
            session = loader.session(local, where=shown(cache), convert_dtype=convert_dtype)
        for warning in session.warnings:  # before the first question; each turn's repeat is dropped by render.once
            render({"event": "warning", "message": warning, "about": "cache"})
        first = conversation.from_answer_json(earlier, session.token_ids, str(follow_up)) if earlier else []

        def turn(question: str, history: list | None) -> int:
            return ask_events(lambda _path: nullcontext(session), [str(cache)], [question], opts, emit=render, stream=not json_out,
                              history_for=lambda _s: first if history is None else history, shown=shown)
    history = None  # [[question, answer], ...] once a turn has answered
    while (line := out.read_line("> ")) is not None:
        if not line.strip():
            continue
        before = len(render.answers)
        try:  # a prompt that does not fit is refused before its answer begins
            code = turn(line, history)
        except PromptTooLongError as exc:
            if not (history or earlier):
                raise
            return _full(out, exc.reason)
        if code or len(render.answers) == before:
            raise typer.Exit(code or 1)
        a = render.answers[-1]
        history = [[h["question"], h["answer"]] for h in a.get("history", [])] + [[a["question"], a["answer"]]]
        if positions_ran_out(a, max_new_tokens):
            return _full(out, "the last answer used the model's last positions")
    return 0


def _full(out: Output, why: str) -> int:
    """End a chat whose conversation fills the model: no later question can fit."""
    out.note(f"kvcli: note: the conversation is full ({why}); the chat ends here")
    return 0
