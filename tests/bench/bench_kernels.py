"""Per-kernel speed of the GGUF layers (kvcli/engine/model/kernels) on a 0.5B's and a 7B's layer shapes (not part of
the test run): one-row products (decoding) on the native kernel (8-bit activations, integer dot products), the
pure-torch path, and torch's weight-only `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` on the same shapes;
many-row products (prefill) as bfloat16 GEMMs on weights dequantized by the native code and by torch.
`--rows 8,16,32,64,128` instead times, per shape, the native kernel on that many rows against the GEMM path (at
`--level`, default the CPU's best): where the ratio passes 1 is the crossover kernels/modules.py's NATIVE_ROWS holds.
`--attention 1024,2048,8192` instead times a decoding step's one-row attention in bfloat16 over that many keys, every
layer's keys and values apart (as a step reads them): the native kernel against the torch products it stands in for.

Usage: flock /tmp/kvcli-heavy.lock python tests/bench/bench_kernels.py [--model 0.5b,7b] [--threads 2] [--prefill 512]
[--no-torch-path] [--cold-mb 600] [--json] [--rows 8,16,32,64 [--level 1|2|3]] [--attention 2048]. Weights are
cycled through copies, so each product reads its weight from memory as a decoding step does (the L3 cache here is
large). Random blocks (finite scales): speed does not depend on the values. GB/s counts the bytes each kernel reads
for its weight (the file's blocks; int8/int4 codes and scales for torch's kernels).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from kvcli.engine.model import kernels
from kvcli.engine.model.kernels import formats, native

# (name, kind, rows (out), cols (in), count a token): the linears of one layer, and the output layer once
SHAPES = {
    "0.5b": dict(layers=24, linears=[
        ("q", "Q5_0", 896, 896, 1), ("k", "Q5_0", 128, 896, 1), ("v", "Q8_0", 128, 896, 1), ("o", "Q5_0", 896, 896, 1),
        ("gate", "Q5_0", 4864, 896, 1), ("up", "Q5_0", 4864, 896, 1), ("down", "Q4_K", 896, 4864, 0.5),
        ("down", "Q6_K", 896, 4864, 0.5)], output=("output", "Q8_0", 151936, 896)),
    "7b": dict(layers=28, linears=[
        ("q", "Q4_K", 3584, 3584, 1), ("k", "Q4_K", 512, 3584, 1), ("v", "Q6_K", 512, 3584, 1), ("o", "Q4_K", 3584, 3584, 1),
        ("gate", "Q4_K", 18944, 3584, 1), ("up", "Q4_K", 18944, 3584, 1), ("down", "Q6_K", 3584, 18944, 0.5),
        ("down", "Q4_K", 3584, 18944, 0.5)], output=("output", "Q6_K", 152064, 3584)),
}
ATTENTION = {"0.5b": (24, 14, 2, 64), "7b": (28, 28, 4, 128)}  # layers, query heads, key/value heads, head size
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    block, size = formats.SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in HALVES[kind]:
        raw[:, at:at + 2] = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def timed(fn, budget: float = 1.0, least: int = 3) -> float:
    """Median ms of fn(i) (i counts the calls) over repeats filling about `budget` seconds, after one warm-up call."""
    fn(0)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget and len(times) < 200):
        t = time.perf_counter()
        fn(len(times) + 1)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def copies(t: torch.Tensor, cold_bytes: int) -> list[torch.Tensor]:
    """Enough copies of t that cycling through them reads `cold_bytes` between two reads of one copy: the weights
    come from memory, as in a decoding step (which reads every layer once), not from the CPU's caches."""
    n = max(1, -(-cold_bytes // (t.numel() * t.element_size())))
    return [t] + [t.clone() for _ in range(n - 1)]


def one_shape(kind: str, rows: int, cols: int, torch_path: bool, prefill: int, cold: int) -> dict:
    blocks = random_blocks(kind, rows, cols)
    x, xb = torch.randn(1, cols), torch.randn(1, cols).to(torch.bfloat16)
    r: dict = {"bytes": blocks.numel()}

    def packed(b: torch.Tensor) -> kernels.PackedLinear:
        return kernels.PackedLinear(kind, rows, cols, kernels.prepare(kind, b, rows, cols))

    def cycled(fn, t: torch.Tensor, **kw) -> float:  # fn(one copy of t), timed over copies of t
        items = [fn(c) if fn is packed else c for c in copies(t, cold)]
        call = (lambda i: items[i % len(items)](x)) if fn is packed else (lambda i: fn(items[i % len(items)]))
        return timed(call, **kw)

    with torch.inference_mode():
        if native.runs(kind, cols):
            r["native_ms"] = cycled(packed, blocks)
        if torch_path:
            with kernels.torch_only():
                r["torch_ms"] = cycled(packed, blocks, budget=0.5, least=2)
        s8 = torch.rand(rows).to(torch.bfloat16)
        r["int8pack_ms"] = cycled(lambda q: torch._weight_int8pack_mm(xb, q, s8),
                                  torch.randint(-127, 128, (rows, cols), dtype=torch.int8))
        r["int8pack_bytes"] = rows * cols + 2 * rows
        sz = torch.randn(cols // 32, rows, 2).to(torch.bfloat16)
        p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (rows, cols), dtype=torch.int32), 1)
        r["int4pack_ms"] = cycled(lambda p: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, sz), p4)
        r["int4pack_bytes"] = rows * cols // 2 + sz.numel() * 2
        del p4
        if prefill:
            layer = kernels.PackedLinear(kind, rows, cols, kernels.prepare(kind, blocks, rows, cols))
            xs = torch.randn(prefill, cols)
            flops = 2 * prefill * rows * cols
            r["prefill_rows"] = prefill
            r["prefill_native_dequant_ms"] = timed(lambda i: layer(xs), budget=1.0, least=2)
            if torch_path:
                with kernels.torch_only():
                    r["prefill_torch_dequant_ms"] = timed(lambda i: layer(xs), budget=1.0, least=2)
            wb = torch.randn(rows, cols).to(torch.bfloat16)
            xsb = xs.to(torch.bfloat16)
            r["prefill_bf16_mm_ms"] = timed(lambda i: torch.mm(xsb, wb.T), budget=1.0, least=2)
            r["prefill_gflops_native"] = flops / r["prefill_native_dequant_ms"] / 1e6
    return r


