"""Linear and embedding layers that run a GGUF tensor's own blocks, and the functions that make their tensors.

The contract with the loader (it stores `prepare`'s tensors, keyed on LAYOUT_VERSION, and maps them back):
- `supported(kind)`: whether a GGUF type (its name: "Q4_K", "Q6_K", "F16", ...) runs here.
- `prepare(kind, raw, rows, cols)`: a tensor's bytes [rows, bytes a row] uint8 (rows in the file's order) -> the
  layers' tensors, plain CPU tensors; a pure function of the bytes.
- `dequantize(kind, tensors, rows, cols)`: float32 [rows, cols], exactly gguf's values.
- `PackedLinear` and `PackedEmbedding` (modules.py) on those tensors; `backend()` names the decode kernel in use.
Few rows (decoding, a question's tokens) run the native integer-dot kernel where it is built; otherwise, and for many rows (prefill),
the weights are dequantized to bfloat16 a tile at a time for one GEMM each, never kept.
"""

from __future__ import annotations

import torch

from .formats import SIZES, dequantize_rows, row_bytes
from .modules import PackedEmbedding, PackedLinear, backend, torch_only

LAYOUT_VERSION = 1

__all__ = ["LAYOUT_VERSION", "PackedEmbedding", "PackedLinear", "backend", "dequantize", "prepare", "supported",
           "torch_only"]


def supported(kind: str) -> bool:
    """Whether GGUF type `kind` (its name) runs on these layers."""
    return kind in SIZES


def _check(kind: str, raw: torch.Tensor, rows: int, cols: int) -> None:
    if not supported(kind):
        raise ValueError(f"GGUF type {kind} is not supported by kvcli's kernels")
    want = (rows, row_bytes(kind, cols))
    if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
        raise ValueError(f"{kind} tensor of {rows} x {cols}: expected uint8 bytes of shape {want}, "
                         f"got {raw.dtype} {tuple(raw.shape)}")


def prepare(kind: str, raw: torch.Tensor, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """A tensor's bytes [rows, bytes a row] uint8 -> the tensors PackedLinear, PackedEmbedding and dequantize take
    (ValueError for a type not supported or bytes of the wrong shape)."""
    _check(kind, raw, rows, cols)
    return {"blocks": raw.contiguous()}


def dequantize(kind: str, tensors: dict[str, torch.Tensor], rows: int, cols: int) -> torch.Tensor:
    """prepare's tensors -> the weights [rows, cols] float32, bit for bit as gguf dequantizes the file's bytes."""
    _check(kind, tensors["blocks"], rows, cols)
    return dequantize_rows(kind, tensors["blocks"], cols)
