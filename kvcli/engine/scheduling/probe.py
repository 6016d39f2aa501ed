"""Whether a loaded model decodes exactly through batch.BatchDecoder: measured on the model itself, never by its name.

A modeling file can keep its rows from reaching kvcli's cascade attention in ways no list of names
foresees (StableLM's decoder layer dropped the keywords that once carried the shared cache; a model
that attends without transformers' attention interface never calls kvcli at all; ALiBi or other
biases live in a mask the cascade never reads). So once per loaded model, a short document's states
go through the BatchDecoder with rows of different question lengths (padded together, then decoding at
different slots, then a row joining into a freed slot) and with a single row, and every step's logits
are compared with one plain forward of the model over the same document, question and answer, without
a cache (the full recompute every answer must equal). A model that fails decodes its rows one at a
time, each with an ordinary cache and the model's own attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

DOCUMENT = 40  # document tokens: longer than the tiny test models' windows, short enough to cost little
# (question length, answer tokens) of the batched rows, two wide: padded join of the first two, the second leaves
# at once and the third joins its slot, then both decode at different slots. The single row repeats the first.
BATCHED = ((5, 2), (2, 1), (4, 2))
# largest logit difference allowed, relative to max(1, largest |logit|): float32 rounding of the cascade is ~1e-6;
# a row that misses the document, another row's tokens or a position differs by whole units
RTOL = {"float64": 1e-7, "float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}  # by the dtype the linears compute in
Q4_RULES = 2  # in a q4 model's remembered-verdict key: the rule its rows are held to (bfloat16's tolerance, the
# precision its products run in); a verdict remembered under another rule is not read


@dataclass(frozen=True)
class Batching:
    """The verdict: ok (rows may share one BatchDecoder), why, the largest logit difference measured, the probe's cost."""

    ok: bool
    reason: str
    max_diff: float
    ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "max_diff": self.max_diff, "ms": round(self.ms, 1)}


def _ids(vocab: int, n: int, salt: int) -> list[int]:
    """n ordinary token ids, the same on every run (no global random state touched)."""
    low = min(100, vocab // 2)
    return [low + (salt * 7919 + i * 104729) % (vocab - low) for i in range(n)]


def _reference(model: Any, doc: list[int], rows: list[Any]) -> list[Any]:
    """Logits [answer, vocab] of every row's answer steps from one plain forward, no cache: each row's whole
    prompt and answer, right-padded (a causal model never lets a real token see the pads after it)."""
    import torch

    seqs = [doc + r.appended + r.answer[:-1] for r in rows]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), doc[0], dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq, device=model.device)
        mask[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return [logits[i, len(seq) - len(r.answer) : len(seq)] for i, (seq, r) in enumerate(zip(seqs, rows))]


def _measure(model: Any) -> tuple[float, float]:
    """(largest logit difference, largest one relative to max(1, |logits|)) of the BatchDecoder, batched and single,
    against the plain forward."""
    import torch
    from transformers import DynamicCache

    from ..decoding import batch
    from ..decoding.protocol import Row
    from ..cache import layers

    vocab = int(model.get_input_embeddings().num_embeddings)
    doc = _ids(vocab, DOCUMENT, 0)
    with torch.inference_mode():
        doc_cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([doc], device=model.device), cache=doc_cache, use_cache=True)
    states = layers.read(doc_cache)

    def row(i: int, q: int, n: int) -> Any:
        appended = _ids(vocab, q, 1 + i)
        return Row(index=i, prompt=doc + appended, appended=appended, max_new=n, logits=[],
                   choose=lambda _ids, logits: int(torch.argmax(logits)), on_token=lambda _t: False)

    rows = [row(i, q, n) for i, (q, n) in enumerate(BATCHED)]
    batch.decode_rows(model, states, rows, batch_size=2, eos=set(), pad_id=doc[0])
    single = row(0, *BATCHED[0])
    batch.decode_rows(model, states, [single], batch_size=1, eos=set(), pad_id=doc[0])
    for r in rows + [single]:
        if len(r.answer) != r.max_new:
            raise RuntimeError(f"a row gave {len(r.answer)} of {r.max_new} tokens")
    worst = ratio = 0.0
    with torch.inference_mode():
        refs = _reference(model, doc, rows)
    for r, ref in zip(rows + [single], refs + refs[:1]):  # the single row's next token is its own: if it differs, so do its logits
        for got, want in zip(r.logits, ref):
            diff = float((got.float() - want).abs().max())
            if diff != diff:  # NaN
                return diff, diff
            worst, ratio = max(worst, diff), max(ratio, diff / max(1.0, float(want.abs().max())))
    return worst, ratio


