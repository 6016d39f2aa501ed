"""The agreement run of docs/quantization.md ("Smaller caches") without bench's lossless baselines (not part of the test run).

`kvcli bench --kv-bits 8 --kv-bits 4` also measures plain prefills, naive torch.save and recompute TTFTs;
this script runs only the part that compares formats (kvcli.bench.formats.measure, the same function), so
it fits a busy machine: python tests/bench/bench_formats_run.py [--tokens 4096] [--questions 16] [--answer-tokens 64]
[--bits 8,4] [--group N] [--exact N] [--recent N] (the last three override prefill's defaults for every format)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from kvcli import bench, documents
from kvcli.bench import formats as bench_formats
from kvcli.engine.prompt import framing as fr
from kvcli.engine.model import models
from kvcli.engine import prefilling as pf

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--exact", type=int, default=None)
    ap.add_argument("--recent", type=int, default=None, help="last tokens kept exact (default: prefill's, per bit width)")
    args = ap.parse_args()
    scheme = {k: v for k, v in (("group_size", args.group), ("exact_tokens", args.exact), ("recent_tokens", args.recent))
              if v is not None}
    qs = []
    for name in ("questions.txt", "questions-more.txt"):
        qs += [line.strip() for line in (SAMPLES / name).read_text().splitlines() if line.strip() and not line.startswith("#")]
    qs = qs[: args.questions]
    lm = models.load()
    frame = fr.choose(lm.tokenizer, "auto", None)
    doc = bench.document_of(lm, frame, documents.read(SAMPLES / "document.txt"), args.tokens)
    with tempfile.TemporaryDirectory(prefix="kvcli-formats-") as tmp:
        path = Path(tmp) / "doc.kv"
        res = pf.prefill(lm, doc, path)
        rows = bench_formats.measure(lm, doc, path, qs, [int(b) for b in args.bits.split(",")], chunk_size=pf.DEFAULT_CHUNK,
                                     level=pf.DEFAULT_LEVEL, answer_tokens=args.answer_tokens,
                                     note=lambda m: print(m, flush=True, file=__import__("sys").stderr), **scheme)
    print(json.dumps({"tokens": res.manifest.num_tokens, "questions": qs, "answer_tokens": args.answer_tokens, "formats": rows}, indent=1))


if __name__ == "__main__":
    main()
