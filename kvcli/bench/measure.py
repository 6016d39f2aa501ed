"""One kvcli bench run: every document length measured in one process, in one run.

For each document length it times, on the same framed token ids:
- a plain transformers prefill (one forward over the whole document, and chunk by chunk),
- kvcli's prefill (compute plus compress and write),
- a restore (read, verify, decompress, build the cache object) and the naive alternative
  (torch.save of the per-layer tensors, torch.load back),
- time to first answer token for questions with the cache (a fresh Session per question, so the
  restore is included) and without it (generate() recomputing the full prompt),
- decode speed from the restored cache: one question alone, and 8 batched (decode.py),
- the RSS high-water mark of the process during the length (reset at its start where Linux allows),
and reports sizes (raw tensor bytes, on disk, naive) and the ratios between all of these. Each question is
also answered in full (answer_tokens) with the cache and checked against a full recompute (engine/check.py):
answers identical, first divergent positions, largest logit difference, near-tie margins.

With kv_bits (8, 4) it also writes each length's cache quantized and reports, per format, size on
disk, restore time and throughput of dequantized output, TTFT, and agreement with the lossless cache
over the questions (formats.py, engine/fidelity.py: teacher-forced top-1, mean KL, whole answers identical).

Timings on a shared machine are noisy: compare the ratios measured within one run.
"""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import __version__
from ..documents import Document
from ..engine import prefilling as pf
from ..engine.model.models import LoadedModel
from ..engine.prompt import framing as fr
from ..errors import UsageError
from ..format import manifest as mf
from . import decode, formats
from .decode import BATCH_QUESTIONS, DECODE_TOKENS
from .formats import RESTORE_REPEATS, TTFT_QUESTIONS

TO_THE_LIMIT = "max"  # --tokens max: 1k, doubling, up to the model's limit
DEFAULT_SIZES = (1024, 2048, 4096, 8192)
ANSWER_TOKENS = 32  # tokens per answer compared with recompute
AGREEMENT_TOKENS = 64  # new tokens per reference answer when measuring a quantized format's agreement
QUESTIONS = (
    "What is this document about, in one sentence?",
    "Who or what does the document name first?",
    "What does the document require, if anything?",
    "Does the document give any warranty or guarantee?",
    "What happens at the end of the document?",
)
Progress = Callable[[str], None]


def _doubling(top: int) -> list[int]:
    """1,024 tokens, doubling while below top, then top itself."""
    sizes = [DEFAULT_SIZES[0]]
    while sizes[-1] < top:
        sizes.append(sizes[-1] * 2)
    return sizes[:-1] + [top]


def default_sizes(lm: LoadedModel) -> list[int]:
    """1k, 2k, 4k, 8k tokens, capped by the model's limit (minus room for a question and answer)."""
    limit = lm.max_positions
    return _doubling(min(limit - pf.ANSWER_ROOM, DEFAULT_SIZES[-1]) if limit else DEFAULT_SIZES[-1])


def limit_sizes(lm: LoadedModel) -> list[int]:
    """--tokens max: 1k, 2k, 4k, ... doubling, and last the model's limit less room for a question and answer."""
    if not lm.max_positions:
        raise UsageError(f"--tokens {TO_THE_LIMIT}: the model sets no position limit; give the lengths (--tokens N)")
    return _doubling(lm.max_positions - pf.ANSWER_ROOM)


