"""Group quantization of one layer's keys and values (torch in, torch out): the lossy 8-/4-bit storage.

Keys are quantized per channel (each channel's group of `group_size` consecutive tokens shares one
scale and minimum: key channels differ in range by orders of magnitude, tokens within a channel do
not), values per token (each token's group of `group_size` channels shares them), as in KIVI. The
first `exact` stored tokens (attention sinks: every query attends to them heavily) stay in the compute
dtype. Codes are asymmetric: x ~ code * scale + min, code in [0, 2**bits - 1]; 4-bit codes are
packed two per byte (low nibble first). The tensor names, dtypes and shapes come from
payload.quant_layout, so the on-disk layout is decided in one torch-free place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import payload

SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
FP16_SAFE = 60000.0  # a min/scale beyond this would overflow float16: such a cache stores float32 scales


def _groups(x: torch.Tensor, axis: int, group: int) -> Iterator[tuple[torch.Tensor, slice, int]]:
    """(part of x with groups along `axis` unflattened as axis/axis+1, group slice, reduce axis) for the
    full groups and then the partial last group. Parts are views of x (no copy)."""
    n = x.shape[axis]
    full = n // group
    if full:
        yield x.narrow(axis, 0, full * group).unflatten(axis, (full, group)), slice(0, full), axis + 1
    if n % group:
        tail = x.narrow(axis, full * group, n - full * group).unsqueeze(axis)  # one group of n % group
        yield tail, slice(full, full + 1), axis + 1


def _stats_view(stat: torch.Tensor, axis: int, sl: slice) -> torch.Tensor:
    """The stats of the groups in `sl`, shaped to broadcast over the group's members (axis + 1)."""
    return stat.narrow(axis, sl.start, sl.stop - sl.start).unsqueeze(axis + 1)


def quantize(x: torch.Tensor, *, axis: int, group: int, bits: int, scale_dtype: torch.dtype):
    """x [1, heads, tokens, dim] -> (codes uint8 [numel * bits / 8 rounded up], scale, min [stats shape]).

    Groups run along `axis` (2: tokens, for keys per channel; 3: channels, for values per token)."""
    levels = (1 << bits) - 1
    x = x.float()
    stats = payload.stats_shape(x.shape, axis, group)
    lo, hi = torch.empty(stats, dtype=torch.float32), torch.empty(stats, dtype=torch.float32)
    for part, sl, red in _groups(x, axis, group):
        lo.narrow(axis, sl.start, sl.stop - sl.start).copy_(part.amin(red))
        hi.narrow(axis, sl.start, sl.stop - sl.start).copy_(part.amax(red))
    mn = lo.to(scale_dtype)
    scale = ((hi - mn.float()) / levels).to(scale_dtype)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
    codes = torch.empty(x.shape, dtype=torch.uint8)
    for (part, sl, _red), (out, _, _) in zip(_groups(x, axis, group), _groups(codes, axis, group)):
        s, m = _stats_view(scale, axis, sl).float(), _stats_view(mn, axis, sl).float()
        out.copy_(((part - m) / s).round_().clamp_(0, levels))
    return pack(codes.reshape(-1), bits), scale, mn


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 codes -> stored bytes: as they are for 8 bits, two per byte (low nibble first) for 4."""
    if bits == 8:
        return codes
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Stored bytes -> flat uint8 codes (numel of them)."""
    if bits == 8:
        return data[:numel]
    out = torch.empty((data.numel(), 2), dtype=torch.uint8)
    torch.bitwise_and(data, 15, out=out[:, 0])
    torch.bitwise_right_shift(data, 4, out=out[:, 1])
    return out.view(-1)[:numel]


def dequantize_into(dst: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, *, axis: int,
                    group: int, bits: int) -> None:
    """Write code * scale + min into dst [1, heads, tokens, dim] (may be a view with room after it).

    Done a group block at a time in dst's own dtype: uint8 codes are converted straight into dst, then
    scaled and shifted in place, so nothing as large as dst is allocated besides the unpacked codes."""
    flat = unpack(codes, bits, dst.numel()).view(dst.shape)  # [1, heads, tokens, dim] uint8
    s_all, m_all = scale.to(dst.dtype), mn.to(dst.dtype)
    for (out, sl, _), (src, _, _) in zip(_groups(dst, axis, group), _groups(flat, axis, group)):
        out.copy_(src)
        out.mul_(_stats_view(s_all, axis, sl)).add_(_stats_view(m_all, axis, sl))


