"""Benchmark (not part of the test run): `kvcli ask` through a warm `kvcli serve` against in-process.

    python tests/bench/bench_server.py [--repeat 3] [--doc samples/document.txt] [--model M] [--json]

Default model and the sample document unless told otherwise. Prints, as medians over --repeat runs
measured in one session (ratios are what to trust on a shared machine):
  first byte    process start -> first answer byte on stdout, server holding the cache vs --no-server
  whole         wall time of a one-question process (16 new tokens), served vs --no-server
  new cache     the same for a cache the server does not hold yet (a fresh copy each run)
  loop          10 single-question processes through the server vs one cold `ask -f` with the 10 questions
  client start  `kvcli ps --json` against the server: interpreter, imports, parsing, connect, one round
                trip (an upper bound on the client's own start)
  together      8 single-question `kvcli ask` processes started at once through the server (their questions
                decode in one batch) vs the same 8 one after another (issue 17), 32 new tokens each
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
QUESTIONS = [line for line in (ROOT / "samples" / "questions.txt").read_text().splitlines() if line.strip() and not line.startswith("#")]
NEW_TOKENS = "16"
EXTRA = ["Who may grant a patent license?", "What is a Contribution?", "What is the Work?", "Can I sell the Work?",
         "What is a Derivative Work?", "Who is a Contributor?"]


def cmd(*args) -> list[str]:
    return [sys.executable, "-m", "kvcli", *map(str, args)]


def timed(args: list[str], env: dict) -> tuple[float, float]:
    """(seconds to the first stdout byte, seconds to exit) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = proc.stdout.read(1)
    t1 = time.perf_counter()
    proc.stdout.read()
    code = proc.wait()
    t2 = time.perf_counter()
    if code != 0 or not first:
        raise SystemExit(f"{' '.join(map(str, args))}: exit {code}")
    return t1 - t0, t2 - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", "-r", type=int, default=3)
    parser.add_argument("--doc", default=str(ROOT / "samples" / "document.txt"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from kvcli.serve import client

    model = ["--model", args.model] if args.model else []
    tmp = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    sock = tmp / "s.sock"
    env = dict(os.environ, KVCLI_SOCKET=str(sock))
    server = None
    try:
        cache = tmp / "doc.kv"
        subprocess.run(cmd("prefill", args.doc, "-o", cache, "--no-server", "--quiet", *model), check=True, env=env)
        server = subprocess.Popen(cmd("serve", "--socket", sock, "--quiet"), env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not client.ping(sock, timeout=1.0):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        q = QUESTIONS[0]
        ask = ["ask", "--max-new-tokens", NEW_TOKENS, "--quiet", *model]
        timed(cmd(*ask, "-c", cache, q, "--server"), env)  # the server loads the model and holds the cache
        rows: dict[str, list[float]] = {k: [] for k in ("first_local", "first_served", "whole_local", "whole_served",
                                                          "new_local", "new_served", "loop_served", "one_process", "client_start",
                                                          "apart_served", "together_served")}
        for n in range(args.repeat):
            first, whole = timed(cmd(*ask, "-c", cache, q, "--no-server"), env)
            rows["first_local"].append(first), rows["whole_local"].append(whole)
            first, whole = timed(cmd(*ask, "-c", cache, q, "--server"), env)
            rows["first_served"].append(first), rows["whole_served"].append(whole)
            fresh = tmp / f"fresh-{n}.kv"
            shutil.copytree(cache, fresh)
            rows["new_local"].append(timed(cmd(*ask, "-c", fresh, q, "--no-server"), env)[1])
            fresh2 = tmp / f"fresh2-{n}.kv"
            shutil.copytree(cache, fresh2)
            rows["new_served"].append(timed(cmd(*ask, "-c", fresh2, q, "--server"), env)[1])
            ten = [QUESTIONS[i % len(QUESTIONS)] for i in range(10)]
            qfile = tmp / "ten.txt"
            qfile.write_text("\n".join(ten) + "\n")
            rows["one_process"].append(timed(cmd(*ask, "-c", cache, "-f", qfile, "--no-server"), env)[1])
            t0 = time.perf_counter()
            for question in ten:
                timed(cmd(*ask, "-c", cache, question, "--server"), env)
            rows["loop_served"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            subprocess.run(cmd("ps", "--json"), check=True, env=env, stdout=subprocess.DEVNULL)
            rows["client_start"].append(time.perf_counter() - t0)
            eight = [(QUESTIONS + EXTRA)[i % (len(QUESTIONS) + len(EXTRA))] for i in range(8)]
            many = ["ask", "--max-new-tokens", "32", "--quiet", *model, "-c", cache, "--server"]
            t0 = time.perf_counter()
            for question in eight:
                timed(cmd(*many, question), env)
            rows["apart_served"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            procs = [subprocess.Popen(cmd(*many, question), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
                     for question in eight]
            if any(p.wait() != 0 for p in procs):
                raise SystemExit("a concurrent ask failed")
            rows["together_served"].append(time.perf_counter() - t0)
            print(f"run {n + 1}: " + json.dumps({k: round(v[-1], 3) for k, v in rows.items()}), file=sys.stderr, flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        result = {
            "repeat": args.repeat,
            "seconds": {k: round(v, 3) for k, v in med.items()},
            "first_byte_speedup": round(med["first_local"] / med["first_served"], 2),
            "whole_process_speedup": round(med["whole_local"] / med["whole_served"], 2),
            "new_cache_speedup": round(med["new_local"] / med["new_served"], 2),
            "loop_over_one_process": round(med["loop_served"] / med["one_process"], 2),
            "client_start_s": round(med["client_start"], 3),
            "together_speedup": round(med["apart_served"] / med["together_served"], 2),
            "targets": {"first_byte_speedup": ">= 15", "whole_process_speedup": ">= 4", "new_cache_speedup": ">= 3",
                        "loop_over_one_process": "<= 1.3", "client_start_s": "<= 0.25"},
        }
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            s = result["seconds"]
            print(f"first answer byte: {s['first_local']:.2f} s in-process, {s['first_served']:.3f} s served: "
                  f"{result['first_byte_speedup']}x (target >= 15x)")
            print(f"one-question process: {s['whole_local']:.2f} s vs {s['whole_served']:.2f} s: {result['whole_process_speedup']}x (target >= 4x)")
            print(f"cache not held yet: {s['new_local']:.2f} s vs {s['new_served']:.2f} s: {result['new_cache_speedup']}x (target >= 3x)")
            print(f"10 served processes {s['loop_served']:.2f} s vs one cold ask -f {s['one_process']:.2f} s: "
                  f"{result['loop_over_one_process']}x (target <= 1.3x)")
            print(f"client start (ps --json round trip): {s['client_start']:.3f} s (target <= 0.25 s)")
            print(f"8 served questions at once {s['together_served']:.2f} s vs one after another {s['apart_served']:.2f} s: "
                  f"{result['together_speedup']}x")
    finally:
        if server is not None:
            subprocess.run(cmd("serve", "--stop", "--quiet"), env=env)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
