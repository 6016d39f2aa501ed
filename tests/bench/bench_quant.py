"""Choose the quantization group size, exact (sink) and recent tokens by measurement (not part of the test run).

Runs the default model over the sample document (about 4k tokens, float32), answers the sample questions
from the lossless cache (the reference), then for each (bits, group size, exact tokens, recent tokens) quantizes
every layer through the real codec and reports on disk / raw, teacher-forced agreement and (with --whole)
the share of whole greedy answers identical (format/quant.py, engine/fidelity.py). One prefill serves every
scheme, so a sweep costs only the answers. Usage: python tests/bench/bench_quant.py [--tokens 4096] [--questions 8]
[--new 64] [--recent 0,32,64,128] [--whole]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvcli import bench, documents
from kvcli.engine import fidelity, prefilling as pf
from kvcli.engine.prompt import framing as fr
from kvcli.engine.cache import layers
from kvcli.engine.model import models
from kvcli.engine.cache.kvcache import KVCache
from kvcli.format import codec

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def questions(n: int) -> list[str]:
    lines = []
    for name in ("questions.txt", "questions-more.txt"):
        lines += [line.strip() for line in (SAMPLES / name).read_text().splitlines() if line.strip() and not line.startswith("#")]
    return lines[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--groups", default="32,64,128")
    ap.add_argument("--exact", default="0,4,32")
    ap.add_argument("--recent", default="0")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--whole", action="store_true", help="also generate each scheme's own greedy answers and compare them whole")
    ap.add_argument("--configs", default="", help="bits:group:exact:recent,... instead of the full grid")
    args = ap.parse_args()
    lm = models.load()
    frame = fr.choose(lm.tokenizer, "auto", None)
    doc = bench.document_of(lm, frame, documents.read(SAMPLES / "document.txt"), args.tokens)
    ids = pf.document_token_ids(lm, doc, frame)
    states = layers.read(pf.run_chunks(lm, ids, pf.DEFAULT_CHUNK))
    states = [layers.LayerState(s.kind, s.keys.clone(), s.values.clone(), s.seq_length, s.sliding_window) for s in states]
    raw = sum(s.keys.numel() * 4 * 2 for s in states)
    tails = [fr.question_ids(lm.tokenizer, frame, q) for q in questions(args.questions)]

    def greedy(sts) -> list[list[int]]:
        got = []
        for tail in tails:
            x = torch.tensor([ids + tail])
            with torch.inference_mode():
                out = lm.model.generate(input_ids=x, attention_mask=torch.ones_like(x), cache=KVCache.from_states(sts),
                                        max_new_tokens=args.new, do_sample=False)
            got.append(out[0, x.shape[1]:].tolist())
        return got

    answers = greedy(states)
    print(f"{len(ids)} tokens, {raw / 1e6:.1f} MB raw, {len(tails)} questions, {sum(map(len, answers))} answer tokens")
    grid = [(b, g, e, r) for b in map(int, args.bits.split(",")) for g in map(int, args.groups.split(","))
            for e in map(int, args.exact.split(",")) for r in map(int, args.recent.split(","))]
    if args.configs:
        grid = [tuple(map(int, c.split(":"))) for c in args.configs.split(",")]
    for bits, group, exact, recent in grid:
        spec = pf.quant_spec(states, bits, group_size=group, exact_tokens=exact, recent_tokens=recent)
        t0 = time.perf_counter()
        stored, cand = 0, []
        for s in states:
            enc = codec.encode_layer(s.keys, s.values, transform="none", level=pf.DEFAULT_LEVEL, quant=spec)
            stored += len(enc.data)
            k, v = codec.decode_layer(enc.data, name="x", transform="none", dtype=s.keys.dtype, key_shape=tuple(s.keys.shape),
                                      value_shape=tuple(s.values.shape), decoded_bytes=enc.decoded_bytes, quant=spec)
            cand.append(layers.LayerState(s.kind, k, v, s.seq_length, s.sliding_window))
        a = fidelity.compare(lm, states, cand, tails, answers, greedy(cand) if args.whole else None)
        row = {"bits": bits, "group": group, "exact": exact, "recent": recent, "disk_over_raw": round(stored / raw, 4),
               "top1": round(a.top1, 4), "top1_vs_lossless": round(a.top1_vs_lossless, 4), "kl_mean": a.kl_mean,
               "kl_max": a.kl_max, "identical": a.answers_identical, "s": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
