"""Decoding in the engine thread, with and without the asker's OpenMP pool given back (a script, not collected):

    python tests/bench/bench_handoff.py [--weights q4] [--tokens 32] [--repeats 5] [--cache DIR] [--json]

kvcli answers in its engine thread (engine/scheduling/scheduler.py) while the asking thread waits. An
OpenMP runtime that manages more worker threads than there are CPUs stops spinning between parallel
regions (libgomp does), so the asker's idle pool slows every kernel of the engine's steps; the asker and
the engine give theirs back before waiting (engine/model/openmp.py). In one process, taking turns,
this measures decode ms per token (medians of --repeats answers, each of --tokens tokens, greedy, the
same question) three ways: Session.ask as shipped, Session.ask with release() made a no-op, and the
same rows decoded in the main thread without the engine (the floor). Prints the CPU, its core count and
the load average before and after. With no --cache the sample document is prefilled into
tests/bench/.bench-handoff/ (reused by later runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parents[1] / "samples"
WORK = HERE / ".bench-handoff"
QUESTION = "What does the word Licensor mean in this license?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=None, help="q4: a GGUF model's own 4-bit weights")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()

    import torch

    import kvcli
    from kvcli.engine.decoding.batch import eos_ids
    from kvcli.engine.decoding.protocol import Row
    from kvcli.engine.decoding.solo import OneRowDecoder
    from kvcli.engine.model import openmp

    lm = kvcli.load(weights=args.weights) if args.weights else kvcli.load()
    cache = Path(args.cache) if args.cache else WORK / f"document-{args.weights or 'float'}.kv"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        kvcli.prefill(lm, kvcli.read_document(SAMPLES / "document.txt"), str(cache))
    session = kvcli.Session(lm, str(cache))
    options = kvcli.GenerationOptions(max_new_tokens=args.tokens)
    real_release = openmp.release

    def asked(release: bool) -> float:
        torch.ones(1 << 22).add_(1)  # as after a load or a restore: this thread holds an OpenMP pool
        if not release:  # the asker keeps its pool; the engine thread still gives back its own when idle
            openmp.release = lambda: real_release() if threading.current_thread().name == "kvcli-engine" else False
        try:
            a = session.ask(QUESTION, options)
        finally:
            openmp.release = real_release
        steps = len(a.answer_token_ids) - 1
        return (a.total_s - a.ttft_s) / steps * 1000

    ids = session.prompt_ids(QUESTION)[len(session.token_ids):]  # what ask() appends

    def main_thread() -> float:
        row = Row(0, list(session.token_ids) + ids, list(ids), args.tokens, lambda _i, lg: int(torch.argmax(lg)),
                  lambda _t: False)
        d = OneRowDecoder(lm.model, session.cache, eos=eos_ids(lm.model), length=len(session.token_ids))
        d.add(row)
        d.step()  # the question's own ids
        t = time.perf_counter()
        while d.busy:
            d.step()
        return (time.perf_counter() - t) / max(1, len(row.answer) - 1) * 1000

    ways = {"engine, pools given back": lambda: asked(True), "engine, asker's pool kept": lambda: asked(False),
            "main thread, no engine": main_thread}
    for way in ways.values():  # warm-up
        way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            times[name].append(way())
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    result = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
              "weights": args.weights or "float", "tokens": args.tokens, "repeats": args.repeats,
              "openmp_runtime": bool(openmp._runtime()),
              "ms_per_token": {name: round(statistics.median(v), 1) for name, v in times.items()},
              "all_ms_per_token": {name: [round(x, 1) for x in v] for name, v in times.items()},
              "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()]}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{cpu}, {result['cores']} cores, torch threads {result['torch_threads']}, weights {result['weights']}, "
          f"OpenMP runtime found: {result['openmp_runtime']}")
    for name, ms in result["ms_per_token"].items():
        print(f"  {name:28s} {ms:7.1f} ms/token  (all: {result['all_ms_per_token'][name]})")
    print(f"load average before {result['load_before']}, after {result['load_after']}")


if __name__ == "__main__":
    main()
