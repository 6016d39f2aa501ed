"""A shell loop of single questions against one `ask -f` of them (a script, not collected by pytest).

    python tests/bench/bench_loop.py [--questions 10] [--max-new-tokens 32] [--busy N] [--cache samples/document.kv] [--json]

Three ways to ask the same --questions questions of one cache, each in fresh `kvcli` processes:
  batch      one `kvcli ask --no-server -f FILE` process (every question in one process, asked together)
  loop       one `kvcli ask` process per question with no server running at the start: the first one starts
             the warm server in the background (KVCLI_AUTOSTART=1, a private socket), the rest use it
  no-server  one `kvcli ask --no-server` process per question (each loads the model)
Prints the wall time of each process, the loop's questions 2..N against the batch (the target: at most
1.5x), the CPU, its flags and the load average. --busy N runs N busy-looping processes throughout.
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
BUSY = "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass"  # a busy loop that ends with the benchmark, killed or not
QUESTIONS = [
    "What is the name of this license?",
    "What is the name of the foundation that wrote this license?",
    "What does the word Licensor mean in this license?",
    "Who is a Contributor?",
    "What is a Larger Work?",
    "May I distribute the software in executable form?",
    "What happens if I sue a Contributor over a patent?",
    "Is there a warranty?",
    "Which law governs this license?",
    "Can the license be changed, and by whom?",
    "What is Source Code Form?",
    "What must I do when I distribute Source Code Form?",
]
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu() -> tuple[str, list[str]]:
    text = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return name, [f for f in FLAGS if f in flags]


def timed(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=ROOT / "samples" / "document.kv")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not 1 < args.questions <= len(QUESTIONS):
        raise SystemExit(f"--questions: 2 to {len(QUESTIONS)}")
    questions = QUESTIONS[: args.questions]
    kvcli = [sys.executable, "-m", "kvcli"]
    tmp = Path(tempfile.mkdtemp(prefix="kvcli-bench-loop-"))
    qfile = tmp / "questions.txt"
    qfile.write_text("\n".join(questions) + "\n")
    sock = tmp / "kvcli.sock"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(KVCLI_SOCKET=str(sock), KVCLI_AUTOSTART="1", KVCLI_AUTOSTART_IDLE="5m", HF_HUB_OFFLINE="1")
    common = ["-c", str(args.cache), "--max-new-tokens", str(args.max_new_tokens), "-q"]
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) for _ in range(args.busy)]
    load_before = os.getloadavg()
    try:
        batch = timed([*kvcli, "ask", *common, "--no-server", "-f", str(qfile)], env)
        loop = [timed([*kvcli, "ask", *common, q], env) for q in questions]
        subprocess.run([*kvcli, "serve", "--stop", "--socket", str(sock)], env=env, capture_output=True, timeout=120)
        apart = [timed([*kvcli, "ask", *common, "--no-server", q], env) for q in questions[:3]]
    finally:
        for p in busy:
            p.kill()
    name, flags = cpu()
    rest = sum(loop[1:])
    out = {"cpu": name, "flags": flags, "threads": os.cpu_count(), "busy": args.busy, "questions": len(questions),
           "max_new_tokens": args.max_new_tokens, "batch_s": round(batch, 2), "loop_s": [round(x, 2) for x in loop],
           "loop_rest_s": round(rest, 2), "rest_over_batch": round(rest / batch, 2),
           "no_server_s": [round(x, 2) for x in apart],
           "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"cpu: {name}; flags: {' '.join(flags)}; {os.cpu_count()} threads; busy processes: {args.busy}; "
          f"load {out['load_before']} -> {out['load_after']}")
    print(f"{len(questions)} questions, up to {args.max_new_tokens} tokens each")
    print(f"batch: one `ask -f` process                  {batch:7.2f} s")
    print(f"loop: question 1 (starts the server)         {loop[0]:7.2f} s")
    print(f"loop: questions 2-{len(questions)} together                 {rest:7.2f} s  ({rest / batch:.2f}x the batch; "
          f"{rest / (len(questions) - 1):.2f} s each)")
    print(f"no server: one process per question (median)  {sorted(apart)[len(apart) // 2]:7.2f} s")


if __name__ == "__main__":
    main()