def rows_against_gemm(model: str, counts: list[int], level: int | None) -> None:
    """Print, per distinct shape of `model`, the native kernel's time on each count of rows against the GEMM path's
    (weights dequantized natively to bfloat16 tiles), with their ratio: below 1, the native kernel is faster."""
    from kvcli.engine.model.kernels import modules

    spec = SHAPES[model]
    seen = set()
    for name, kind, rows, cols, _ in spec["linears"]:
        if (kind, rows, cols) in seen or not native.runs(kind, cols):
            continue
        seen.add((kind, rows, cols))
        blocks = random_blocks(kind, rows, cols)
        for n in counts:
            x = torch.randn(n, cols)
            g = timed(lambda i: native.gemv(kind, blocks, cols, x, None, at=level), budget=0.5)
            m = timed(lambda i: modules.bf16_product(kind, blocks, x, cols, use_native=True), budget=0.5)
            print(f"{model:4s} {name:6s} {kind:4s} {rows:6d}x{cols:<5d} rows {n:4d}: native {g:8.2f} ms | "
                  f"GEMM {m:8.2f} ms | ratio {g / m:5.2f}", flush=True)


def attention_step(model: str, counts: list[int]) -> None:
    """Print, per count of keys, one step's attention over every layer of `model` (one bfloat16 query row): the
    native kernel against the torch path (kernels.torch_only), with the keys' and values' bytes read a second."""
    from kvcli.engine.model.attention import _one_row_attention

    layers, heads, kv_heads, d = ATTENTION[model]
    for n in counts:
        q = torch.randn(1, heads, 1, d, dtype=torch.bfloat16)
        kv = [(torch.randn(1, kv_heads, n + 256, d, dtype=torch.bfloat16)[:, :, :n],
               torch.randn(1, kv_heads, n + 256, d, dtype=torch.bfloat16)[:, :, :n]) for _ in range(layers)]
        times = {}
        for way, only in (("native", False), ("torch", True)):
            with kernels.torch_only(only):
                times[way] = timed(lambda i: [_one_row_attention(q, k, v, d**-0.5) for k, v in kv], budget=1.0)
        gb = layers * 2 * kv_heads * n * d * 2 / times["native"] / 1e6
        print(f"{model:4s} attention, {layers} layers, {n:6d} keys: native {times['native']:7.2f} ms ({gb:5.1f} GB/s) | "
              f"torch {times['torch']:7.2f} ms | ratio {times['native'] / times['torch']:5.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="0.5b,7b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512, help="rows of a prefill product (0: skip)")
    ap.add_argument("--no-torch-path", action="store_true", help="skip the pure-torch path (slow on 7B shapes)")
    ap.add_argument("--no-output", action="store_true", help="skip the output layer (the largest shape)")
    ap.add_argument("--cold-mb", type=int, default=600, help="weights read between two reads of one (beyond the caches)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", default="", help="counts of rows: time the native kernel against the GEMM path")
    ap.add_argument("--level", type=int, default=None, help="the native kernel's level for --rows (1 avx2, 2 avx-vnni, 3 avx512-vnni)")
    ap.add_argument("--attention", default="", help="counts of keys: time one step's one-row attention, native against torch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention:
        print(f"backend {kernels.backend()}, {args.threads} threads", flush=True)
        for model in args.model.split(","):
            attention_step(model, [int(n) for n in args.attention.split(",")])
        return
    if args.rows:
        print(f"backend {kernels.backend()}, level {args.level or native.level()}, {args.threads} threads", flush=True)
        for model in args.model.split(","):
            rows_against_gemm(model, [int(n) for n in args.rows.split(",")], args.level)
        return
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "backend": kernels.backend(),
              "torch": torch.__version__, "cold_mb": args.cold_mb, "models": {}}
    for model in args.model.split(","):
        spec = SHAPES[model]
        entries = list(spec["linears"]) + ([] if args.no_output else [(*spec["output"], 1 / spec["layers"])])
        rows_out = []
        for name, kind, rows, cols, count in entries:
            r = one_shape(kind, rows, cols, not args.no_torch_path, args.prefill, args.cold_mb << 20)
            r.update(name=name, kind=kind, rows=rows, cols=cols, per_token=count * spec["layers"])
            rows_out.append(r)
            if not args.json:
                line = f"{model:4s} {name:6s} {kind:4s} {rows:6d}x{cols:<5d}"
                for key in ("native", "torch", "int8pack", "int4pack"):
                    ms = r.get(f"{key}_ms")
                    if ms is not None:
                        gb = r.get(f"{key}_bytes", r["bytes"]) / ms / 1e6
                        line += f" | {key} {ms:8.3f} ms {gb:5.1f} GB/s"
                if args.prefill:
                    line += (f" | prefill {args.prefill} rows: native-dequant {r['prefill_native_dequant_ms']:.1f} ms"
                             f" ({r['prefill_gflops_native']:.0f} GFLOP/s)")
                    if "prefill_torch_dequant_ms" in r:
                        line += f", torch-dequant {r['prefill_torch_dequant_ms']:.1f}"
                    line += f", bf16 mm alone {r['prefill_bf16_mm_ms']:.1f}"
                print(line, flush=True)
        totals = {}
        for key in ("native", "torch", "int8pack", "int4pack"):
            if all(f"{key}_ms" in r for r in rows_out):
                totals[key] = sum(r[f"{key}_ms"] * r["per_token"] for r in rows_out)
        result["models"][model] = {"shapes": rows_out, "token_linears_ms": totals}
        if not args.json:
            print(f"{model}: all linear products of one token (one row each): "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in totals.items()), flush=True)
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
