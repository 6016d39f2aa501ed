"""Make a GGUF file of a 7B model's shapes without a download (benchmark asset, not collected by pytest).

    python tests/bench/make_gguf.py --out DIR [--like SMALL.gguf] [--layers 28] [--keep-f16]

Writes Qwen2.5-7B's shapes (28 layers, hidden 3584, 28 heads, 4 key/value heads, intermediate 18944, vocabulary
152064) as an F16 file with gguf-py, one tensor at a time (random weights, std 0.02; norms 1), with the tokenizer
and chat template of a small file of the same family (--like, default the 0.5B Qwen2.5-Coder), its token list
padded to the vocabulary as Qwen's converter pads it. Then llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`, run by $KVCLI_LLAMACPP_PYTHON, default /opt/kvcli-llamacpp-venv/bin/python) turns it into
Q4_K_M, the file people download. Its answers are noise; its bytes, shapes and kernels are those of a real 7B.
Prints the path of the Q4_K_M file. --layers makes a shallower model of the same widths (quicker checks).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LIKE = Path("/work/scratch/models/qwen2.5-coder-0.5b-instruct.gguf")
SHAPE = {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944, "vocab": 152064,
         "context": 32768, "rope_base": 1000000.0, "eps": 1e-6}
QUANTIZE = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def tensors(s: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape [rows, cols], is a norm) in the order llama.cpp's converter writes them."""
    h, kv = s["hidden"], s["hidden"] // s["heads"] * s["kv_heads"]
    out = [("token_embd.weight", (s["vocab"], h), False), ("output_norm.weight", (h,), True),
           ("output.weight", (s["vocab"], h), False)]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), True), (b + "attn_q.weight", (h, h), False), (b + "attn_q.bias", (h,), False),
                (b + "attn_k.weight", (kv, h), False), (b + "attn_k.bias", (kv,), False),
                (b + "attn_v.weight", (kv, h), False), (b + "attn_v.bias", (kv,), False),
                (b + "attn_output.weight", (h, h), False), (b + "ffn_norm.weight", (h,), True),
                (b + "ffn_gate.weight", (s["intermediate"], h), False), (b + "ffn_up.weight", (s["intermediate"], h), False),
                (b + "ffn_down.weight", (h, s["intermediate"]), False)]
    return out


def copy_tokenizer(writer, like: Path, vocab: int) -> None:
    """The tokenizer.* keys of `like`, its token list padded to `vocab` ([PADn], unused) as Qwen's converter does."""
    import gguf

    reader = gguf.GGUFReader(str(like))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)


def write_f16(path: Path, s: dict, like: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("Qwen2.5-7B-shaped random weights")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_base"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(writer, like, s["vocab"])
    plan = tensors(s)
    for name, shape, norm in plan:
        f16 = len(shape) == 2
        dtype = np.float16 if f16 else np.float32
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 26, dtype=np.float32) * 0.02).astype(np.float16)  # 128 MB of weights, reused
    for name, shape, norm in plan:
        n = int(np.prod(shape))
        if norm:
            data = np.ones(shape, np.float32)
        elif len(shape) == 1:
            data = (rng.standard_normal(n, dtype=np.float32) * 0.02).reshape(shape)
        else:  # the pool from a random start, cyclically: as random as the quantizer can tell, without 7B normals
            start = int(rng.integers(0, pool.size))
            data = np.resize(np.roll(pool, -start), n).reshape(shape)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--like", type=Path, default=LIKE)
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep-f16", action="store_true")
    args = ap.parse_args()
    s = {**SHAPE, "layers": args.layers}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "qwen2.5-7b-shape" + ("" if args.layers == SHAPE["layers"] else f"-{args.layers}l")
    f16, q4 = args.out / f"{stem}-f16.gguf", args.out / f"{stem}-q4_k_m.gguf"
    if q4.is_file():
        print(q4)
        return
    t = time.perf_counter()
    if not f16.is_file():
        tmp = f16.with_name(f".{f16.name}.tmp")
        write_f16(tmp, s, args.like)
        os.replace(tmp, f16)
    print(f"make_gguf: F16 {f16.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    t = time.perf_counter()
    python = os.environ.get("KVCLI_LLAMACPP_PYTHON", "/opt/kvcli-llamacpp-venv/bin/python")
    tmp = q4.with_name(f".{q4.name}.tmp")
    subprocess.run([python, "-c", QUANTIZE, str(f16), str(tmp), str(args.threads)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.replace(tmp, q4)
    print(f"make_gguf: Q4_K_M {q4.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not args.keep_f16:
        f16.unlink()
    print(q4)


if __name__ == "__main__":
    main()
