"""Benchmark (not part of the test suite): vLLM's time to first token with KvcliConnector vs its own prefill.

    KVCLI_VLLM_PYTHON=/path/to/vllm-venv/bin/python KVCLI_HOME=... python tests/bench/bench_vllm.py [--out DIR]

Run with kvcli's venv: it prefills samples/document.txt (2,247 tokens with the default model) with kvcli if
no cache is there yet, then starts ONE vLLM engine (tests/bench/vllm_run.py in the vLLM venv) with the connector
and, for each question of samples/questions.txt, times a 1-token generation prefilled by vLLM itself
(kv_transfer_params {"kvcli": "skip"}) and one served from the cache, alternating, after one warm-up of
each. Then 32-token greedy answers both ways with raw logits (logprobs_mode raw_logits, top 20): prints
the agreement, and the largest difference between the logits the two runs give the same token at the same
step while the answers agree. vLLM's prefix caching is off, so neither path reuses the other's blocks.
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
SAMPLES = ROOT / "samples"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for the cache and the run's files (default: a temporary one)")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    vllm_python = os.environ.get("KVCLI_VLLM_PYTHON")
    if not vllm_python:
        sys.exit("set KVCLI_VLLM_PYTHON to the python of a vLLM venv (.ci/vllm-up)")
    out = Path(args.out or tempfile.mkdtemp(prefix="kvcli-bench-vllm-"))
    caches = out / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    cache = caches / "document.kv"
    if not (cache / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "kvcli", "prefill", str(SAMPLES / "document.txt"), "-o", str(cache), "--quiet"],
                       check=True, timeout=3600)
    from transformers import AutoTokenizer

    from kvcli.engine.prompt import framing
    from kvcli.engine.model import models
    from kvcli.format import store

    model = next(f for f in (models.kvcli_home() / "models").glob("gguf-*") if not f.name.endswith(("-config", "-q4", "-gguf")))
    tok = AutoTokenizer.from_pretrained(str(model))
    m = store.read_manifest(cache)
    fr = framing.Framing.from_record(m.framing)
    questions = [q.strip() for q in (SAMPLES / "questions.txt").read_text().splitlines() if q.strip() and not q.startswith("#")]
    ids = {i: m.token_ids + framing.question_ids(tok, fr, q, cached=m.token_ids) for i, q in enumerate(questions)}
    skip = {"kvcli": "skip"}
    requests = [{"tag": "warm-own", "ids": ids[0], "params": skip, "max_tokens": 1},
                {"tag": "warm-conn", "ids": ids[0], "max_tokens": 1}]
    for i in ids:
        requests += [{"tag": f"ttft-own-{i}", "ids": ids[i], "params": skip, "max_tokens": 1},
                     {"tag": f"ttft-conn-{i}", "ids": ids[i], "max_tokens": 1},
                     {"tag": f"ans-own-{i}", "ids": ids[i], "params": skip},
                     {"tag": f"ans-conn-{i}", "ids": ids[i]}]
    cfg = {"model": str(model), "caches": str(caches), "stats_file": str(out / "stats.jsonl"), "max_tokens": args.max_tokens,
           "logprobs": 20, "keep_top": 20, "logprobs_mode": "raw_logits", "requests": requests}
    (out / "bench.json").write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    r = subprocess.run([vllm_python, str(ROOT / "tests" / "bench" / "vllm_run.py"), str(out / "bench.json"), str(out / "bench-out.json")],
                       capture_output=True, text=True, timeout=3600, env=env)
    (out / "bench.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        sys.exit(f"vLLM run failed:\n{(r.stdout + r.stderr)[-4000:]}")
    res = json.loads((out / "bench-out.json").read_text())["results"]
    own = [res[f"ttft-own-{i}"]["seconds"] for i in ids]
    conn = [res[f"ttft-conn-{i}"]["seconds"] for i in ids]
    cached = [res[f"ttft-conn-{i}"]["num_cached_tokens"] for i in ids]
    agree, worst, steps = 0, 0.0, 0
    for i in ids:
        a, b = res[f"ans-own-{i}"], res[f"ans-conn-{i}"]
        agree += a["ids"] == b["ids"]
        for t, (sa, sb) in enumerate(zip(a["top"], b["top"])):
            la, lb = dict((x, v) for x, v in sa), dict((x, v) for x, v in sb)
            for tid in set(la) & set(lb):
                worst = max(worst, abs(la[tid] - lb[tid]))
            steps += 1
            if a["ids"][t] != b["ids"][t]:
                break
    print(f"document: {m.num_tokens} cached tokens ({cache}); {len(ids)} questions; vLLM block size from the counters: "
          f"{cached[0]} of {m.num_tokens} tokens loaded")
    print(f"TTFT, vLLM's own prefill: median {statistics.median(own):.3f} s  ({', '.join(f'{x:.3f}' for x in own)})")
    print(f"TTFT, from the kvcli cache: median {statistics.median(conn):.3f} s  ({', '.join(f'{x:.3f}' for x in conn)})")
    print(f"ratio: {statistics.median(own) / statistics.median(conn):.1f}x")
    print(f"answers ({args.max_tokens} greedy tokens): {agree}/{len(ids)} identical; largest raw-logit difference on the "
          f"top-20 tokens over {steps} steps: {worst:.2e}")
    loads = [json.loads(x) for x in (out / "stats.jsonl").read_text().splitlines()]
    secs = [e["seconds"] for e in loads if e["event"] == "loaded"]
    if secs:
        print(f"connector load (read, verify, decode, write 30 layers): median {statistics.median(secs):.3f} s")


if __name__ == "__main__":
    main()
