"""Where a fresh `kvcli ask --no-server` process spends its time before the first token (not collected by pytest).

    python tests/bench/bench_coldstart.py [--cache samples/document.kv] [--runs 5] [--model M]

Each run is a new Python process that walks the in-process ask path phase by phase (imports, config,
tokenizer, weights, fingerprint, page-in, restore, batching verdict, first token) and reports each phase's
wall time; the parent also times whole `kvcli ask --no-server` processes (1 answer token). Prints one
JSON line per run and a table of medians. Run with the bytecode compiled (the quick start's install does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
marks, cpu = [], {}  # (phase, wall s); phase -> this thread's CPU s (less moved by other processes than wall time)
c0 = time.thread_time()
def mark(name, since):
    global c0
    now, c = time.perf_counter(), time.thread_time()
    marks.append((name, now - since)); cpu[name] = c - c0; c0 = c
    return now

t = t0
import kvcli.cli.app  # typer, rich: what every command pays
t = mark("import kvcli.cli", t)
import torch
t = mark("import torch", t)
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
t = mark("import transformers", t)
from kvcli.engine import answer as an
from kvcli.engine.model import models, paging
from kvcli.engine.cache import restore
from kvcli.engine.scheduling import probe
from kvcli.format import store
from kvcli.requests import ModelSpec
t = mark("import kvcli engine", t)

def timed(name, fn):
    def wrapper(*a, **k):
        s = time.perf_counter(); r = fn(*a, **k); marks.append((name, time.perf_counter() - s)); return r
    return wrapper

models.load_config = timed("config", models.load_config)
models.fingerprint = timed("fingerprint", models.fingerprint)
paging.page_in = timed("page in weights", paging.page_in)
restore.load_cache = timed("restore", restore.load_cache)
probe.remembered = timed("batching verdict", probe.remembered)
tok_from = AutoTokenizer.from_pretrained.__func__
AutoTokenizer.from_pretrained = classmethod(lambda cls, *a, **k: timed("tokenizer", tok_from)(cls, *a, **k))
lm_from = AutoModelForCausalLM.from_pretrained.__func__
AutoModelForCausalLM.from_pretrained = classmethod(lambda cls, *a, **k: timed("weights (from_pretrained)", lm_from)(cls, *a, **k))

cache, model = sys.argv[1], (sys.argv[2] or None)
s = time.perf_counter()
pool = an.ModelPool(ModelSpec(model))
lm = pool.for_manifest(store.read_manifest(cache))
marks.append(("load() in all", time.perf_counter() - s))
ready = time.perf_counter() - t0
s = time.perf_counter()
session = an.Session(lm, cache)
marks.append(("Session in all", time.perf_counter() - s))
s = time.perf_counter()
session.ask("What does Licensor mean?", an.GenerationOptions(max_new_tokens=1))
marks.append(("first token", time.perf_counter() - s))
print(json.dumps({"marks": marks, "import_cpu_s": cpu, "model_ready_s": ready, "first_token_s": time.perf_counter() - t0}))
"""


def child_run(cache: str, model: str | None) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, cache, model or ""], capture_output=True, text=True, check=True,
                       env=dict(os.environ, KVCLI_AUTOSTART="0"))
    return json.loads(p.stdout.strip().splitlines()[-1])


def cli_run(cache: str, model: str | None) -> float:
    cmd = [sys.executable, "-m", "kvcli", "ask", "--no-server", "--quiet", "--cache", cache, "--max-new-tokens", "1",
           *(["--model", model] if model else []), "What does Licensor mean?"]
    t = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", default=str(ROOT / "samples" / "document.kv"))
    p.add_argument("--model", default=None)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    wanted = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in flags]
    print(f"# {os.cpu_count()} cores, flags {' '.join(wanted)}", file=sys.stderr)
    child_run(args.cache, args.model)  # warms the page cache and the remembered fingerprint and verdict
    runs, whole = [], []
    for _ in range(args.runs):  # alternating: phases, then a whole CLI process
        r = child_run(args.cache, args.model)
        runs.append(r)
        whole.append(cli_run(args.cache, args.model))
        print(json.dumps(r | {"cli_s": whole[-1]}))
    names = list(dict.fromkeys(name for r in runs for name, _ in r["marks"]))
    print(f"{'phase':28} median s")
    for name in names:
        values = [sum(v for n, v in r["marks"] if n == name) for r in runs]
        print(f"{name:28} {statistics.median(values):7.3f}")
    for name in runs[0]["import_cpu_s"]:
        print(f"{name + ' (thread CPU)':28} {statistics.median(r['import_cpu_s'][name] for r in runs):7.3f}")
    print(f"{'model ready (from start)':28} {statistics.median(r['model_ready_s'] for r in runs):7.3f}")
    print(f"{'first token (from start)':28} {statistics.median(r['first_token_s'] for r in runs):7.3f}")
    print(f"{'whole kvcli ask process':28} {statistics.median(whole):7.3f}")


if __name__ == "__main__":
    main()
