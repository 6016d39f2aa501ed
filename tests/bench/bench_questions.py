"""Benchmark (not part of the test run): N questions in one `kvcli ask` against N separate processes.

    python tests/bench/bench_questions.py [--questions 5] [--doc samples/document.txt] [--model M]

Prints both wall times and their ratio. Uses the default model unless --model is given.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [line for line in (ROOT / "samples" / "questions.txt").read_text().splitlines() if line and not line.startswith("#")]


def kvcli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kvcli", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", "-n", type=int, default=5)
    parser.add_argument("--doc", default=str(ROOT / "samples" / "document.txt"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", default="32")
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.questions)]
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "doc.kv")
        kvcli("prefill", args.doc, "-o", cache, *model)
        common = ["ask", "--cache", cache, "--max-new-tokens", args.max_new_tokens, "--quiet", *model]
        t0 = time.perf_counter()
        kvcli(*common, *questions)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        for q in questions:
            kvcli(*common, q)
        many = time.perf_counter() - t0
    print(f"{args.questions} questions in one ask:      {one:7.2f} s")
    print(f"{args.questions} questions in {args.questions} ask processes: {many:7.2f} s")
    print(f"ratio (separate / one): {many / one:.2f}x")


if __name__ == "__main__":
    main()