def axes(name: str) -> int:
    """The grouping axis of a [1, heads, tokens, dim] tensor: keys per channel (groups of tokens), values per token."""
    return 2 if name == "keys" else 3


def quantize_layer(keys: torch.Tensor, values: torch.Tensor, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One layer's keys/values ([1, heads, tokens, dim] each) -> the named payload tensors, in layout order."""
    bits, group = spec["bits"], spec["group_size"]
    sdtype = SCALE_DTYPES[spec["scale_dtype"]]
    out: dict[str, torch.Tensor] = {}
    for name, t in (("keys", keys), ("values", values)):
        first, mid, last = payload.quant_split(t.shape[2], spec)
        codes, scale, mn = quantize(t[:, :, first:first + mid], axis=axes(name), group=group, bits=bits, scale_dtype=sdtype)
        out[f"{name}.exact"] = t[:, :, :first].contiguous()  # [1, heads, first, dim] in the compute dtype
        if spec.get("recent_tokens", 0) > 0:
            out[f"{name}.recent"] = t[:, :, first + mid:].contiguous()  # [1, heads, last, dim] in the compute dtype
        out[f"{name}.codes"] = codes
        out[f"{name}.scale"] = scale.contiguous()
        out[f"{name}.min"] = mn.contiguous()
    layout = payload.quant_layout(str(keys.dtype).removeprefix("torch."), tuple(keys.shape), tuple(values.shape), spec)
    assert [e.name for e in layout] == list(out), "quantize_layer and payload.quant_layout disagree"
    return out


def dequantize_layer(read: Callable[[str, torch.Tensor], None], out: tuple[torch.Tensor, torch.Tensor],
                     spec: dict[str, Any], *, where: str = "shard") -> None:
    """Fill out = (keys, values) from the payload tensors, which `read(name, buffer)` fills in layout order.

    Exact tokens (first and last) land straight in their place; codes and scales go through buffers sized
    by the layout, then are dequantized into the tokens between, a group block at a time."""
    from ..errors import CacheCorruptError

    bits, group = spec["bits"], spec["group_size"]
    sdtype = SCALE_DTYPES[spec["scale_dtype"]]
    for name, dst in zip(("keys", "values"), out):
        first, mid, last = payload.quant_split(dst.shape[2], spec)
        read(f"{name}.exact", dst[:, :, :first])
        if spec.get("recent_tokens", 0) > 0:
            read(f"{name}.recent", dst[:, :, first + mid:first + mid + last])
        rest = dst[:, :, first:first + mid]
        packed = torch.empty(payload.code_bytes(rest.numel(), bits), dtype=torch.uint8)
        read(f"{name}.codes", packed)
        stats = payload.stats_shape(rest.shape, axes(name), group)
        scale, mn = torch.empty(stats, dtype=sdtype), torch.empty(stats, dtype=sdtype)
        read(f"{name}.scale", scale)
        read(f"{name}.min", mn)
        if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(mn).all())):
            raise CacheCorruptError(f"{where}: {name} scales or minimums are not finite")
        dequantize_into(rest, packed, scale, mn, axis=axes(name), group=group, bits=bits)


def choose_scale_dtype(tensors) -> str:
    """float16 scales (half the overhead) unless some value is too large for them; ValueError for
    non-finite keys/values (no scale represents them: such a cache can only be stored losslessly)."""
    choice = "float16"
    for t in tensors:
        if not t.numel():
            continue
        top = float(t.detach().abs().amax())
        if top != top or top == float("inf"):
            raise ValueError("the cache holds non-finite keys/values, which cannot be quantized; store it losslessly")
        if top > FP16_SAFE / 2:
            choice = "float32"
    return choice
