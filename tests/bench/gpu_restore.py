"""A cache against recompute on a GPU (a script, not collected by pytest; tests/bench/gpu_run.sh runs it on a lent
device, and it runs on the CPU too for a try: --device cpu --shape tiny):

    python tests/bench/gpu_restore.py --tokenizer DIR [--device cuda] [--shape 1b|8b|tiny] [--tokens 28445]
                                      [--dtype bfloat16] [--compression small,fast] [--repeats 3] [--json]

A llama of the shape asked for, random weights (1b: 16 layers, hidden 2,048, 8 key/value heads; 8b: 32 layers,
hidden 4,096, 8 key/value heads), on --device in --dtype, with the tokenizer in DIR (a saved transformers
tokenizer: gpu_prepare.sh saves the default model's). The sample document repeated to --tokens framed tokens is
prefilled once per storage setting. Then, medians of --repeats, each printed with the device:

- one forward over the whole prompt (document + question): what a user without a cache pays before a first token;
- restore (restore.load_cache onto the device, the page cache warm), in GB/s of raw key/value bytes, with its
  stages (read, hash, decompress on all host threads, the device copy) and the first restore of the process
  (which pins its staging buffers) apart;
- first token from the cache on disk: a new Session (restore included) and one question, TTFT;
- first token from a cache held in memory: the same Session asked again (what a warm server pays), and eight
  questions on it in one batch;
- the ratios the issue sets targets for: TTFT from disk / one forward (<= 0.5), held / one forward (<= 0.1).

--check-exact also answers 3 questions on a small float32 llama on the device and compares them with
generate() on the full prompt (24 tokens), printing identical or where they part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
}
QUESTIONS = ["Who is the Licensor?", "What does the license grant?", "When does the license end?"]


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def model_of(shape: str, vocab: int, device: str, dtype: str, positions: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=positions, initializer_range=0.02, **SHAPES[shape])
    with torch.device(device):  # made on the device in its dtype: an 8B model is never held in float32
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model.eval()


def timed(fn, device: str, repeats: int) -> tuple[float, list[float], object]:
    runs, last = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        last = fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), runs, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=28445)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compression", default="small,fast")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=HERE / ".bench-gpu")
    ap.add_argument("--check-exact", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    import kvcli
    from kvcli import documents
    from kvcli.bench.measure import document_of
    from kvcli.engine import answer
    from kvcli.engine import prefilling as pf
    from kvcli.engine.cache import restore
    from kvcli.engine.prompt import framing as fr
    from kvcli.format import store

    def note(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    model = model_of(args.shape, len(tok), args.device, args.dtype, args.tokens + 4096)
    lm = kvcli.from_objects(model, tok, name=f"llama-{args.shape}-random")
    frame = fr.choose(tok, "auto", None)
    doc = document_of(lm, frame, documents.read(ROOT / "samples" / "document.txt"), args.tokens)
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": args.device, "shape": args.shape, "dtype": args.dtype, "host_cpus": os.cpu_count(),
                    "torch": torch.__version__, "settings": {}}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()

    first_setting = None
    for setting in args.compression.split(","):
        path = args.work / f"doc-{args.shape}-{args.dtype}-{setting}.kv"
        note(f"prefill {setting}: {args.tokens} tokens")
        sync(args.device)
        t0 = time.perf_counter()
        res = pf.prefill(lm, doc, path, compression=setting, force=True)
        row: dict = {"prefill_compute_s": res.compute_s, "prefill_write_s": res.write_s,
                     "prefill_s": time.perf_counter() - t0, "bytes_raw": res.manifest.bytes_raw,
                     "bytes_stored": res.manifest.bytes_stored, "tokens": res.manifest.num_tokens}
        for f in path.iterdir():  # the page cache warm
            f.read_bytes()

        def restore_once():
            with store.open_cache(path) as opened:
                kv = restore.load_cache(opened, device=lm.device, dtype=lm.dtype)
            kv.arrive()
            return kv

        sync(args.device)
        t0 = time.perf_counter()
        first = restore_once()
        sync(args.device)
        row["first_restore_s"] = time.perf_counter() - t0
        del first
        note(f"restore {setting} x{args.repeats}")
        row["restore_s"], row["restore_runs_s"], kv = timed(restore_once, args.device, args.repeats)
        row["restore_gb_s_raw"] = row["bytes_raw"] / row["restore_s"] / 1e9
        row["restore_stages"] = kv.restore_stats.rates()
        row["restore_threads"] = kv.restore_stats.threads
        del kv

        note(f"first token from the cache on disk x{args.repeats}")
        if first_setting is None:  # the model's one-time batching probe and kernels' warm-up, outside the timings
            answer.Session(lm, path).ask(QUESTIONS[0], answer.GenerationOptions(max_new_tokens=1))
        disk, held = [], []
        for q in QUESTIONS[: max(1, args.repeats)]:
            session = answer.Session(lm, path)
            a = session.ask(q, answer.GenerationOptions(max_new_tokens=1))
            disk.append(a.ttft_s)
            b = session.ask(q, answer.GenerationOptions(max_new_tokens=1))  # the cache held: no restore
            held.append(b.ttft_s)
            prompt = a.prompt_token_ids
            if len(disk) == 1:  # eight questions on the held cache in one batch: time to the last first token
                t0 = time.perf_counter()
                session.ask_many([f"{q} ({i})" for i in range(8)], answer.GenerationOptions(max_new_tokens=1))
                sync(args.device)
                row["batch8_first_tokens_s"] = time.perf_counter() - t0
            del session
        row["ttft_disk_s"], row["ttft_disk_runs_s"] = statistics.median(disk), disk
        row["ttft_held_s"], row["ttft_held_runs_s"] = statistics.median(held), held
        result["settings"][setting] = row
        first_setting = first_setting or setting

    note(f"one forward over the whole prompt ({len(prompt)} tokens) x{args.repeats}")
    ids = torch.tensor([prompt], device=lm.device)

    def forward():
        with torch.inference_mode():
            return model(input_ids=ids, logits_to_keep=1).logits

    forward()  # warm-up
    result["forward_s"], result["forward_runs_s"], _ = timed(forward, args.device, args.repeats)
    for row in result["settings"].values():
        row["ttft_disk_over_forward"] = row["ttft_disk_s"] / result["forward_s"]
        row["ttft_held_over_forward"] = row["ttft_held_s"] / result["forward_s"]
    model = lm = None  # freed (the closures above are done with them)

    if args.check_exact:
        result["exact"] = check_exact(args, tok)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.shape} llama (random weights), {args.dtype}, on {result.get('gpu', args.device)}, torch {torch.__version__}, "
          f"{os.cpu_count()} host CPUs; medians of {args.repeats}")
    print(f"  one forward over the whole prompt: {result['forward_s'] * 1e3:.1f} ms")
    for setting, r in result["settings"].items():
        st = r["restore_stages"]
        stages = ", ".join(f"{k.split('_gb')[0]} {v:.1f}" for k, v in st.items() if v and k != "restore_gb_s_raw")
        print(f"  {setting}: {r['tokens']} tokens, raw {r['bytes_raw'] / 1e6:.0f} MB, on disk {r['bytes_stored'] / 1e6:.0f} MB; "
              f"prefill {r['prefill_compute_s']:.2f} s compute + {r['prefill_write_s']:.2f} s write")
        print(f"    restore {r['restore_s'] * 1e3:.1f} ms = {r['restore_gb_s_raw']:.2f} GB/s of raw ({r['restore_threads']} threads; "
              f"first in the process {r['first_restore_s'] * 1e3:.0f} ms); stages GB/s: {stages}")
        print(f"    first token: from disk {r['ttft_disk_s'] * 1e3:.1f} ms ({r['ttft_disk_over_forward']:.2f}x one forward), "
              f"held {r['ttft_held_s'] * 1e3:.1f} ms ({r['ttft_held_over_forward']:.2f}x); 8 questions batched on the held "
              f"cache, first tokens in {r['batch8_first_tokens_s'] * 1e3:.1f} ms")
    if "exact" in result:
        print(f"  float32 exactness on {args.device}: {result['exact']}")


def check_exact(args, tok) -> str:
    """Cached answers of a small float32 llama on the device against generate() on the full prompt."""
    import torch

    import kvcli
    from kvcli import documents
    from kvcli.engine import answer
    from kvcli.engine import prefilling as pf

    model = model_of("tiny", len(tok), args.device, "float32", 8192)
    lm = kvcli.from_objects(model, tok, name="llama-tiny-random")
    doc = documents.read(ROOT / "samples" / "document.txt")
    path = args.work / "exact-tiny-f32.kv"
    pf.prefill(lm, doc, path, force=True)
    session = answer.Session(lm, path)
    out = []
    for q in QUESTIONS:
        a = session.ask(q, answer.GenerationOptions(max_new_tokens=24))
        prompt = torch.tensor([a.prompt_token_ids], device=lm.device)
        with torch.inference_mode():
            ref = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                                 do_sample=False, pad_token_id=tok.eos_token_id)[0, prompt.shape[1]:].tolist()
        got = a.answer_token_ids
        n = len(got)
        same = ref[:n] == got and len(ref) - n in (0, 1)  # generate() may also return the stop token
        out.append("identical" if same else f"DIFFERS at token {next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), n)}")
    return f"{sum(o == 'identical' for o in out)}/{len(out)} identical to generate() ({'; '.join(out)})"


if __name__ == "__main__":
    main()
