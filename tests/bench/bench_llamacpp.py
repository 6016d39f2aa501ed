"""Benchmark (not collected by pytest): kvcli and llama.cpp side by side on the same GGUF and prompt ids (issue 25).

    .ci/llamacpp-up                       # once: llama-cpp-python built from source in a venv of its own
    python tests/bench/bench_llamacpp.py [--max-new-tokens 64] [--repeats 3] [--doc samples/document.txt] [--weights q4] [--json]

Run from kvcli's venv. kvcli frames the document and every question (its chat framing, engine/prompt/) and
the exact ids go to llama.cpp, which runs in its own venv's python ($KVCLI_LLAMACPP_PYTHON, default
/opt/kvcli-llamacpp-venv/bin/python; tests/bench/llamacpp_run.py), after kvcli is done, so neither environment
imports the other's stack and the two never share the CPU. Both answer greedily (up to --max-new-tokens,
stopping at the model's end-of-turn ids). Prints, for both: model load, prefill, size on disk, restore,
first token after restore, decode ms per token for one question (medians of --repeats runs, each from a
fresh restore), 8 questions (kvcli's batched ask_many against llama.cpp answering them one after another
from the document's state), and how many answer tokens agree (reported, never asserted: kvcli runs the
GGUF dequantized to float32, llama.cpp runs Q4_1 with an f16 KV cache), with the CPU, its flags, the
threads and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parents[1] / "samples"
sys.path.insert(0, str(HERE))
from bench_batch import EXTRA  # noqa: E402  (the 8 questions: the sample's 4, then bench_batch's first extras)

FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
         "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")


def cpu() -> dict:
    info = {"model": "?", "flags": []}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and info["model"] == "?":
            info["model"] = value.strip()
        elif key.strip() == "flags":
            have = set(value.split())
            info["flags"] = [f for f in FLAGS if f in have]
            break
    info["cores"] = os.cpu_count()
    return info


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_kvcli(args, questions: list[str], workdir: Path) -> tuple[dict, dict]:
    """kvcli's numbers, and the prompt ids (document, each question's appended ids) for llama.cpp."""
    t = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import kvcli
    from kvcli.engine.model.models import default_gguf_path
    from kvcli.engine.scheduling.scheduler import engine_for

    gguf = str(default_gguf_path())
    lm = kvcli.load(weights=args.weights)  # the default model: this GGUF (float: converted once into a transformers folder)
    out: dict = {"load_s": time.perf_counter() - t, "threads": torch.get_num_threads(), "dtype": str(lm.dtype),
                 "weights": args.weights}
    doc = kvcli.read_document(args.doc)
    cache = workdir / "document.kv"
    t = time.perf_counter()
    kvcli.prefill(lm, doc, cache, force=True)
    out["prefill_s"] = time.perf_counter() - t
    out["bytes_on_disk"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    engine_for(lm).batched  # noqa: B018  the model's one-time batching probe (remembered on disk), not part of a restore
    opts = kvcli.GenerationOptions(max_new_tokens=args.max_new_tokens)
    runs = []
    for _ in range(args.repeats):  # each from a fresh restore: Session open, then the first question
        session = kvcli.Session(lm, cache)
        a = session.ask(questions[0], opts)
        n = len(a.answer_token_ids)
        runs.append({"restore_s": session.load_s, "first_token_s": a.ttft_s - session.load_s, "ids": a.answer_token_ids,
                     "decode_ms_per_token": 1000 * (a.total_s - a.ttft_s) / (n - 1) if n > 1 else None})
    out["restore_s"] = statistics.median(r["restore_s"] for r in runs)
    out["first_token_s"] = statistics.median(r["first_token_s"] for r in runs)
    out["restore_runs_s"] = [r["restore_s"] for r in runs]
    out["first_token_runs_s"] = [r["first_token_s"] for r in runs]
    out["one"] = {"ids": runs[0]["ids"], "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in runs),
                  "decode_ms_per_token_runs": [r["decode_ms_per_token"] for r in runs],
                  "same_ids_every_run": all(r["ids"] == runs[0]["ids"] for r in runs)}
    t = time.perf_counter()
    many = session.ask_many(questions, opts, batch_size=len(questions))
    out["batched"] = {"wall_s": time.perf_counter() - t, "ids": [a.answer_token_ids for a in many],
                      "tokens": sum(len(a.answer_token_ids) for a in many), "decoding": many[0].decoding or engine_for(lm).mode}
    doc_ids = list(session.token_ids)
    prompt = {"gguf": gguf, "document_ids": doc_ids, "eos_ids": sorted(session.eos),
              "question_ids": session.prompt_ids(questions[0])[len(doc_ids):],
              "batch_ids": [session.prompt_ids(q)[len(doc_ids):] for q in questions]}
    out["document_tokens"] = len(doc_ids)
    return out, prompt


def run_llamacpp(python: str, prompt: dict, args, workdir: Path) -> dict:
    longest = max(len(q) for q in prompt["batch_ids"] + [prompt["question_ids"]])
    need = len(prompt["document_ids"]) + longest + args.max_new_tokens
    cfg = dict(prompt, n_ctx=-(-need // 256) * 256, threads=args.threads, workdir=str(workdir),
               max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    (workdir / "llamacpp.json").write_text(json.dumps(cfg))
    result = workdir / "llamacpp-out.json"
    done = subprocess.run([python, str(HERE / "llamacpp_run.py"), str(workdir / "llamacpp.json"), str(result)],
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
                          stderr=subprocess.PIPE, text=True)  # llama.cpp's log lines: shown only if it fails
    if done.returncode:
        sys.exit(f"{done.stderr}\nbench_llamacpp: the llama.cpp side failed (exit {done.returncode})")
    return json.loads(result.read_text())


def compare(k: dict, ll: dict, n_questions: int) -> dict:
    one_k, one_l = k["one"]["ids"], ll["one"]["ids"]
    pairs = list(zip(k["batched"]["ids"], ll["sequential"]["ids"]))
    return {
        "one_question": {"agree_leading_tokens": common_prefix(one_k, one_l), "kvcli_tokens": len(one_k),
                         "llamacpp_tokens": len(one_l), "identical": one_k == one_l},
        "batch": {"identical_answers": sum(a == b for a, b in pairs), "questions": n_questions,
                  "agree_leading_tokens": [common_prefix(a, b) for a, b in pairs],
                  "kvcli_tokens": [len(a) for a, _ in pairs], "llamacpp_tokens": [len(b) for _, b in pairs]},
    }


def render(r: dict) -> str:
    k, ll, c = r["kvcli"], r["llamacpp"], r["agreement"]
    rows: list[tuple[str, str, str, str]] = []

    def row(name: str, a: float | None, b: float | None, fmt: str, note: str = "") -> None:
        ratio = f"{a / b:.2f}x" if a and b else ""
        rows.append((name, fmt.format(a) if a is not None else "-", fmt.format(b) if b is not None else "-",
                     ratio + (f"  {note}" if note else "")))

    bk, bl = k["batched"], ll["sequential"]
    row("model load, s", k["load_s"], ll["load_s"], "{:.2f}")
    row(f"prefill ({k['document_tokens']:,} tokens), s", k["prefill_s"], ll["prefill_s"] + ll["save_s"], "{:.2f}",
        f"llama.cpp: eval {ll['prefill_s']:.2f} + state file {ll['save_s']:.2f}; kvcli: compute, compress, write")
    row("size on disk, MB", k["bytes_on_disk"] / 1e6, ll["bytes_on_disk"] / 1e6, "{:.1f}",
        f"llama.cpp: llama_state_save_file; its pickled save_state() is {ll['pickle_bytes_on_disk'] / 1e6:.1f} MB")
    row("restore, s", k["restore_s"], ll["restore_s"], "{:.3f}",
        f"pickled save_state() + load_state(): {ll['pickle_restore_s']:.3f} s")
    row("first token after restore, s", k["first_token_s"], ll["one"]["first_token_s"], "{:.3f}", "question's forward + 1 token")
    row("restore + first token, s", k["restore_s"] + k["first_token_s"], ll["restore_s"] + ll["one"]["first_token_s"], "{:.3f}")
    row("decode, 1 question, ms/token", k["one"]["decode_ms_per_token"], ll["one"]["decode_ms_per_token"], "{:.1f}",
        f"{c['one_question']['kvcli_tokens']} / {c['one_question']['llamacpp_tokens']} tokens")
    n = c["batch"]["questions"]
    row(f"{n} questions, total s", bk["wall_s"], bl["wall_s"], "{:.2f}",
        f"kvcli ask_many ({bk['decoding']}) vs llama.cpp one after another; {bk['tokens']} / {bl['tokens']} tokens")
    row(f"{n} questions, ms per answer token", 1000 * bk["wall_s"] / bk["tokens"], 1000 * bl["wall_s"] / bl["tokens"], "{:.1f}",
        "questions' forwards included")
    widths = [max(len(x[i]) for x in rows + [("", "kvcli", "llama.cpp", "")]) for i in range(3)]
    lines = [f"{'':<{widths[0]}}  {'kvcli':>{widths[1]}}  {'llama.cpp':>{widths[2]}}  kvcli/llama.cpp"]
    lines += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {cc:>{widths[2]}}  {d}" for a, b, cc, d in rows]
    one, batch = c["one_question"], c["batch"]
    m = r["machine"]
    lines += [
        "",
        f"same greedy tokens: 1 question: first {one['agree_leading_tokens']} of {one['kvcli_tokens']} agree"
        f" ({'identical' if one['identical'] else 'then they part'}); {n} questions: {batch['identical_answers']} of {n}"
        f" identical, leading tokens agreeing {batch['agree_leading_tokens']}"
        + (" (kvcli: GGUF dequantized to float32" if k.get("weights", "float") == "float" else
           " (kvcli: the Q4_1 codes with bfloat16 scales and activations")
        + "; llama.cpp: Q4_1 weights, 8-bit activations, f16 KV: not expected to agree throughout)",
        f"CPU: {m['cpu']['model']}, {m['cpu']['cores']} cores; flags: {' '.join(m['cpu']['flags']) or '-'}"
        f"; threads: kvcli (torch) {k['threads']}, llama.cpp {ll['threads']}",
        f"llama.cpp: llama-cpp-python {ll['version']}, n_ctx {ll['n_ctx']}, n_batch {ll['n_batch']}; {ll['system_info']}",
        f"kvcli: {k['dtype']}, weights {k.get('weights', 'float')}; restore runs {', '.join(f'{x:.3f}' for x in k['restore_runs_s'])} s;"
        f" llama.cpp restore runs {', '.join(f'{x:.3f}' for x in ll['restore_runs_s'])} s",
        f"load average before {m['load_before']}, after {m['load_after']} (a shared machine makes every time noisy)",
    ]
    if max(m["load_before"][0], m["load_after"][0]) > m["cpu"]["cores"] and min(k["threads"], ll["threads"]) > 1:
        lines.append(f"the load was above the {m['cpu']['cores']} cores: threads that wait for each other at every step "
                     "(llama.cpp's most of all) lose their turn; --threads 1 measures each side more steadily")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", default=str(SAMPLES / "document.txt"))
    ap.add_argument("--questions", type=int, default=8, help="batched questions (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="restores (each with one question) per side; medians")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each side (default: the CPU's cores)")
    ap.add_argument("--llamacpp-python", default=os.environ.get("KVCLI_LLAMACPP_PYTHON")
                    or f"{os.environ.get('KVCLI_LLAMACPP_VENV', '/opt/kvcli-llamacpp-venv')}/bin/python")
    ap.add_argument("--weights", choices=("float", "q4"), default="float", help="kvcli's weights (kvcli.load(weights=...))")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")
    args = ap.parse_args()
    if not Path(args.llamacpp_python).is_file():
        sys.exit(f"bench_llamacpp: no llama.cpp python at {args.llamacpp_python}: run .ci/llamacpp-up "
                 "(or set KVCLI_LLAMACPP_PYTHON)")
    base = [q.strip() for q in (SAMPLES / "questions.txt").read_text().splitlines() if q.strip() and not q.startswith("#")]
    questions = ((base + EXTRA) * 4)[: args.questions]
    result: dict = {"machine": {"cpu": cpu(), "load_before": [round(x, 2) for x in os.getloadavg()]},
                    "questions": questions, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="kvcli-bench-llamacpp-") as tmp:
        result["kvcli"], prompt = run_kvcli(args, questions, Path(tmp))
        result["llamacpp"] = run_llamacpp(args.llamacpp_python, prompt, args, Path(tmp))
    result["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    result["agreement"] = compare(result["kvcli"], result["llamacpp"], len(questions))
    print(json.dumps(result) if args.json else render(result))


if __name__ == "__main__":
    main()