def run(
    lm: LoadedModel,
    document: Document,
    tokens: list[int] | str | None = None,
    questions: int = 3,
    progress: Progress | None = None,
    *,
    chunk_size: int = pf.DEFAULT_CHUNK,
    transform: str = pf.DEFAULT_TRANSFORM,
    level: int = pf.DEFAULT_LEVEL,
    workdir: str | os.PathLike | None = None,
    kv_bits: list[int] | tuple[int, ...] = (),
    question_list: list[str] | None = None,
    agreement_tokens: int = AGREEMENT_TOKENS,
    answer_tokens: int = ANSWER_TOKENS,
    decode_tokens: int = DECODE_TOKENS,
) -> dict[str, Any]:
    """Measure every length in `tokens` (default: default_sizes; "max": limit_sizes), smallest first; a
    JSON-able dict of seconds, bytes and ratios.

    `questions` of `question_list` (default: generic ones) are used, cycled; with kv_bits each quantized
    format is compared with the lossless cache (answers of up to `agreement_tokens` tokens); decode speeds are
    timed over answers of up to `decode_tokens` tokens."""
    import torch

    note = progress or (lambda _msg: None)
    sizes = limit_sizes(lm) if tokens == TO_THE_LIMIT else sorted(set(tokens)) if tokens else default_sizes(lm)
    for n in sizes:
        if n < 16:
            raise UsageError(f"--tokens {n}: too short to measure (16 tokens at least)")
        if (exc := pf.too_long(f"--tokens {n}", n, lm.max_positions)) is not None:
            raise UsageError(str(exc))
    if questions < 1:
        raise UsageError("--questions must be at least 1")
    for bits in kv_bits:
        mf.check_kv_bits(bits)
    if answer_tokens < 1 or agreement_tokens < 1 or decode_tokens < 2:
        raise UsageError("--answer-tokens and --agreement-tokens must be at least 1, --decode-tokens at least 2")
    pool = list(question_list or QUESTIONS)
    qs = [pool[i % len(pool)] for i in range(questions)]
    batch = [pool[i % len(pool)] for i in range(BATCH_QUESTIONS)]
    frame = fr.choose(lm.tokenizer, "auto", None)
    result: dict[str, Any] = {
        "kvcli_version": __version__,
        "model": lm.source.get("name") or lm.fingerprint.get("name"),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "weights": lm.weights,  # q4: engine/model/stored.py
        "device": str(lm.device),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "chunk_size": chunk_size,
        "transform": transform,
        "level": level,
        "document": document.record(),
        "questions": qs,
        "kv_bits": list(kv_bits),
        "agreement_tokens": agreement_tokens,
        "answer_tokens": answer_tokens,
        "decode_tokens": decode_tokens,
        "sizes": [],
    }
    _warm_up(lm)
    with tempfile.TemporaryDirectory(prefix="kvcli-bench-", dir=workdir) as tmp:
        for n in sizes:
            doc = document_of(lm, frame, document, n)
            note(f"bench: {n:,} tokens")
            path = Path(tmp) / f"doc-{n}.kv"
            own_peak = reset_peak_rss()
            row = _measure(lm, doc, frame, path, qs[:TTFT_QUESTIONS], chunk_size, transform, level, note, answer_tokens)
            note(f"  decode: {decode_tokens} answer tokens from the cache, one question, then {len(batch)} batched")
            row.update(decode.one(lm, path, qs[0], decode_tokens), **decode.batched(lm, path, batch, decode_tokens))
            if kv_bits:
                row["formats"] = formats.measure(lm, doc, path, qs, kv_bits, chunk_size=chunk_size, level=level,
                                                 answer_tokens=agreement_tokens, note=note)
            # the high-water mark since this length began, or (where it cannot be reset) the process's so far
            row.update(tokens_asked=n, peak_rss_bytes=peak_rss(), peak_rss_scope="length" if own_peak else "process",
                       load_average_end=_loadavg())
            result["sizes"].append(row)
    return result


# ---------------------------------------------------------------- one length


def _measure(lm, doc, frame, path, qs, chunk_size, transform, level, note, answer_tokens) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache

    model = lm.model
    ids = pf.document_token_ids(lm, doc, frame)
    row: dict[str, Any] = {"tokens": len(ids), "load_average_start": _loadavg()}
    x = torch.tensor([ids], device=lm.device)

    def prefill_s(size: int) -> float:
        """Seconds of transformers' own prefill of the document in chunks of `size`, into a fresh cache."""
        t0 = time.perf_counter()
        cache = DynamicCache(config=model.config)
        for start in range(0, len(ids), size):
            model(input_ids=x[:, start : start + size], cache=cache, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    with torch.inference_mode(), _plain_attention(model):
        note("  plain transformers prefill, one forward")
        row["plain_prefill_s"] = prefill_s(len(ids))
        note(f"  plain transformers prefill, chunks of {chunk_size}")
        row["plain_chunked_prefill_s"] = prefill_s(chunk_size)

    note("  kvcli prefill (compute, compress, write)")
    res = pf.prefill(lm, doc, path, chunk_size=chunk_size, transform=transform, level=level, force=True)
    m = res.manifest
    row.update(kvcli_prefill_compute_s=res.compute_s, kvcli_prefill_write_s=res.write_s,
               kvcli_prefill_s=res.compute_s + res.write_s)
    shards = sum(layer.stored_bytes for layer in m.layers)
    row.update(bytes_raw=m.bytes_raw, bytes_shards=shards, bytes_on_disk=sum(f.stat().st_size for f in path.iterdir()))

    note(f"  restore x{RESTORE_REPEATS} (read, verify, decompress into the cache object)")
    times, cache = formats.timed(lambda: formats.restore_cache(lm, path))
    row["restore_s"] = statistics.median(times)
    row["restore_all_s"] = times
    row["restore_stages"] = cache.restore_stats.rates()  # the last restore's read, hash, decompress (and copy) rates

    note("  naive: torch.save of the layer tensors, torch.load back")
    naive = path.with_suffix(".pt")
    tensors = [(s.keys.contiguous(), s.values.contiguous()) for s in cache.states()]  # views would save their whole buffer
    del cache
    t0 = time.perf_counter()
    torch.save(tensors, naive)
    with open(naive, "rb") as f:
        os.fsync(f.fileno())
    row["naive_save_s"] = time.perf_counter() - t0
    row["naive_bytes"] = naive.stat().st_size
    del tensors
    # The naive baseline people use: its own file, just written above; never a cache (weights_only: no code).
    row["naive_restore_s"] = statistics.median(formats.timed(lambda: torch.load(naive, map_location=lm.device, weights_only=True))[0])
    naive.unlink()

    note(f"  time to first token for {len(qs)} question(s), with the cache (restore included) and recomputed")
    cached, recomputed, same = [], [], []
    from ..engine import answer

    for q in qs:
        session = answer.Session(lm, path)
        a = session.ask(q, answer.GenerationOptions(max_new_tokens=1))
        cached.append(a.ttft_s)
        prompt = torch.tensor([a.prompt_token_ids], device=lm.device)
        kwargs = {}
        if model.generation_config.pad_token_id is None and lm.tokenizer.pad_token_id is None:
            kwargs["pad_token_id"] = lm.tokenizer.eos_token_id
        del session
        with torch.inference_mode(), _plain_attention(model):
            t0 = time.perf_counter()
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False, **kwargs)
            recomputed.append(time.perf_counter() - t0)
        same.append(out[0, prompt.shape[1] :].tolist() == a.answer_token_ids)
    row.update(ttft_cached_s=statistics.median(cached), ttft_recompute_s=statistics.median(recomputed),
               ttft_cached_all_s=cached, ttft_recompute_all_s=recomputed, first_tokens_match=all(same))

    note(f"  whole answers ({answer_tokens} tokens) checked against a full recompute")
    from ..engine import check

    session = answer.Session(lm, path)
    opts = answer.GenerationOptions(max_new_tokens=answer_tokens)
    row["check"] = check.summarize(session.ask(q, opts, check=True).check for q in qs)
    del session
    row["ratios"] = _ratios(row)
    return row


