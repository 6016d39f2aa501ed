"""kvcli ask: questions answered from caches, in-process or through a running server (library: engine.answer)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import served
from ..errors import CHECK_DIFFERS_EXIT, KvcliError, UsageError
from ..output import Output
from .app import command
from .common import gather_questions, local_cache, read_answer_json, shown
from .options import (CacheDtypeOpt, ConvertDtypeOpt, DeviceOpt, FollowUpOpt, JsonOpt, ModelOpt, QuietOpt, RevisionOpt, SeedOpt, ServerOpt,
                      TemperatureOpt, TopPOpt, TrustOpt)


@command
def ask(
    questions: Annotated[Optional[list[str]], typer.Argument(metavar="QUESTION", help="Questions (or -f FILE, or stdin).", show_default=False)] = None,
    cache: Annotated[list[str], typer.Option("--cache", "-c", metavar="CACHE", help="Cache to answer from: a folder or a URL (required, repeatable).", show_default=False)] = [],  # noqa: B006
    questions_file: Annotated[Optional[str], typer.Option("--questions-file", "-f", metavar="FILE", help="One question per line ('-' for stdin); blank and # lines skipped.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Most answer tokens.")] = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    repetition_penalty: Annotated[float, typer.Option(min=0.0, metavar="R", help="Above 1 makes tokens already in the prompt or answer less likely (generate()'s own; 1: off).")] = 1.0,
    no_repeat_ngram_size: Annotated[int, typer.Option(min=0, metavar="N", help="Never repeat an N-token sequence of the prompt or answer (0: off).")] = 0,
    seed: SeedOpt = None,
    stop: Annotated[list[str], typer.Option(metavar="TEXT", help="End the answer at this string (repeatable).", show_default=False)] = [],  # noqa: B006
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: CacheDtypeOpt = None,
    convert_dtype: ConvertDtypeOpt = False,
    null: Annotated[bool, typer.Option("--null", "-0", help="End each plain answer with a NUL byte instead of a newline.")] = False,
    check: Annotated[bool, typer.Option("--check", help="Also run each prompt and answer once without the cache and compare logits "
                                        "(costs a full recompute of the document per question); exit 4 if an answer differs.")] = False,
    follow_up: FollowUpOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, metavar="N", help="Questions decoded together on one document (1: one by one; measured here: 8 questions in one batch 3.6x, 16 in one batch 5.35x faster than one by one).")] = 8,
    trust_remote_code: TrustOpt = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Answer questions from cached documents, computing only the questions' tokens."""
    out = Output(quiet=quiet)
    if not cache:  # checked before anything heavy loads: a usage error is instant
        raise UsageError("--cache is required (the cache to answer from; make one with kvcli prefill DOC)")
    if top_p <= 0:
        raise UsageError("--top-p must be above 0")
    if repetition_penalty <= 0:
        raise UsageError("--repetition-penalty must be above 0 (1 is off)")
    if str(follow_up) == "-" and (questions_file == "-" or not questions):
        raise UsageError("--follow-up - reads stdin: give the questions as arguments or with -f FILE")
    earlier = read_answer_json(follow_up) if follow_up else None
    if trust_remote_code and not model:
        raise UsageError("--trust-remote-code needs an explicit --model: a cache must not choose whose code runs")
    qs = gather_questions(questions or [], questions_file)
    from ..remote import is_url

    if check and server:
        raise UsageError("--check recomputes every prompt in this process: it cannot go through a server (drop --server)")
    if server is not False and not check and not any(is_url(c) for c in cache):  # a running `kvcli serve` answers without importing torch
        options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "stop": list(stop),
                   "repetition_penalty": repetition_penalty, "no_repeat_ngram_size": no_repeat_ngram_size}
        fields = {"caches": [os.path.abspath(c) for c in cache], "questions": qs, "options": options, "model": served.client_model(model),
                  "revision": revision, "device": device, "dtype": dtype, "convert_dtype": convert_dtype,
                  "trust_remote_code": trust_remote_code, "stream": not json_out, "batch_size": batch_size}
        if earlier is not None:
            fields.update(follow_up=earlier, follow_up_name=str(follow_up))

        def answered(i: int, a: dict) -> None:
            if json_out:
                out.json_line({**a, "cache": str(cache[i]), "served": True})
            else:
                out.write("\0" if null else "\n")

        code = served.run(out, server, "ask", fields, [*(str(Path(c)) for c in cache), model], answered=answered)
        if code is not None:
            return code
    from ..engine import answer as an, conversation

    opts = an.GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop),
                                repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    several = len(cache) * len(qs) > 1 and not json_out and not null
    loader = an.ModelPool(model=model, revision=revision, device=device, dtype=dtype, trust_remote_code=trust_remote_code, progress=out.note)
    first_error: Optional[KvcliError] = None
    differs = False
    for path in cache:
        try:
            local = local_cache(path, out)
            with out.status(f"loading {path}"):
                session = an.Session(loader.for_cache(local), local, convert_dtype=convert_dtype)
            for warning in session.warnings:
                out.warn(warning)
        except KvcliError as exc:
            if len(cache) == 1:
                raise
            out.error(exc, exc.hint)
            first_error = first_error or exc
            continue
        history = conversation.from_answer_json(earlier, session.token_ids, str(follow_up)) if earlier is not None else []
        for q in qs:
            room = session.answer_room(q, history)
            if room is not None and 0 < room < max_new_tokens:
                out.warn(f"{shown(path)}: only {room} positions are left after this question; the answer stops at {room} tokens, "
                         f"not --max-new-tokens {max_new_tokens}")

        def begin(q: str) -> None:
            out.check_stdout()  # a reader that left (`| head -1`) cancels the questions still to come
            if several:  # on a terminal only: which cache and question the next answer belongs to
                out.heading(f"{shown(path)}: {q}" if len(cache) > 1 else q)

        def finish(a) -> None:
            nonlocal differs
            a.cache = shown(path)
            if json_out:
                out.json_line({**a.to_json(), "served": False})
            else:
                out.write("\0" if null else "\n")
            if a.check is not None:
                differs = differs or not a.check.identical
                if not json_out:
                    out.note(f"kvcli: check: {shown(path)}: {a.check.describe()}")
            out.summary(_timing(a))

        if batch_size > 1 and len(qs) > 1 and not history:
            _ask_together(session, qs, opts, batch_size, begin, finish, None if json_out else out.write, check)
            continue
        for q in qs:
            begin(q)
            finish(session.ask(q, opts, on_text=None if json_out else out.write, check=check, history=history))
    if first_error:
        return first_error.exit_code
    return CHECK_DIFFERS_EXIT if differs else 0


def _ask_together(session, qs: list[str], opts, batch_size: int, begin, finish, write, check: bool) -> None:
    """Session.ask_many, rendered in question order: the first unfinished question's answer streams live,
    later ones are held until it completes (each JSON line, as before, when its answer is complete)."""
    from ..engine.questions import in_order

    text, answered = in_order(len(qs), lambda i: begin(qs[i]), lambda _i, a: finish(a), write)
    session.ask_many(qs, opts, batch_size=batch_size, on_text=text, on_answer=answered, check=check)


def _timing(a) -> str:
    n = len(a.answer_token_ids)
    rate = (n - 1) / (a.total_s - a.ttft_s) if n > 1 and a.ttft_s is not None and a.total_s > a.ttft_s else None
    ttft = f", first token {a.ttft_s:.2f} s" if a.ttft_s is not None else ""
    line = f"{n} tokens in {a.total_s:.1f} s{ttft}" + (f", {rate:.1f} tokens/s" if rate else "")
    return line + (" (stopped at --max-new-tokens)" if a.finish_reason == "length" else "")
