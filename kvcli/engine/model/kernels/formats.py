"""GGUF block formats read in torch: sizes, and every supported type's dequantization to float32 exactly as gguf's
own dequantizer (`gguf.quants.dequantize`) computes it (the same float32 products and sums, in the same order).

Blocks never cross a row: a tensor of `rows` x `cols` weights is `rows` rows of `cols / BLOCK` blocks of BYTES
bytes each.
"""

from __future__ import annotations

import torch

# kind -> (weights a block, bytes a block)
SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one row of `cols` weights of `kind` (ValueError when cols is not a whole number of blocks)."""
    block, size = SIZES[kind]
    if cols % block:
        raise ValueError(f"{kind}: a row of {cols} weights is not a whole number of {block}-weight blocks")
    return cols // block * size


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block [..., bytes] -> float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: low nibbles first (weights 0-15), then high nibbles (16-31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4 bytes of fifth bits [..., 4] -> [..., 32] bits (bit j of the little-endian word: weight j)."""
    bits = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> bits) & 1).reshape(*qh.shape[:-1], 32)


def k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins [..., 12] -> scales and mins [..., 8] float32."""
    s = s.reshape(*s.shape[:-1], 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 bytes of low nibbles [n, 128] -> [n, 8, 32]: 32-byte run j holds sub-blocks 2j (low) and 2j+1."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def dequantize_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [n, bytes] uint8 -> float32 weights [n, weights a block], bit for bit gguf's values."""
    b = blocks
    n = b.shape[0]
    if kind == "F32":
        return b.contiguous().view(torch.float32).reshape(n, 1)
    if kind == "F16":
        return b.contiguous().view(torch.float16).float().reshape(n, 1)
    if kind == "BF16":
        return b.contiguous().view(torch.bfloat16).float().reshape(n, 1)
    if kind == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)
    if kind in ("Q4_0", "Q4_1"):
        q = _nibbles(b[:, -16:])
        if kind == "Q4_0":
            return _half(b, 0) * (q.to(torch.int8) - 8).float()
        return _half(b, 0) * q.float() + _half(b, 2)
    if kind in ("Q5_0", "Q5_1"):
        q = _nibbles(b[:, -16:]) | (_high_bits(b[:, -20:-16]) << 4)
        if kind == "Q5_0":
            return _half(b, 0) * (q.to(torch.int8) - 16).float()
        return _half(b, 0) * q.float() + _half(b, 2)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = k_scales(b[:, 4:16])
        d = (_half(b, 0) * sc).unsqueeze(-1)  # [n, 8, 1]
        dm = (_half(b, 2) * mn).unsqueeze(-1)
        q = _k_low(b[:, -128:])
        if kind == "Q5_K":
            shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
            q = q | (((b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1) << 4)
        return (d * q.float() - dm).reshape(n, 256)
    if kind == "Q6_K":
        ql = b[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, 8, 32)
        qh = b[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        qh = (qh & 0x03).reshape(n, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        d = _half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
        return (d.unsqueeze(-1) * q).reshape(n, 256)
    raise ValueError(f"unsupported GGUF type {kind}")


def dequantize_rows(kind: str, raw: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows of a tensor's bytes [rows, row_bytes] uint8 -> float32 [rows, cols]."""
    rows = raw.shape[0]
    block, size = SIZES[kind]
    return dequantize_blocks(kind, raw.reshape(rows * (cols // block), size)).reshape(rows, cols)
