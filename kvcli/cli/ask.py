"""kvcli ask: questions answered from caches, in-process or through a running server (library: engine.answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import served
from ..errors import UsageError
from ..generation import DEFAULT_BATCH, DEFAULT_MAX_NEW_TOKENS, DEFAULT_STOP_LOOPS
from .output import Output
from .rendering import AskRenderer, Look
from .app import command
from .common import gather_questions, local_opener, read_answer_json, shown
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
    from ..requests import AskRequest, Blend, ModelSpec, check_caches, options_from

    out = Output(quiet=quiet)
    check_caches(cache)  # before anything heavy loads: a usage error is instant
    how = _sections(cache, blend=blend, recompute=recompute, sections=sections, every=every, follow_up=follow_up)
    blended = (Blend() if recompute is None else Blend(recompute)) if blend else None
    options = options_from({"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                            "stop": list(stop), "repetition_penalty": repetition_penalty,
                            "no_repeat_ngram_size": no_repeat_ngram_size, "stop_loops": stop_loops})
    if str(follow_up) == "-" and (questions_file == "-" or not questions):
        raise UsageError("--follow-up - reads stdin: give the questions as arguments or with -f FILE")
    earlier = read_answer_json(follow_up) if follow_up else None
    request = AskRequest(caches=tuple(cache), questions=tuple(gather_questions(questions or [], questions_file)), options=options,
                         model=ModelSpec(model, revision, device, dtype, trust_remote_code), convert_dtype=convert_dtype,
                         blend=blended, batch_size=batch_size, check=check, stream=not json_out, follow_up=earlier,
                         follow_up_name=str(follow_up), sections=how)
    if check and server:
        raise UsageError("--check recomputes every prompt in this process: it cannot go through a server (drop --server)")
    look = Look(json_out=json_out, null=null, ids=ids)  # how the answers are rendered (formats: from the records)
    return _ask(out, request, server=server, look=look)


def _sections(cache: list[str], *, blend: bool, recompute: Optional[float], sections: Optional[int], every: bool, follow_up):
    """Which sections each question of a sectioned cache uses (None for other caches), the options checked."""
    sectioned = _sectioned(cache, remote=sections is not None or every or recompute is not None)
    if recompute is not None and not blend and not sectioned:
        raise UsageError("--recompute is the share of each document recomputed by --blend or of each section of a sectioned "
                         "cache: add --blend")
    if (sections is not None or every) and not sectioned:
        raise UsageError("--sections and --all choose the sections of a sectioned cache (a document longer than the window); "
                         f"{cache[0]} is not one")
    if not sectioned or blend:
        return None
    from ..requests import SECTION_RECOMPUTE, Sections

    if follow_up:
        raise UsageError("--follow-up cannot continue a sectioned cache's prompt (each question makes its own)")
    return Sections(count=sections, every=every, recompute=SECTION_RECOMPUTE if recompute is None else recompute)


def _ask(out: Output, request, *, server: Optional[bool], look: Look) -> int:
    """Through a running `kvcli serve` (which answers without this process importing torch), else in-process."""
    from ..remote import is_url

    caches = request.caches
    if server is not False and not request.check and not any(is_url(c) for c in caches):
        names = [" + ".join(caches)] if request.blend else list(caches)
        render = AskRenderer(out, names, questions=len(request.questions), served=True,
                             max_new_tokens=request.options.max_new_tokens, look=look)
        code = served.run(out, server, request, [*(str(Path(c)) for c in caches), request.model.source], render=render)
        if code is not None:
            return code
    from ..engine import answer as an
    from ..events import ask_events

    pool = an.ModelPool(request.model, progress=out.note)
    names = [" + ".join(shown(c) for c in caches)] if request.blend else [shown(c) for c in caches]
    render = AskRenderer(out, names, questions=len(request.questions), max_new_tokens=request.options.max_new_tokens, look=look)
    try:
        return ask_events(request, local_opener(out, pool), emit=render, shown=shown)
    finally:
        pool.close()


def _sectioned(caches: list[str], *, remote: bool = False) -> bool:
    """Whether any cache given is sectioned: a local one by its folders (format.sections.is_sectioned); one at a URL
    is asked only with remote (options that choose sections were given): its manifest says, and one that cannot be
    read is left to the fetch to report."""
    from ..errors import KvcliError
    from ..format.sections import is_sectioned
    from ..remote import is_url

    for c in caches:
        if not is_url(c):
            if is_sectioned(Path(c)):
                return True
        elif remote:
            from ..remote import objects

            try:
                if objects.read_manifest(c).sections is not None:
                    return True
            except KvcliError:
                continue
    return False
