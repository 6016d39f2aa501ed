"""Benchmark (not collected by pytest): the weights modes side by side on the default model, one process, one run.

    python tests/bench/bench_weights.py [--modes float,q8,q4] [--repeats 3] [--max-new-tokens 64] [--check-tokens 48]
                                  [--doc samples/document.txt] [--workdir DIR] [--threads N] [--json]
    python tests/bench/bench_weights.py --model FILE.gguf --modes float,float@bfloat16,q8,gguf --doc-tokens 2048

Loads the model (--model, default kvcli's default) once per mode (kvcli.load(weights=...); WEIGHTS@DTYPE also sets
the dtype), prefills the document with each, then times one
question from a fresh restore per mode in turn (float, q8, q4, float, ...; --repeats rounds): decode ms per token
after the first, medians. Then asks every question of samples/questions.txt with --check on each mode: answers
identical to a recompute on the same weights, the top token's agreement and the mean KL (engine/check.py), and how
many of the answer tokens each mode shares with the first mode's answers (common prefixes). Prints
the CPU, its flags, the threads and the load average before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvcli

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_llamacpp import SAMPLES, cpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="float,q8,q4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens of the timed answer")
    ap.add_argument("--check-tokens", type=int, default=48, help="tokens of each checked answer")
    ap.add_argument("--doc", default=str(SAMPLES / "document.txt"))
    ap.add_argument("--workdir", default=None, help="where the caches go (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: the CPU's cores)")
    ap.add_argument("--model", default=None, help="a .gguf file, a folder or a hub id (default: kvcli's default model)")
    ap.add_argument("--doc-tokens", type=int, default=None, help="the document's first N tokens only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    questions = [q.strip() for q in (SAMPLES / "questions.txt").read_text().splitlines() if q.strip() and not q.startswith("#")]
    result: dict = {"machine": {"cpu": cpu(), "threads": torch.get_num_threads(),
                                "load_before": [round(x, 2) for x in os.getloadavg()]}, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="kvcli-bench-weights-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc = kvcli.read_document(args.doc)
        lms, caches = {}, {}
        for mode in modes:
            weights, _, dtype = mode.partition("@")
            t = time.perf_counter()
            lms[mode] = kvcli.load(args.model, weights=weights, dtype=dtype or "auto")
            load_s = time.perf_counter() - t
            if args.doc_tokens and mode == modes[0]:  # the first N tokens' text, as a document of its own
                ids = lms[mode].tokenizer(doc.text, add_special_tokens=False)["input_ids"][: args.doc_tokens]
                text = lms[mode].tokenizer.decode(ids)
                doc = kvcli.Document(name=doc.name, text=text, sha256=hashlib.sha256(text.encode()).hexdigest())
            caches[mode] = work / f"document-{mode}.kv"
            t = time.perf_counter()
            kvcli.prefill(lms[mode], doc, caches[mode], force=True)
            size = sum(f.stat().st_size for f in caches[mode].rglob("*") if f.is_file())
            result["modes"][mode] = {"load_s": load_s, "prefill_s": time.perf_counter() - t, "bytes_on_disk": size,
                                     "decode_ms_per_token_runs": []}
        opts = kvcli.GenerationOptions(max_new_tokens=args.max_new_tokens)
        for _ in range(args.repeats):
            for mode in modes:
                a = kvcli.Session(lms[mode], caches[mode]).ask(questions[0], opts)
                n = len(a.answer_token_ids)
                result["modes"][mode]["decode_ms_per_token_runs"].append(1000 * (a.total_s - a.ttft_s) / max(1, n - 1))
        check_opts = kvcli.GenerationOptions(max_new_tokens=args.check_tokens)
        for mode in modes:
            r = result["modes"][mode]
            r["decode_ms_per_token"] = statistics.median(r["decode_ms_per_token_runs"])
            session = kvcli.Session(lms[mode], caches[mode])
            answers = [session.ask(q, check_opts, check=True) for q in questions]
            checks = [a.check for a in answers]
            r["answer_ids"] = [a.answer_token_ids for a in answers]
            first = result["modes"][modes[0]]["answer_ids"]
            r["shared_with_first"] = [sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, b))) for a, b in zip(r["answer_ids"], first)]
            r["check"] = {"identical": sum(c.identical for c in checks), "answers": len(checks),
                          "tokens": sum(c.tokens for c in checks),
                          "agreement": sum(c.agreement * c.tokens for c in checks) / max(1, sum(c.tokens for c in checks)),
                          "agreement_worst": min(c.agreement for c in checks),
                          "kl_mean": statistics.mean(c.kl_mean for c in checks),
                          "max_logit_diff": max(c.max_logit_diff for c in checks)}
    result["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(result))
        return
    m = result["machine"]
    print(f"{m['cpu']['model']}, {m['cpu']['cores']} cores ({' '.join(m['cpu']['flags'])}), {m['threads']} threads, "
          f"load {m['load_before']} -> {m['load_after']}")
    print("| weights | decode ms/token (median; runs) | prefill s | on disk MB | --check: identical | top token agrees | mean KL "
          f"| tokens shared with {modes[0]} |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in result["modes"].items():
        c = r["check"]
        runs = ", ".join(f"{x:.1f}" for x in r["decode_ms_per_token_runs"])
        print(f"| {mode} | {r['decode_ms_per_token']:.1f} ({runs}) | {r['prefill_s']:.1f} | {r['bytes_on_disk'] / 1e6:.0f} | "
              f"{c['identical']} of {c['answers']} | {c['agreement']:.1%} (worst {c['agreement_worst']:.1%}) | {c['kl_mean']:.2g} | "
              f"{sum(r['shared_with_first'])} of {sum(len(a) for a in r['answer_ids'])} |")


if __name__ == "__main__":
    main()