def probe(model: Any) -> Batching:
    """Run the check on this model as it is now (attention implementation, dtype, device); never raises."""
    from ..model import attention

    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in attention.NAMES:
        return Batching(False, f"attention '{impl}' is not one of kvcli's functions, which run batched rows", 0.0)
    t0 = time.perf_counter()
    try:
        diff, ratio = _measure(model)
    except Exception as exc:  # a modeling file the BatchDecoder cannot drive: rows go one at a time
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Batching(False, f"batched decoding failed ({exc.__class__.__name__}: {why})", float("inf"),
                        (time.perf_counter() - t0) * 1000)
    ms = (time.perf_counter() - t0) * 1000
    from ..model import stored

    dtype = str(stored.linear_dtype(model)).removeprefix("torch.")  # q8, q4: linears in bfloat16, held to its tolerance
    tol = RTOL.get(dtype, 1e-4)
    if ratio <= tol:
        return Batching(True, f"batched and single rows equal the plain forward within {dtype} rounding (largest logit "
                              f"difference {diff:.1e})", diff, ms)
    return Batching(False, f"batched rows differ from the plain forward (largest logit difference {diff:.3g}, allowed "
                           f"{tol:.0e} x max(1, |logit|)): rows decode one at a time", diff, ms)


def verdict(model: Any) -> Batching:
    """The probe's verdict for this model, run once per attention implementation, dtype and device (kept on the model)."""
    key = (getattr(model.config, "_attn_implementation", None), str(model.dtype), str(model.device))
    memo = model.__dict__.setdefault("_kvcli_batching", {})
    if key not in memo:
        memo[key] = probe(model)
    return memo[key]


def batchable(model: Any) -> bool:
    """Whether the model's rows may share one batch.BatchDecoder: it attends through kvcli's functions and the
    probe measured its batched and single rows equal to its plain forward (once per model)."""
    from ..model import attention

    if getattr(model.config, "_attn_implementation", None) not in attention.NAMES:
        return False
    return verdict(model).ok


def remembered(lm: Any) -> Batching:
    """The verdict for a loaded model, kept on disk for models loaded from files (KVCLI_HOME/probes/, keyed by
    the weights' and config's fingerprints, attention, dtype, device, torch and kvcli versions), so a
    one-question process does not probe again what an earlier process measured."""
    import json

    from ..model import attention
    from ...home import kvcli_home, remember

    model = lm.model
    memo = model.__dict__.setdefault("_kvcli_batching", {})
    impl = getattr(model.config, "_attn_implementation", None)
    mkey = (impl, str(model.dtype), str(model.device))
    if mkey in memo or impl not in attention.NAMES or lm.source.get("kind") in (None, "object"):
        return verdict(model)
    path = kvcli_home() / "probes" / f"{disk_key(lm)}.json"
    try:
        saved = json.loads(path.read_text())
        memo[mkey] = Batching(bool(saved["ok"]), str(saved["reason"]), float(saved["max_diff"]), float(saved["ms"]))
        return memo[mkey]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = verdict(model)
    remember(path, json.dumps(found.to_json()))
    return found


def disk_key(lm: Any) -> str:
    """What a remembered verdict is kept under: weights, config, the arithmetic (attention, dtype, device, and the
    weights mode when not float: a q8 or q4 model batches differently), torch and kvcli versions."""
    import hashlib
    import json

    import torch

    from ... import __version__

    model = lm.model
    mkey = (getattr(model.config, "_attn_implementation", None), str(model.dtype), str(model.device))
    mode = lm.weights
    parts = [lm.fingerprint.get("weights_sha256"), lm.fingerprint.get("config_sha256"), *mkey, torch.__version__, __version__]
    return hashlib.sha256(json.dumps(parts + ([mode, Q4_RULES] if mode != "float" else [])).encode()).hexdigest()[:32]
