"""Benchmark (not collected by pytest): N questions one by one vs Session.ask_many, same process and run.

    python tests/bench/bench_batch.py --questions 8 --tokens 32 [--batch-size 8] [--doc samples/document.txt]

Prints wall times, the speedup, how many answers are identical, how many batched answers `--check`
finds identical to a full recompute (and the largest logit difference), and the memory the batch adds
(its per-question suffix buffers; the document's keys/values are shared, never copied).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import kvcli

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
EXTRA = ["Who may grant a patent license?", "What is a Contribution?", "What is the Work?", "Can I sell the Work?",
         "What is a Derivative Work?", "Who is a Contributor?", "What happens if I sue a contributor?",
         "Must I state changes I made?", "What is Source form?", "What is Object form?", "Can the license be revoked?",
         "What does NOTICE contain?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=0, help="default: all questions at once")
    ap.add_argument("--doc", default=str(SAMPLES / "document.txt"))
    ap.add_argument("--cache", default="/tmp/kvcli-bench-batch.kv")
    args = ap.parse_args()
    lm = kvcli.load()
    kvcli.prefill(lm, kvcli.read_document(args.doc), args.cache, force=True)
    base = [q.strip() for q in (SAMPLES / "questions.txt").read_text().splitlines() if q.strip() and not q.startswith("#")]
    qs = ((base + EXTRA) * 4)[: args.questions]
    opts = kvcli.GenerationOptions(max_new_tokens=args.tokens)
    session = kvcli.Session(lm, args.cache)
    session.ask("warm up", kvcli.GenerationOptions(max_new_tokens=2))
    t = time.perf_counter()
    single = [session.ask(q, opts) for q in qs]
    t_single = time.perf_counter() - t
    t = time.perf_counter()
    many = session.ask_many(qs, opts, batch_size=args.batch_size or len(qs))
    t_many = time.perf_counter() - t
    same = sum(a.answer_token_ids == b.answer_token_ids for a, b in zip(single, many))
    # not timed: every batched answer's own logits against one uncached forward (--check), as issue 17 asks
    checked = [a.check for a in session.ask_many(qs, opts, batch_size=args.batch_size or len(qs), check=True)]
    print(json.dumps({"questions": len(qs), "new_tokens": args.tokens, "batch_size": args.batch_size or len(qs),
                      "document_tokens": len(session.token_ids), "one_by_one_s": round(t_single, 2),
                      "ask_many_s": round(t_many, 2), "speedup": round(t_single / t_many, 2), "identical": same,
                      "check_identical": sum(c.identical for c in checked),
                      "check_max_logit_diff": max(c.max_logit_diff for c in checked),
                      "batch_buffers_mb": round(_buffers(session, qs, args) / 1e6, 1),
                      "document_cache_mb": round(sum(s.keys.nbytes + s.values.nbytes for s in session.states) / 1e6, 1)}))


def _buffers(session, qs, args) -> int:
    """Bytes of the suffix rows ask_many allocates: rows x layers x (keys + values) x (longest question + answer)."""
    rows = min(args.batch_size or len(qs), len(qs))
    longest = max(len(session.prompt_ids(q)) - len(session.token_ids) for q in qs) + args.tokens
    return sum(rows * (s.keys.shape[1] * s.keys.shape[3] + s.values.shape[1] * s.values.shape[3]) * longest * s.keys.element_size()
               for s in session.states)


if __name__ == "__main__":
    main()
