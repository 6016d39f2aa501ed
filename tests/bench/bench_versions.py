"""Benchmark (not part of the test run): this checkout against another kvcli checkout, side by side in one run.

    git worktree add /tmp/kvcli-0.2 35127f5            # kvcli 0.2 (the last commit before the one engine)
    python tests/bench/bench_versions.py --other /tmp/kvcli-0.2 [--other-python VENV/bin/python] [--rounds 2] [--json]

Both trees run in this interpreter's environment, or the other in --other-python's (PYTHONPATH points at each
tree in turn), in fresh processes, alternating rounds so that machine noise falls on both alike. Each process loads the
default model, opens the sample document's cache (prefilled once by each version) and measures:
  ttft        Session open (restore) plus the first answer token of one question, in-process
  decode      milliseconds per answer token of that question (64 tokens)
  batch8/16   wall time of 8 or 16 questions asked together (ask_many), 32 tokens each
  serial8     the same 8 questions asked one after another
Prints the medians per version and this checkout's ratio to the other's (below 1: faster here).
Both trees' kvcli sources are byte-compiled first, as an installed package is: where PYTHONDONTWRITEBYTECODE
is set, a tree with more modules would otherwise pay for compiling them in every process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [line for line in (ROOT / "samples" / "questions.txt").read_text().splitlines() if line.strip() and not line.startswith("#")]
EXTRA = ["Who may grant a patent license?", "What is a Contribution?", "What is the Work?", "Can I sell the Work?",
         "What is a Derivative Work?", "Who is a Contributor?", "What is a Source form?", "What is an Object form?",
         "What is the License?", "Who is You?", "What must a notice contain?", "When may I charge a fee?"]

PROBE = r'''
import json, sys, time
import kvcli
cache, questions = sys.argv[1], json.loads(sys.argv[2])
lm = kvcli.load()
t0 = time.perf_counter()
session = kvcli.Session(lm, cache)
one = session.ask(questions[0], kvcli.GenerationOptions(max_new_tokens=64, no_repeat_ngram_size=10))
ttft = time.perf_counter() - t0 - (one.total_s - one.ttft_s)
n = len(one.answer_token_ids)
decode = (one.total_s - one.ttft_s) / max(1, n - 1) * 1000
opts = kvcli.GenerationOptions(max_new_tokens=32, no_repeat_ngram_size=10)
out = {"ttft_s": ttft, "decode_ms": decode, "tokens": n}
for k in (8, 16):
    t = time.perf_counter()
    session.ask_many(questions[:k], opts, batch_size=k)
    out[f"batch{k}_s"] = time.perf_counter() - t
t = time.perf_counter()
for q in questions[:8]:
    session.ask(q, opts)
out["serial8_s"] = time.perf_counter() - t
print(json.dumps(out))
'''


def run(tree: Path, cache: Path, questions: list[str], env: dict, python: str = sys.executable) -> dict:
    proc = subprocess.run([python, "-c", PROBE, str(cache), json.dumps(questions)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(tree)}, cwd=tree, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, type=Path, help="the other kvcli checkout (e.g. 0.2)")
    parser.add_argument("--other-python", default=sys.executable, help="the other checkout's interpreter (its own venv)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    questions = (QUESTIONS + EXTRA)[:16]
    work = Path(tempfile.mkdtemp(prefix="kvcli-versions-"))
    env = {**os.environ, "KVCLI_SOCKET": str(work / "none.sock")}
    trees = {"other": args.other.resolve(), "here": ROOT}
    python = {"other": args.other_python, "here": sys.executable}
    for side, tree in trees.items():
        subprocess.run([python[side], "-m", "compileall", "-q", str(tree / "kvcli")], check=True)
    for side, tree in trees.items():  # each version reads the caches it writes (0.3 fingerprints every weight)
        subprocess.run([python[side], "-m", "kvcli", "prefill", str(ROOT / "samples" / "document.txt"), "-o",
                        str(work / f"{side}.kv"), "--no-server", "--quiet"], check=True, env={**env, "PYTHONPATH": str(tree)}, cwd=tree)
    got: dict[str, list[dict]] = {"here": [], "other": []}
    for _ in range(args.rounds):
        for side, tree in trees.items():
            got[side].append(run(tree, work / f"{side}.kv", questions, env, python[side]))
    keys = ["ttft_s", "decode_ms", "batch8_s", "batch16_s", "serial8_s"]
    med = {side: {k: statistics.median(r[k] for r in rows) for k in keys} for side, rows in got.items()}
    ratio = {k: med["here"][k] / med["other"][k] for k in keys}
    if args.json:
        print(json.dumps({"median": med, "ratio_here_to_other": ratio, "runs": got}))
        return
    print(f"{'':12} {'other':>10} {'here':>10} {'here/other':>11}")
    for k in keys:
        print(f"{k:12} {med['other'][k]:10.3f} {med['here'][k]:10.3f} {ratio[k]:11.2f}")
    for side in ("other", "here"):
        m = med[side]
        print(f"{side}: 8 batched {m['serial8_s'] / m['batch8_s']:.2f}x faster than one by one")


if __name__ == "__main__":
    main()
