"""How long `kvcli ask` takes to notice its reader is gone (not part of the test run).

    python tests/bench/bench_pipes.py [--questions 200] [--max-s 200]

Prefills a cache with the default model, then runs `kvcli ask -f QUESTIONS` (JSON and plain) with stdout a
pipe whose reader has already left, as after `| head -1`: each run must end with 141 and print seconds. It
fails (exit 1) above --max-s, a bound that is a measurement, not a unit test's (tests/cli/test_output.py checks the exit code).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--max-s", type=float, default=200)
    parser.add_argument("--doc", default=str(ROOT / "samples" / "document.txt"))
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache, qfile = Path(tmp) / "doc.kv", Path(tmp) / "q.txt"
        qfile.write_text("\n".join(f"Question number {i}?" for i in range(args.questions)), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "kvcli", "prefill", args.doc, "-o", str(cache), "-q"], check=True, env=env)
        for name, extra in (("json", ["--json"]), ("plain", [])):
            read_end, write_end = os.pipe()
            os.close(read_end)
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "kvcli", "ask", "-c", str(cache), "-f", str(qfile), "--max-new-tokens", "64",
                                   *extra], stdout=write_end, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, timeout=900)
            os.close(write_end)
            report[name] = {"exit": proc.returncode, "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(report, indent=2))
    if any(r["exit"] != 141 or r["seconds"] > args.max_s for r in report.values()):
        sys.exit(f"a closed pipe did not end ask with 141 within {args.max_s} s")


if __name__ == "__main__":
    main()
