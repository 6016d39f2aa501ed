"""PackedLinear and PackedEmbedding: layers on a GGUF tensor's blocks (prepare's tensors), never its float weights."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from . import native
from .formats import dequantize_rows

TILE = 1 << 22  # weights dequantized at a time for a GEMM (8 MiB of bfloat16): the transient such a product adds
# Up to this many rows of x (a question after a restore, a batched step), the native kernel: 8-bit activations,
# integer dots, each weight block unpacked once for four rows. More rows (prefill): bfloat16 GEMMs on tiles
# dequantized natively. The crossovers were measured at each kernel level (tests/bench/bench_kernels.py --rows);
# Q6_K's, near 50 rows, is the latest.
NATIVE_ROWS = {"Q6_K": 48}
NATIVE_ROWS_OTHERS = 32

_TORCH_ONLY: ContextVar[bool] = ContextVar("kvcli_kernels_torch_only", default=False)


@contextmanager
def torch_only(enabled: bool = True) -> Iterator[None]:
    """Within this block (this thread), every layer runs the pure-torch path, as where no native kernel is built."""
    token = _TORCH_ONLY.set(enabled)
    try:
        yield
    finally:
        _TORCH_ONLY.reset(token)


def backend() -> str:
    """The decode kernel layers use here and now: the native kernels' CPU level ("avx512-vnni", "avx-vnni",
    "avx2"), or "torch" (dequantize + GEMM) where they are not built, not supported, or torch_only() holds."""
    return "torch" if _TORCH_ONLY.get() or not native.level() else native.LEVELS[native.level()]


def native_rows(kind: str) -> int:
    """The most rows of x a layer of `kind` multiplies with the native kernel (where it runs); more: GEMMs."""
    return NATIVE_ROWS.get(kind, NATIVE_ROWS_OTHERS)


def _native_here(kind: str, cols: int, allowed: bool) -> bool:
    return allowed and not _TORCH_ONLY.get() and native.runs(kind, cols)


def bf16_product(kind: str, blocks: torch.Tensor, rows: torch.Tensor, cols: int, use_native: bool = False) -> torch.Tensor:
    """x [n, cols] times the weights of `blocks` [out, bytes a row] transposed -> [n, out] bfloat16: the weights
    dequantized to bfloat16 a tile of output rows at a time, each tile one GEMM (oneDNN's bfloat16 kernels)."""
    out = blocks.shape[0]
    x = rows.to(torch.bfloat16)
    y = torch.empty(rows.shape[0], out, dtype=torch.bfloat16)
    step = max(1, TILE // cols)
    tile = torch.empty(min(step, out), cols, dtype=torch.bfloat16) if use_native and native.dequantizes(kind) else None
    for lo in range(0, out, step):
        hi = min(out, lo + step)
        if use_native and native.dequantizes(kind):  # [hi - lo, cols]
            w = native.dequantize(kind, blocks[lo:hi], cols, torch.bfloat16, tile[: hi - lo])
        else:
            w = dequantize_rows(kind, blocks[lo:hi], cols).to(torch.bfloat16)
        torch.mm(x, w.T, out=y[:, lo:hi])
    return y


class PackedLinear(torch.nn.Module):
    """y = x W^T (+ bias) with W a GGUF tensor's blocks of `kind` [rows (out), cols (in)]; x float32 or bfloat16,
    y in x's dtype. Up to native_rows(kind) rows run the native kernel where it is built (`native=False`, or torch_only(),
    keeps the layer on the pure-torch path); more rows, bfloat16 GEMMs on weights dequantized a tile at a time."""

    def __init__(self, kind: str, rows: int, cols: int, tensors: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None, *, native: bool = True):
        super().__init__()
        self.kind, self.out_features, self.in_features, self.native = kind, rows, cols, native
        self.register_buffer("blocks", tensors["blocks"], persistent=False)
        # a buffer, not a parameter: the model's dtype (its first parameter's) stays the activations' dtype
        self.register_buffer("bias", bias.detach().float() if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        use_native = _native_here(self.kind, self.in_features, self.native)
        if use_native and rows.shape[0] <= native_rows(self.kind) and x.dtype in (torch.float32, torch.bfloat16):
            bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
            return native.gemv(self.kind, self.blocks, self.in_features, rows, bias).view(*x.shape[:-1], self.out_features)
        y = bf16_product(self.kind, self.blocks, rows, self.in_features, use_native).float()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class PackedEmbedding(torch.nn.Module):
    """Rows of a GGUF tensor's blocks looked up by id, dequantizing only the rows asked for: ids [...] ->
    [..., cols] in `dtype`. Given the same tensors as a PackedLinear, a tied output layer shares them."""

    def __init__(self, kind: str, rows: int, cols: int, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.kind, self.num_embeddings, self.embedding_dim, self.dtype = kind, rows, cols, dtype
        self.register_buffer("blocks", tensors["blocks"], persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        values = dequantize_rows(self.kind, self.blocks.index_select(0, flat), self.embedding_dim)
        return values.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"
