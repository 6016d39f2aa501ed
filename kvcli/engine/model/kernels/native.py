"""The optional native kernels (_native.c), when built: which CPU level they run at, and calls on torch tensors.

Every call here checks what the C code trusts (dtypes, shapes, contiguity) before handing it data pointers."""

from __future__ import annotations

import functools

import torch

from .formats import row_bytes

try:  # after torch: the extension then shares torch's OpenMP runtime (kernels/_native.c)
    from . import _native
except ImportError:  # not built (no compiler at install): the pure-torch path runs
    _native = None

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "F32": 8, "F16": 9, "BF16": 10}
FLOATS = ("F32", "F16", "BF16")  # gemv only (float32 products); the rest also dequantize here
LEVELS = {1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}


@functools.cache
def level() -> int:
    """The best kernel level of this CPU (0: none, the extension missing or the CPU without AVX2/FMA/F16C)."""
    return _native.level() if _native is not None else 0


def runs(kind: str, cols: int) -> bool:
    """Whether gemv runs rows of `cols` weights of `kind` here (float weights: cols a multiple of 8)."""
    return kind in KINDS and level() > 0 and (kind not in FLOATS or cols % 8 == 0)


def dequantizes(kind: str) -> bool:
    """Whether dequantize runs blocks of `kind` here (the quantized kinds)."""
    return kind in KINDS and kind not in FLOATS and level() > 0


def _checked(kind: str, blocks: torch.Tensor, cols: int) -> int:
    """The rows of `blocks`, after checking it holds whole rows of `cols` weights of `kind` where C reads them."""
    if not (kind in KINDS and (kind not in FLOATS or cols % 8 == 0) and blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous()
            and blocks.device.type == "cpu" and blocks.shape[1] == row_bytes(kind, cols)):
        raise ValueError(f"{kind} blocks {blocks.dtype} {tuple(blocks.shape)} are not rows of {cols} weights")
    return blocks.shape[0]


def gemv(kind: str, blocks: torch.Tensor, cols: int, x: torch.Tensor, bias: torch.Tensor | None,
         at: int | None = None) -> torch.Tensor:
    """x [n, cols] (float32 or bfloat16) times the weights of `blocks` [rows, bytes a row] transposed (+ bias
    [rows] float32) -> [n, rows] in x's dtype, with x quantized to 8 bits per block (integer dot products), or for
    float weights in float32 (float32 products)."""
    rows = _checked(kind, blocks, cols)
    if not (x.dim() == 2 and x.shape[1] == cols and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
            and (bias is None or (bias.dtype == torch.float32 and tuple(bias.shape) == (rows,)))):
        raise ValueError(f"gemv: inputs {x.dtype} {tuple(x.shape)} do not fit a {kind} weight of {rows} x {cols}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    _native.gemv(KINDS[kind], blocks.data_ptr(), blocks.shape[1], rows, cols, x.data_ptr(), bf16, x.shape[0],
                 out.data_ptr(), bf16, 0 if bias is None else bias.contiguous().data_ptr(), torch.get_num_threads(),
                 level() if at is None else at)
    return out


def dequantize(kind: str, blocks: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, at: int | None = None) -> torch.Tensor:
    """Rows of blocks [rows, bytes a row] of a quantized kind -> [rows, cols] float32 (gguf's values) or bfloat16
    (those rounded), vectorized at CPU level `at` (default: this CPU's best; 0: the scalar code) where the kind
    has a vector row; every level gives the same bits."""
    if kind in FLOATS:
        raise ValueError(f"dequantize: {kind} is not a quantized kind")
    rows = _checked(kind, blocks, cols)
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype)
    if not (dtype in (torch.float32, torch.bfloat16) and out.dtype == dtype and tuple(out.shape) == (rows, cols)
            and out.is_contiguous() and out.device.type == "cpu"):
        raise ValueError(f"dequantize: output {out.dtype} {tuple(out.shape)} does not fit {rows} x {cols} {dtype}")
    _native.dequantize(KINDS[kind], blocks.data_ptr(), blocks.shape[1], rows, cols, out.data_ptr(),
                       int(dtype == torch.bfloat16), torch.get_num_threads(), level() if at is None else at)
    return out


def attends(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether attend runs these: one batch row and one query row in bfloat16 or float16 on the CPU, grouped
    heads, a head size of 8 to 256 in steps of 8, each key and value row contiguous."""
    return (level() > 0 and query.dim() == key.dim() == value.dim() == 4 and query.shape[0] == key.shape[0] == value.shape[0] == 1
            and query.shape[2] == 1 and query.dtype == key.dtype == value.dtype and query.dtype in (torch.bfloat16, torch.float16)
            and query.device.type == key.device.type == value.device.type == "cpu"
            and key.shape == value.shape and key.shape[1] >= 1 and query.shape[1] % key.shape[1] == 0
            and query.shape[3] == key.shape[3] and 8 <= key.shape[3] <= 256 and key.shape[3] % 8 == 0 and key.shape[2] >= 1
            and key.stride(3) == 1 and value.stride(3) == 1)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row's attention over every key, as transformers' eager attention rounds it (scores and
    probabilities in the dtype, softmax and sums in float32): query [1, heads, 1, d], key/value [1, kv_heads, n, d]
    (views into a longer buffer allowed) -> [1, 1, heads, d]."""
    if not attends(query, key, value):
        raise ValueError(f"attend: query {query.dtype} {tuple(query.shape)}, keys {tuple(key.shape)} are not one row it runs")
    q = query.contiguous()
    heads, kv_heads, n, d = q.shape[1], key.shape[1], key.shape[2], key.shape[3]
    out = torch.empty(1, 1, heads, d, dtype=q.dtype)
    _native.attend(q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), int(q.dtype == torch.float16), heads,
                   kv_heads, n, d, key.stride(1), key.stride(2), value.stride(1), value.stride(2), float(scale),
                   torch.get_num_threads())
    return out
