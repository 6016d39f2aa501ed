"""kvcli bench: prefill, restore and time to first token measured on one document (library: kvcli.bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from .output import Output
from .app import command
from .common import gather_questions
from .options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, QuietOpt, RevisionOpt, WeightsOpt


@command
def bench(
    doc: Annotated[Path, typer.Argument(metavar="DOC", help="Document to measure with (repeated or cut to each length).")],
    tokens: Annotated[list[str], typer.Option("--tokens", "-n", metavar="N|max", show_default=False, help="Document lengths in tokens (repeatable; default: 1k, 2k, 4k, 8k within the model's limit). 'max': 1k doubling up to the model's limit, the last length that limit less room for a question and answer.")] = [],  # noqa: B006
    questions: Annotated[int, typer.Option(min=1, metavar="N", help="Questions timed per length.")] = 3,
    answer_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="Tokens per whole answer compared with a full recompute.")] = 32,
    questions_file: Annotated[list[Path], typer.Option("--questions-file", "-f", metavar="FILE", help="Questions to use, one per line (repeatable; default: generic ones).")] = [],  # noqa: B006
    kv_bits: Annotated[list[int], typer.Option("--kv-bits", metavar="BITS", help="Also measure this quantized format against the lossless cache (8 or 4; repeatable).")] = [],  # noqa: B006
    decode_tokens: Annotated[int, typer.Option(min=2, metavar="N", help="Answer tokens per question when timing decode (one question, then 8 batched).")] = 64,
    agreement_tokens: Annotated[int, typer.Option(min=1, metavar="N", help="New tokens per answer when measuring a quantized format's agreement.")] = 64,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    weights: WeightsOpt = "float",
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> int:
    """Measure prefill, restore, time to first token with and without the cache, decode (one question and 8
    batched), peak memory and sizes."""
    from .. import bench as bn, documents
    from ..engine.model import models
    from ..format import manifest as mf

    out = Output(quiet=quiet)
    lengths = _lengths(tokens)
    document = documents.read(doc)
    pool = []
    for f in questions_file:
        pool += gather_questions([], str(f))
    for bits in kv_bits:  # before the model loads
        mf.check_kv_bits(bits)
    with out.status("loading model"):
        lm = models.load(model, revision=revision, device=device, dtype=dtype, progress=out.note, weights=weights)
    result = bn.run(lm, document, tokens=lengths, questions=questions, progress=out.note, answer_tokens=answer_tokens,
                    decode_tokens=decode_tokens, kv_bits=kv_bits, question_list=pool or None, agreement_tokens=agreement_tokens)
    if json_out:
        out.json_doc(result)
    else:
        out.table(bn.render(result))
    return 0


def _lengths(values: list[str]) -> list[int] | str | None:
    """--tokens as bench.run takes it: the lengths, "max" alone, or None (the default lengths)."""
    from ..bench import TO_THE_LIMIT

    if TO_THE_LIMIT in values:
        if len(values) > 1:
            raise UsageError(f"--tokens {TO_THE_LIMIT} picks every length itself: give it alone, without other --tokens")
        return TO_THE_LIMIT
    for v in values:
        if not v.isdigit():
            raise UsageError(f"--tokens takes a number of tokens or '{TO_THE_LIMIT}', got {v!r}")
    return [int(v) for v in values] or None
