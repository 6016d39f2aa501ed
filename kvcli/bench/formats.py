"""kvcli bench --kv-bits: what each quantized storage format costs in fidelity and buys in size and speed.

For one document length whose lossless cache measure.py has just written, each format (8-bit, 4-bit) is
prefilled from the same document and measured against the lossless cache: size on disk over float32
raw, restore time and throughput of dequantized output, TTFT with the cache, and agreement over the
questions (engine/fidelity.py). The lossless cache's own greedy answers are the reference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..documents import Document
from ..engine import answer, fidelity, prefilling as pf
from ..engine.cache import restore
from ..engine.model.models import LoadedModel
from ..format import store

RESTORE_REPEATS = 3  # restores timed per cache, here and in measure.py (the median is reported)
TTFT_QUESTIONS = 5  # TTFT (with and without the cache) is timed on the first questions; agreement uses all


def timed(fn: Callable[[], Any], repeats: int = RESTORE_REPEATS) -> tuple[list[float], Any]:
    """(seconds of each of `repeats` calls of fn(), what the last one returned); a result is let go before the next call."""
    times, last = [], None
    for _ in range(repeats):
        last = None
        t0 = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - t0)
    return times, last


def restore_cache(lm: LoadedModel, path: Path) -> Any:
    """Read, verify, decompress (dequantize) and build the cache object."""
    with store.open_cache(path) as opened:
        return restore.load_cache(opened, device=lm.device, dtype=lm.dtype)


def _restore_s(lm: LoadedModel, path: Path) -> float:
    """Median seconds of restore_cache."""
    return statistics.median(timed(lambda: restore_cache(lm, path))[0])


def _ttft_s(lm: LoadedModel, path: Path, qs: Sequence[str]) -> float:
    """Median time to the first answer token with a fresh session per question (restore included)."""
    times = []
    for q in qs[:TTFT_QUESTIONS]:
        a = answer.Session(lm, path).ask(q, answer.GenerationOptions(max_new_tokens=1))
        times.append(a.ttft_s)
    return statistics.median(times)


def measure(lm: LoadedModel, doc: Document, lossless: Path, qs: Sequence[str], kv_bits: Sequence[int], *,
            chunk_size: int, level: int, answer_tokens: int, note: Callable[[str], None], **scheme: int) -> dict[str, Any]:
    """{"lossless": {...}, "8-bit": {...}, ...}: sizes, restore, TTFT and agreement for every format.

    `scheme` (group_size, exact_tokens, recent_tokens) overrides prefill's defaults, to measure alternatives."""
    opts = answer.GenerationOptions(max_new_tokens=answer_tokens)
    note(f"  reference: lossless answers to {len(qs)} question(s), {answer_tokens} tokens at most")
    ref = answer.Session(lm, lossless)
    cached = len(ref.token_ids)
    ref_answers = [ref.ask(q, opts) for q in qs]
    tails = [a.prompt_token_ids[cached:] for a in ref_answers]
    ref_ids = [a.answer_token_ids for a in ref_answers]
    m = ref.manifest
    base = {"bytes_raw": m.bytes_raw, "bytes_on_disk": m.bytes_stored, "disk_over_raw": m.bytes_stored / m.bytes_raw}
    note("  lossless: restore, TTFT, teacher-forced self-agreement (the noise floor)")
    rows: dict[str, Any] = {"lossless": _row(lm, lossless, qs, base, fidelity.compare(lm, ref.states, ref.states, tails, ref_ids))}
    for bits in kv_bits:
        name = f"{bits}-bit"
        path = lossless.with_name(f"{lossless.stem}-q{bits}.kv")
        note(f"  {name}: prefill, restore x{RESTORE_REPEATS}, TTFT, {len(qs)} answers and teacher-forced agreement")
        res = pf.prefill(lm, doc, path, chunk_size=chunk_size, level=level, force=True, kv_bits=bits, **scheme)
        qm = res.manifest
        info = {"bytes_raw": qm.bytes_raw, "bytes_on_disk": qm.bytes_stored, "disk_over_raw": qm.bytes_stored / qm.bytes_raw,
                "prefill_write_s": res.write_s, "quant": qm.quant}
        cand = answer.Session(lm, path)
        cand_ids = [cand.ask(q, opts).answer_token_ids for q in qs]
        rows[name] = _row(lm, path, qs, info, fidelity.compare(lm, ref.states, cand.states, tails, ref_ids, cand_ids))
        del cand
    return rows


def _row(lm: LoadedModel, path: Path, qs: Sequence[str], info: dict[str, Any], agreement: fidelity.Agreement) -> dict[str, Any]:
    restore_s = _restore_s(lm, path)
    return {**info, "restore_s": restore_s, "restore_gb_per_s": info["bytes_raw"] / restore_s / 1e9,
            "ttft_cached_s": _ttft_s(lm, path, qs), "agreement": agreement.to_json()}
