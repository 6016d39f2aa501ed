"""kvcli chat: a conversation about one cached document, a question per line (library: engine.conversation)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from .. import served
from ..errors import UsageError
from ..output import Output
from .app import command
from .common import local_cache, read_answer_json, shown
from .options import (CacheDtypeOpt, CacheModelOpt, ConvertDtypeOpt, DeviceOpt, FollowUpOpt, JsonOpt, QuietOpt, RevisionOpt, SeedOpt, ServerOpt,
                      TemperatureOpt, TopPOpt, TrustOpt)


@command
def chat(
    cache: Annotated[str, typer.Option("--cache", "-c", metavar="CACHE", help="Cache of the document to talk about: a folder or a URL.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most tokens per answer.")] = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
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
    quiet: QuietOpt = False,
) -> int:
    """Talk about a cached document: one question per line (interactive or stdin); each follows the earlier ones."""
    out = Output(quiet=quiet)
    if str(follow_up) == "-":
        raise UsageError("chat reads its questions from stdin: give --follow-up a file")
    from ..generation import check_options, check_trust

    check_trust(trust_remote_code, model)
    earlier = read_answer_json(follow_up) if follow_up else None
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop)}
    checked = check_options(options)
    from ..remote import is_url

    if server is not False and not is_url(cache) and served.answers(out, server):  # the conversation goes through the running server
        fields = {"caches": [os.path.abspath(cache)], "options": options, "model": served.client_model(model), "revision": revision,
                  "device": device, "dtype": dtype, "convert_dtype": convert_dtype, "trust_remote_code": trust_remote_code,
                  "stream": not json_out}
        if earlier is not None:
            fields.update(follow_up=earlier, follow_up_name=str(follow_up))
        shown_warnings: set[str] = set()  # the cache's warnings once per chat, as in-process (each turn is a request)
        while (line := out.read_line("> ")) is not None:
            if line.strip():
                code, fields = served.chat_turn(out, fields, line, str(cache), model, json_out, shown_warnings)
                if code:
                    raise typer.Exit(code)
        return 0
    from ..engine import answer as an
    from ..engine.prompt import conversation

    opts = an.GenerationOptions(**checked)
    loader = an.ModelPool(model=model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)
    local = local_cache(cache, out, check=lambda m: loader.fits(m, shown(cache), convert_dtype=convert_dtype))
    from .ask import _check_request

    _check_request(local, shown(cache), dtype, convert_dtype)
    with out.status(f"loading {shown(cache)}"):
        session = an.Session(loader.for_cache(local), local, convert_dtype=convert_dtype)
    for warning in session.warnings:
        out.warn(warning)
    talk = conversation.Chat(session, conversation.from_answer_json(earlier, session.token_ids, str(follow_up)) if earlier else ())
    from ..rendering import AskRenderer

    render = AskRenderer(out, [shown(cache)], questions=1, json_out=json_out)  # as a served chat renders its answers
    from ..events import room_warning

    while (line := out.read_line("> ")) is not None:
        if line.strip():
            warning = room_warning(session, shown(cache), line, talk.history, opts.max_new_tokens)  # as a served turn warns
            if warning:
                render({"event": "warning", "message": warning})
            a = talk.ask(line, opts, on_text=None if json_out else out.write)
            render({"event": "answer", "index": 0, "answer": a.to_json()})
    return 0
