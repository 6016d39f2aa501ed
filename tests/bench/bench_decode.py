"""One question's decode against transformers' own, on the same weights and cache (a script, not collected):

    python tests/bench/bench_decode.py [--tokens 32] [--rounds 5] [--busy N] [--cache DIR] [--json]
    python tests/bench/bench_decode.py --apart [--tokens 32] [--rounds 5] [--busy N]
    python tests/bench/bench_decode.py --profile [--steps 10]
    python tests/bench/bench_decode.py --model FILE.gguf --weights gguf [--dtype auto] [--doc-tokens 1024] [--profile]

Default: in one process, taking turns, decode ms per token (after the first token) of kvcli's
Session.ask (the engine thread, the lone row on the document's cache) and of transformers' generate()
given a DynamicCache of the same document (its own cache, which concatenates every layer's keys/values
at each step), the same greedy question; medians of --rounds, the ratio, and whether the tokens agree.
--busy N starts N busy-looping processes for the measurement (and stops them). --profile times steady
one-row decode steps (OneRowDecoder in this thread: as shipped, with the OpenMP workers spinning and every
float32 product split across the cores, and with them sleeping and no product split; engine/decoding/solo.py),
lists torch.profiler's top ops by self CPU time, and
times the one-row products of the step's shapes alone at 1 and 2 torch threads. Prints the CPU, its
flags, the thread count and the load average before and after. With no --cache the sample document (its first
--doc-tokens tokens, when given) is prefilled into tests/bench/.bench-decode/, one cache per model, weights and
dtype (reused by later runs). --model, --weights and --dtype load the model as kvcli.load does (default: the
default model in float32); the one-row products timed by --profile are those of the model's own float layers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUSY = "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass"  # a busy loop that ends with the benchmark, killed or not
SAMPLES = HERE.parents[1] / "samples"
WORK = HERE / ".bench-decode"
QUESTION = "What does the word Licensor mean in this license?"
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu() -> tuple[str, list[str]]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = text.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return name, [f for f in FLAGS if f in flags]


def median_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def generate_ms(lm, states, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[float, list[int]]:
    """transformers' generate() from a DynamicCache of the document's restored states: decode ms per token after
    the first, and the answer ids."""
    import torch
    from transformers import DynamicCache

    dc = DynamicCache(config=lm.model.config)
    for i, s in enumerate(states):
        dc.update(s.keys.clone(), s.values.clone(), i)
    stamps: list[float] = []

    def stamp(_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = lm.model.generate(input_ids=x, attention_mask=torch.ones_like(x), cache=dc, do_sample=False,
                                max_new_tokens=max_new_tokens, logits_processor=[stamp], eos_token_id=list(eos) or None)
    return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * 1000, out[0, x.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the measurement")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps", type=int, default=10, help="--profile: profiled steps")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--apart", action="store_true", help="each way in fresh processes of its own, taking turns")
    ap.add_argument("--model", default=None, help="a .gguf file, a folder or a hub id (default: kvcli's default model)")
    ap.add_argument("--weights", default="float", help="float, q8, q4 or gguf (engine/model/stored.py)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--doc-tokens", type=int, default=None, help="the sample document's first N tokens only")
    ap.add_argument("--child", choices=("kvcli", "generate"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.apart:
        return apart(args)
    load_before = os.getloadavg()

    import torch

    import kvcli
    from kvcli.engine.decoding.batch import eos_ids
    from kvcli.engine.decoding.protocol import Row
    from kvcli.engine.decoding.solo import OneRowDecoder
    from kvcli.engine.model.cpu import SLEEP, SPLIT, WHOLE

    lm = kvcli.load(args.model, weights=args.weights, dtype=args.dtype)
    tag = f"{Path(args.model).stem if args.model else 'default'}-{args.weights}-{str(lm.dtype).removeprefix('torch.')}"
    cache = Path(args.cache) if args.cache else WORK / f"document-{tag}-{args.doc_tokens or 'all'}.kv"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        document = kvcli.read_document(SAMPLES / "document.txt")
        if args.doc_tokens:  # the first N tokens' text, as a document of its own
            ids = lm.tokenizer(document.text, add_special_tokens=False)["input_ids"][: args.doc_tokens]
            text = lm.tokenizer.decode(ids)
            document = kvcli.Document(name="document.txt", text=text, sha256=hashlib.sha256(text.encode()).hexdigest())
        kvcli.prefill(lm, document, str(cache))
    session = kvcli.Session(lm, str(cache))
    prompt = session.prompt_ids(QUESTION)
    doc = len(session.token_ids)
    name, flags = cpu()
    result: dict = {"cpu": name, "flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "document_tokens": doc}

    if args.profile:
        row = Row(0, list(prompt), list(prompt[doc:]), 10_000, lambda _i, lg: int(torch.argmax(lg)), lambda _t: False)
        d = OneRowDecoder(lm.model, session.cache, eos=set(), length=doc)
        d.add(row)
        d.step()  # the question's own ids
        for _ in range(3):
            d.step()
        chooser, steps = d.ways, {"as shipped": [], "spin, split": [], "spin, whole": [], "sleep, whole": []}

        class Fixed:  # one way every step, in place of the decoder's chooser
            def __init__(self, way):
                self.pick, self.record = (lambda: way), (lambda *_: None)

        for _ in range(3):  # as shipped (the fastest way), then each way every step; taking turns
            for way, fixed in (("as shipped", chooser), ("spin, split", Fixed(SPLIT)), ("spin, whole", Fixed(WHOLE)),
                               ("sleep, whole", Fixed(SLEEP))):
                d.ways = fixed if chooser is not None else None
                steps[way].append(median_ms(d.step, args.steps))
        d.ways = chooser
        result["step_ms"] = {k: round(statistics.median(v), 1) for k, v in steps.items()}
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                d.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        F = torch.nn.functional
        layers = [(n.rsplit(".", 1)[-1], m) for n, m in lm.model.named_modules()
                  if isinstance(m, torch.nn.Linear) and (".layers.0." in n or m is lm.model.get_output_embeddings())]
        shapes = {f"{n} [1,{m.in_features}]x[{m.in_features},{m.out_features}]": (m.out_features, m.in_features)
                  for n, m in layers}  # the float layers' shapes (a low-bit model has none left)
        threads = torch.get_num_threads()
        products = {}
        for label, (out, inp) in shapes.items():
            copies = max(1, (256 << 20) // (out * inp * lm.dtype.itemsize))  # distinct weights, as a step reads them: not from the CPU cache
            ws = [torch.randn(out, inp, dtype=lm.dtype) for _ in range(min(copies, 30))]
            x = torch.randn(1, inp, dtype=lm.dtype)
            for t in (1, 2):
                torch.set_num_threads(t)
                products.setdefault(label, {})[t] = round(median_ms(lambda: [F.linear(x, w) for w in ws], 9) / len(ws), 3)
        torch.set_num_threads(threads)
        session.cache.rewind()
        result.update(products_ms=products, load_before=[round(x, 2) for x in load_before],
                      load_after=[round(x, 2) for x in os.getloadavg()])
        if args.json:
            print(json.dumps(result, indent=2))
            return
        print(table)
        print(f"{name}, {result['cores']} cores, flags {' '.join(flags)}, torch threads {threads}, {doc} cached tokens")
        print(f"steady one-row step, ms (medians of 3 x {args.steps}, taking turns): {result['step_ms']}")
        for label, by in products.items():
            print(f"  {label:34s} 1 thread {by[1]:7.3f} ms   2 threads {by[2]:7.3f} ms")
        print(f"load average before {result['load_before']}, after {result['load_after']}")
        return


    options = kvcli.GenerationOptions(max_new_tokens=args.tokens)
    eos = eos_ids(lm.model)
    states = session.cache.states()

    def kvcli_ask() -> tuple[float, list[int]]:
        a = session.ask(QUESTION, options)
        return (a.total_s - a.ttft_s) / max(1, len(a.answer_token_ids) - 1) * 1000, a.answer_token_ids

    def generate() -> tuple[float, list[int]]:
        return generate_ms(lm, states, prompt, args.tokens, eos)

    if args.child:  # one warm-up answer, then one measured
        way = kvcli_ask if args.child == "kvcli" else generate
        way()
        ms, ids = way()
        print(json.dumps({"ms": ms, "ids": ids}))
        return
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) for _ in range(args.busy)]
    try:
        kvcli_ask(), generate()  # warm-up
        times: dict[str, list[float]] = {"kvcli": [], "generate": []}
        tokens: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for label, way in (("kvcli", kvcli_ask), ("generate", generate)):
                ms, ids = way()
                times[label].append(ms)
                tokens[label] = ids
    finally:
        for p in busy:
            p.kill()
            p.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    result.update(tokens=args.tokens, rounds=args.rounds, busy=args.busy,
                  ms_per_token={k: round(v, 1) for k, v in med.items()},
                  all_ms_per_token={k: [round(x, 1) for x in v] for k, v in times.items()},
                  ratio=round(med["kvcli"] / med["generate"], 3), same_tokens=tokens["kvcli"] == tokens["generate"],
                  load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in os.getloadavg()])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{name}, {result['cores']} cores, flags {' '.join(flags)}, torch threads {result['torch_threads']}, "
          f"{doc} cached tokens, {args.tokens} new tokens, {args.busy} busy processes beside")
    for k in times:
        print(f"  {k:9s} {result['ms_per_token'][k]:7.1f} ms/token  (all: {result['all_ms_per_token'][k]})")
    print(f"  kvcli / generate: {result['ratio']}x, same tokens: {result['same_tokens']}")
    print(f"load average before {result['load_before']}, after {result['load_after']}")


def apart(args) -> None:
    """--apart: --rounds rounds, each way in a fresh process per round (no process holds the other's threads)."""
    load_before = os.getloadavg()
    child = [sys.executable, __file__, "--tokens", str(args.tokens), "--weights", args.weights, "--dtype", args.dtype]
    child += (["--cache", args.cache] if args.cache else []) + (["--model", args.model] if args.model else [])
    child += ["--doc-tokens", str(args.doc_tokens)] if args.doc_tokens else []
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]) for _ in range(args.busy)]
    times: dict[str, list[float]] = {"kvcli": [], "generate": []}
    tokens: dict[str, list[int]] = {}
    try:
        for _ in range(args.rounds):
            for way in times:
                done = subprocess.run([*child, "--child", way], capture_output=True, text=True, timeout=900, check=True)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                times[way].append(got["ms"])
                tokens[way] = got["ids"]
    finally:
        for p in busy:
            p.kill()
            p.wait()
    name, flags = cpu()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name}, {os.cpu_count()} cores, flags {' '.join(flags)}, {args.tokens} new tokens, {args.busy} busy processes "
          f"beside, each way in fresh processes")
    for k, v in times.items():
        print(f"  {k:9s} {med[k]:7.1f} ms/token  (all: {[round(x, 1) for x in v]})")
    print(f"  kvcli / generate: {med['kvcli'] / med['generate']:.3f}x, same tokens: {tokens['kvcli'] == tokens['generate']}")
    print(f"load average before {[round(x, 2) for x in load_before]}, after {[round(x, 2) for x in os.getloadavg()]}")


if __name__ == "__main__":
    main()
