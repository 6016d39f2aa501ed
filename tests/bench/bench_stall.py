"""Benchmark (not part of the test run): does a prefill through the server stall an answer on the same model?

    python tests/bench/bench_stall.py [--tokens 6000] [--chunk 1024] [--answer-tokens 400] [--json]

Starts `kvcli serve`, restores the sample cache, starts one long streaming `kvcli ask` on it, and while that
answer streams, prefills a document of about --tokens tokens (the sample text repeated) through the same
server. Prints the prefill's time, the longest pause between two pieces of streamed text while it ran,
that pause as a fraction of the prefill and over the longest turn the prefill took (issue 21's target: a
pause never longer than one prefill chunk; while answers run, a chunk is cut to 256-token slices), timed
from the prefill's own progress events. Default model; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def cmd(*args) -> list[str]:
    return [sys.executable, "-m", "kvcli", *map(str, args)]


def prefill_turns(sock: Path, doc: Path, out: Path, chunk: int) -> tuple[list[tuple[float, int]], dict]:
    """Prefill `doc` through the server at `sock` (the request `kvcli prefill --server` sends); returns when each
    progress event came with its token count, and the result."""
    from kvcli.serve import client

    fields = {"docs": [[str(doc), str(out)]], "model": None, "revision": None, "system": None, "framing": "auto",
              "chunk_size": chunk, "dtype": None, "device": None, "encoding": "utf-8", "force": True,
              "trust_remote_code": False, "kv_bits": None}
    conn = client.open_request(sock, "prefill", fields)
    turns, result = [], {}
    with conn:
        for ev in conn.events():
            if ev.get("event") == "progress" and ev.get("done"):
                turns.append((time.perf_counter(), int(ev["done"])))
            elif ev.get("event") == "prefilled" and ev["record"]["status"] == "failed":
                raise SystemExit(f"prefill failed: {ev.get('message')}")
            elif ev.get("event") == "prefilled":
                result = ev["record"]
            elif ev.get("event") in ("error", "fail"):
                raise SystemExit(f"prefill failed: {ev.get('message')}")
    return turns, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--answer-tokens", type=int, default=400)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvcli-stall-"))
    env = {**os.environ, "KVCLI_SOCKET": str(work / "s.sock")}
    text = (ROOT / "samples" / "document.txt").read_text()
    words = max(1, int(args.tokens / 1.15))  # about 1.15 tokens per word of this text on the default model
    long_doc = work / "long.txt"
    long_doc.write_text(" ".join((text.split() * (words // len(text.split()) + 1))[:words]))
    shutil.copy(ROOT / "samples" / "document.txt", work / "doc.txt")
    subprocess.run(cmd("prefill", work / "doc.txt", "--no-server", "--quiet"), env=env, check=True)
    subprocess.run(cmd("serve", "--detach", "--quiet"), env=env, check=True)
    try:
        subprocess.run(cmd("ask", "--server", "--quiet", "-c", work / "doc.kv", "--max-new-tokens", "1", "Hi"),
                       env=env, check=True, stdout=subprocess.DEVNULL)  # restored and warm
        arrivals: list[float] = []
        asker = subprocess.Popen(cmd("ask", "--server", "--quiet", "-c", work / "doc.kv", "--max-new-tokens",
                                     args.answer_tokens, "--no-repeat-ngram-size", "10",
                                     "Summarize the whole licence, section by section, in detail."),
                                 env=env, stdout=subprocess.PIPE)

        def read() -> None:
            while asker.stdout.read1(65536):
                arrivals.append(time.perf_counter())

        reader = threading.Thread(target=read)
        reader.start()
        while len(arrivals) < 5:  # the answer is streaming
            time.sleep(0.01)
        t0 = time.perf_counter()
        turns, result = prefill_turns(Path(env["KVCLI_SOCKET"]), long_doc, work / "long.kv", args.chunk)
        t1 = time.perf_counter()
        reader.join()
        asker.wait()
        during = [t for t in arrivals if t0 <= t <= t1]
        edges = [t0, *during, t1] if during else [t0, t1]
        longest = max(b - a for a, b in zip(edges, edges[1:]))
        tokens = int(result.get("num_tokens") or args.tokens)
        # a turn: from one progress event to the next (one slice of the prefill plus the answer's step between)
        spans = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(t0, 0), *turns], turns)]
        longest_turn = max(s for s, _n in spans)
        report = {"prefill_tokens": tokens, "prefill_s": round(t1 - t0, 3), "chunk_size": args.chunk,
                  "turns": len(spans), "tokens_per_turn": sorted({n for _s, n in spans}),
                  "longest_turn_s": round(longest_turn, 3),
                  "pieces_during_prefill": len(during), "longest_pause_s": round(longest, 3),
                  "longest_pause_fraction": round(longest / (t1 - t0), 4),
                  "longest_pause_over_longest_turn": round(longest / longest_turn, 3),
                  "answer_still_streamed_after": arrivals[-1] > t1}
    finally:
        subprocess.run(cmd("serve", "--stop"), env=env, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
        return
    print(f"prefill of {report['prefill_tokens']} tokens through the server: {report['prefill_s']:.1f} s "
          f"(--chunk-size {args.chunk}; {report['turns']} turns of {report['tokens_per_turn'][:4]} tokens; "
          f"the longest turn {report['longest_turn_s']:.2f} s)")
    print(f"answer pieces streamed meanwhile: {report['pieces_during_prefill']}; longest pause {report['longest_pause_s']:.2f} s "
          f"= {report['longest_pause_fraction']:.1%} of the prefill = {report['longest_pause_over_longest_turn']:.2f}x the longest turn")


if __name__ == "__main__":
    main()
