"""kvcli bench: prefill, restore and time to first token measured on one document (library: kvcli.bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, get_args

import typer

from ..errors import UsageError
from .output import Output
from .app import command
from .common import gather_questions
from .options import DeviceOpt, Dtype, JsonOpt, ModelOpt, QuietOpt, RevisionOpt, WeightsOpt


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
    dtype: Annotated[list[str], typer.Option("--dtype", metavar="[auto|float32|bfloat16|float16]", help="Compute dtype (auto: float32 on CPU, the model's own on an accelerator). Repeat it to measure each in turn and compare them.")] = ["auto"],  # noqa: B006
    weights: WeightsOpt = None,
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
    pool = [q for f in questions_file for q in gather_questions([], str(f))]
    for bits in kv_bits:  # before the model loads
        mf.check_kv_bits(bits)
    if bad := [d for d in dtype if d not in get_args(Dtype)]:
        raise UsageError(f"--dtype {bad[0]!r}: choose {', '.join(get_args(Dtype))}")
    if len(set(dtype)) < len(dtype):
        raise UsageError("--dtype: each dtype once")
    results = []
    for name in dtype:  # one model at a time: two float copies need not fit together
        with out.status("loading model"):
            lm = models.load(model, revision=revision, device=device, dtype=name, progress=out.note, weights=weights)
        results.append(bn.run(lm, document, tokens=lengths, questions=questions, progress=out.note, answer_tokens=answer_tokens,
                              decode_tokens=decode_tokens, kv_bits=kv_bits, question_list=pool or None,
                              agreement_tokens=agreement_tokens))
        del lm
    compared = bn.compare(results)
    if json_out:
        out.json_doc(results[0] if len(results) == 1 else {"runs": results, "dtype_comparison": compared})
    else:
        for result in results:
            out.table(bn.render(result))
    for line in bn.verdicts(compared):
        out.note(line)
    if len(results) == 1 and (hint := _dtype_hint(results[0])):
        out.note(hint)
    return 0


def _dtype_hint(result: dict) -> str | None:
    """How to measure bfloat16 against float32, on a CPU that computes bfloat16 natively."""
    from ..engine import throughput

    if result["device"] != "cpu" or result["dtype"] not in ("float32", "bfloat16") or not (flag := throughput.native_bfloat16()):
        return None
    return f"this CPU computes bfloat16 natively ({flag}): `--dtype float32 --dtype bfloat16` measures both and says which is faster here"


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