def _ratios(r: dict[str, Any]) -> dict[str, float]:
    def div(a, b):
        return a / b if b else float("nan")

    return {
        "ttft_recompute_over_cached": div(r["ttft_recompute_s"], r["ttft_cached_s"]),
        "raw_over_disk": div(r["bytes_raw"], r["bytes_on_disk"]),
        "disk_over_raw": div(r["bytes_on_disk"], r["bytes_raw"]),
        "naive_over_kvcli_bytes": div(r["naive_bytes"], r["bytes_on_disk"]),
        "naive_over_kvcli_restore_s": div(r["naive_restore_s"], r["restore_s"]),
        "restore_gb_per_s": div(r["bytes_raw"], r["restore_s"]) / 1e9,
        "kvcli_prefill_over_plain": div(r["kvcli_prefill_s"], r["plain_prefill_s"]),
        "plain_chunked_over_plain": div(r["plain_chunked_prefill_s"], r["plain_prefill_s"]),
    }


# ---------------------------------------------------------------- helpers


@contextmanager
def _plain_attention(model):
    """Baselines run transformers' own attention (sdpa or eager), not the kvcli function selected for the model."""
    from ..engine.model.attention import kernel_name

    was = model.config._attn_implementation
    if was.startswith("kvcli"):
        model.set_attn_implementation(kernel_name(was))
    try:
        yield
    finally:
        if model.config._attn_implementation != was:
            model.set_attn_implementation(was)


def _warm_up(lm: LoadedModel) -> None:
    """One tiny forward and generate, so no measurement pays for first-call initialisation."""
    import torch

    ids = torch.tensor([[lm.tokenizer.eos_token_id or 0] * 4], device=lm.device)
    with torch.inference_mode():
        lm.model(input_ids=ids, use_cache=True, logits_to_keep=1)


def document_of(lm: LoadedModel, frame: fr.Framing, document: Document, n: int) -> Document:
    """The document repeated and then cut so that its framed ids are as close to n as possible (not over)."""
    text = document.text.strip()
    while len(fr.document_ids(lm.tokenizer, frame, text)) < n:
        text = text + "\n\n" + document.text.strip()
    lo, hi = 1, len(text)  # largest prefix whose framed ids fit in n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(fr.document_ids(lm.tokenizer, frame, text[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    cut = text[:lo]
    name = f"{Path(document.name).stem}-{n}"
    return Document(name=name, text=cut, sha256=hashlib.sha256(cut.encode()).hexdigest())


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def reset_peak_rss() -> bool:
    """Start a new RSS high-water mark (Linux: 5 into /proc/self/clear_refs); False where that is not possible,
    and then peak_rss() is the process's peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The RSS high-water mark in bytes: /proc/self/status VmHWM where there is one, else getrusage's ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
