"""kvcli ask: questions answered from caches, in-process or through a running server (library: engine.answer)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import served
from ..errors import UsageError
from ..generation import DEFAULT_BATCH, DEFAULT_MAX_NEW_TOKENS, DEFAULT_STOP_LOOPS
from .output import Output
from .rendering import AskRenderer
from .app import command
from .common import cache_formats, gather_questions, local_cache, read_answer_json, shown
from .options import (CacheDtypeOpt, CacheModelOpt, ConvertDtypeOpt, DeviceOpt, FollowUpOpt, IdsOpt, JsonOpt, NoRepeatNgramOpt, QuietOpt,
                      RepetitionPenaltyOpt, RevisionOpt, SeedOpt, ServerOpt, StopLoopsOpt, TemperatureOpt, TopPOpt, TrustOpt)


@command
def ask(
    questions: Annotated[Optional[list[str]], typer.Argument(metavar="QUESTION", help="Questions (or -f FILE, or stdin).", show_default=False)] = None,
    cache: Annotated[list[str], typer.Option("--cache", "-c", metavar="CACHE", help="Cache to answer from: a folder or a URL (required, repeatable).", show_default=False)] = [],  # noqa: B006
    questions_file: Annotated[Optional[str], typer.Option("--questions-file", "-f", metavar="FILE", help="One question per line ('-' for stdin); blank and # lines skipped.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most answer tokens.")] = DEFAULT_MAX_NEW_TOKENS,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    no_repeat_ngram_size: NoRepeatNgramOpt = 0,
    stop_loops: StopLoopsOpt = DEFAULT_STOP_LOOPS,
    seed: SeedOpt = None,
    stop: Annotated[list[str], typer.Option(metavar="TEXT", help="End the answer at this string (repeatable).", show_default=False)] = [],  # noqa: B006
    model: CacheModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: CacheDtypeOpt = None,
    convert_dtype: ConvertDtypeOpt = False,
    null: Annotated[bool, typer.Option("--null", "-0", help="End each plain answer with a NUL byte instead of a newline.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Also run each prompt and answer once without the cache and compare logits "
                                        "(costs a full recompute of the document per question); exit 4 if an answer differs.")] = False,
    follow_up: FollowUpOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, metavar="N", help="Questions decoded together on one document (1: one by one; more answer several questions in less time than one by one).")] = DEFAULT_BATCH,
    blend: Annotated[bool, typer.Option("--blend", help="Make ONE prompt of the caches' documents in the order given, then the question, "
                                        "from their caches (approximate: --check measures it; docs/composing.md).")] = False,
    recompute: Annotated[Optional[float], typer.Option(metavar="FRACTION", help="With --blend or a sectioned cache: the share of each later document "
                                                      "(section) recomputed so it sees the text before it (0: none; 1: exact, as slow "
                                                      "as a recompute; default 0.15).", show_default=False)] = None,
    sections: Annotated[Optional[int], typer.Option("--sections", min=1, metavar="N", help="A sectioned cache (a document longer than the window): use the N sections that best match each question (default: as many as fit the window).", show_default=False)] = None,
    every: Annotated[bool, typer.Option("--all", help="A sectioned cache: use every section, in document order (refused past the model's positions).")] = False,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    ids: IdsOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Answer questions from cached documents, computing only the questions' tokens."""
    out = Output(quiet=quiet)
    if not cache:  # checked before anything heavy loads: a usage error is instant
        raise UsageError("--cache is required (the cache to answer from; make one with kvcli prefill DOC)")
    from ..generation import check_options, check_trust

    sectioned = _sectioned(cache)
    if recompute is not None and not blend and not sectioned:
        raise UsageError("--recompute is the share of each document recomputed by --blend or of each section of a sectioned "
                         "cache: add --blend")
    if (sections is not None or every) and not sectioned:
        raise UsageError("--sections and --all choose the sections of a sectioned cache (a document longer than the window); "
                         f"{cache[0]} is not one")
    how = None
    if sectioned and not blend:
        from ..engine.sections.session import DEFAULT_RECOMPUTE as SECTION_RECOMPUTE, Sections

        how = Sections(count=sections, every=every, recompute=SECTION_RECOMPUTE if recompute is None else recompute)
        if follow_up:
            raise UsageError("--follow-up cannot continue a sectioned cache's prompt (each question makes its own)")
    if blend and len(cache) < 2:
        raise UsageError("--blend makes one prompt of several caches: give --cache at least twice")
    if blend and follow_up:
        raise UsageError("--follow-up cannot continue a blended prompt: ask the follow-up with the documents blended again")
    fraction = None
    if blend:
        from ..engine.cache.blend import DEFAULT_RECOMPUTE, check_fraction

        fraction = check_fraction(DEFAULT_RECOMPUTE if recompute is None else recompute)
    checked = check_options({"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop),
                             "repetition_penalty": repetition_penalty, "no_repeat_ngram_size": no_repeat_ngram_size,
                             "stop_loops": stop_loops})
    if str(follow_up) == "-" and (questions_file == "-" or not questions):
        raise UsageError("--follow-up - reads stdin: give the questions as arguments or with -f FILE")
    earlier = read_answer_json(follow_up) if follow_up else None
    check_trust(trust_remote_code, model)
    qs = gather_questions(questions or [], questions_file)
    formats = cache_formats(out, list(cache))
    if blend:
        formats = [" + ".join(str(f) for f in formats)]
    from ..remote import is_url

    if check and server:
        raise UsageError("--check recomputes every prompt in this process: it cannot go through a server (drop --server)")
    if server is not False and not check and not sectioned and not any(is_url(c) for c in cache):  # a running `kvcli serve` answers without importing torch
        options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop),
                   "repetition_penalty": repetition_penalty, "no_repeat_ngram_size": no_repeat_ngram_size,
                   "stop_loops": stop_loops}
        fields = {"caches": [os.path.abspath(c) for c in cache], "questions": qs, "options": options, "model": served.client_model(model),
                  "revision": revision, "device": device, "dtype": dtype, "convert_dtype": convert_dtype,
                  "trust_remote_code": trust_remote_code, "stream": not json_out, "batch_size": batch_size}
        if blend:
            fields["blend"] = fraction
        if earlier is not None:
            fields.update(follow_up=earlier, follow_up_name=str(follow_up))

        names = [" + ".join(str(c) for c in cache)] if blend else [str(c) for c in cache]
        render = AskRenderer(out, names, questions=len(qs), json_out=json_out, null=null, served=True,
                             max_new_tokens=max_new_tokens, formats=formats, ids=ids)
        code = served.run(out, server, "ask", fields, [*(str(Path(c)) for c in cache), model], render=render)
        if code is not None:
            return code
    from contextlib import contextmanager

    from ..events import ask_events
    from ..engine import answer as an
    from ..engine.prompt import conversation

    opts = an.GenerationOptions(**checked)
    loader = an.ModelPool(model=model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)

    @contextmanager
    def open_session(path):
        if blend:  # a tuple of caches, blended into one prompt
            locals_ = [local_cache(p, out, check=lambda m, p=p: loader.fits(m, shown(p), convert_dtype=convert_dtype)) for p in path]
            with out.status(f"blending {len(path)} caches"):
                session = loader.session(locals_, convert_dtype=convert_dtype, blend=fraction)
        else:
            local = local_cache(path, out, check=lambda m: loader.fits(m, shown(path), convert_dtype=convert_dtype))
            with out.status(f"loading {path}"):
                session = loader.session(local, where=shown(path), convert_dtype=convert_dtype, sections=how)
        try:
            yield session
        finally:
            if hasattr(session, "close"):  # a sectioned cache, held open for its sections
                session.close()

    def history_for(session) -> list:
        return conversation.from_answer_json(earlier, session.token_ids, str(follow_up)) if earlier is not None else []

    names = [" + ".join(shown(c) for c in cache)] if blend else [shown(c) for c in cache]
    render = AskRenderer(out, names, questions=len(qs), json_out=json_out, null=null, max_new_tokens=max_new_tokens,
                         formats=formats, ids=ids)
    return ask_events(open_session, cache, qs, opts, emit=render, history_for=history_for, batch_size=batch_size, check=check,
                      stream=not json_out, shown=shown, blend=blend)



def _sectioned(caches: list[str]) -> bool:
    """Whether any local cache given is sectioned (its manifest alone read; a URL or a broken cache says no here and is
    reported where it is opened)."""
    from ..errors import CacheError
    from ..format import store
    from ..remote import is_url

    for c in caches:
        if is_url(c):
            continue
        try:
            if store.read_manifest(c, chain=False).sections is not None:
                return True
        except CacheError:
            continue
    return False
