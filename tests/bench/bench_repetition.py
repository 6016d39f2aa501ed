"""Measure anti-repetition settings on the default model and the sample (not collected by pytest).

    python tests/bench/bench_repetition.py [--max-new-tokens 256] [--setting 1.0:0 --setting 1.0:10 ...]

For each setting (repetition_penalty:no_repeat_ngram_size) it asks samples/questions.txt about
samples/document.txt and prints, per question, the answer length in tokens, how it ended, the share of
repeated 4-grams in the answer (a loop scores high), seconds and the answer (one JSON line each).
It also times kvcli.load() of the default model (already converted) in a fresh process, three times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def repeated_share(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def time_load(runs: int = 3) -> list[float]:
    code = "import time, kvcli; t = time.perf_counter(); kvcli.load(); print(time.perf_counter() - t)"
    return [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])
            for _ in range(runs)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--setting", action="append", default=[])
    p.add_argument("--no-load-timing", action="store_true")
    args = p.parse_args()
    import kvcli

    settings = [tuple(s.split(":")) for s in args.setting] or [("1.0", "0"), ("1.1", "0"), ("1.2", "0"), ("1.3", "0"), ("1.0", "4"), ("1.2", "4")]
    questions = [q.strip() for q in (SAMPLES / "questions.txt").read_text().splitlines() if q.strip() and not q.startswith("#")]
    if not args.no_load_timing:
        print("kvcli.load() of the converted default model, fresh process each:", [round(t, 2) for t in time_load()], flush=True)
    lm = kvcli.load()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "doc.kv"
        kvcli.prefill(lm, kvcli.read_document(SAMPLES / "document.txt"), cache)
        session = kvcli.Session(lm, cache)
        results = {}
        for rp, ng in settings:
            opts = kvcli.GenerationOptions(max_new_tokens=args.max_new_tokens, repetition_penalty=float(rp), no_repeat_ngram_size=int(ng))
            rows = []
            for q in questions:
                t = time.perf_counter()
                a = session.ask(q, opts)
                rows.append({"question": q, "tokens": len(a.answer_token_ids), "finish": a.finish_reason,
                             "repeated_4grams": round(repeated_share(a.answer_token_ids), 3), "s": round(time.perf_counter() - t, 1),
                             "answer": a.answer})
                print(f"[{rp}:{ng}] {json.dumps(rows[-1], ensure_ascii=False)}", flush=True)
            results[f"{rp}:{ng}"] = rows
            print(f"\n== repetition_penalty {rp}, no_repeat_ngram_size {ng}: "
                  f"{sum(r['tokens'] for r in rows)} tokens, {sum(r['finish'] == 'length' for r in rows)} hit the limit, "
                  f"{sum(r['s'] for r in rows):.1f} s", flush=True)
            for r in rows:
                print(f"  {r['tokens']:4d} tok {r['finish']:6s} rep4 {r['repeated_4grams']:.2f} {r['s']:5.1f} s  {r['question']}", flush=True)
        print("\n" + json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
