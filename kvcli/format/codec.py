"""Layer tensors <-> stored shard bytes: safetensors inside zstandard, with a lossless byte-plane split.

Byte planes: a float tensor's bytes are regrouped so that byte k of every element comes together
([numel, itemsize] -> [itemsize, numel]). Exponent bytes then sit side by side and zstd finds far more
to compress than in interleaved floats. The transform is recorded per cache ("none" or "byteplane");
caches written before transforms existed have no transform key anywhere and read as "none".

Encoding builds the container with the safetensors library (safetensors.torch.save). Decoding
streams each shard once instead of materialising the whole payload first: the header is read and checked first, then every tensor is
decompressed straight into its final memory ("none"), or a slice of one byte plane at a time into a
scratch (1 MiB) that is scattered into byte k of each element ("byteplane"). zstandard, numpy copies and
hashing release the GIL, so layers decode in parallel threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import struct

import numpy as np
import torch
import zstandard

from . import dtypes, payload

TRANSFORMS = ("none", "byteplane")
# Lossless storage settings by what they are for: "small" (byte planes, zstd level 1) stores float32 caches at
# about 0.83 of raw and bfloat16 ones at about 0.7; "fast" (plain bytes, zstd level -1) stores near raw size and
# decompresses several times faster, for caches restored where cores, not disks, are the limit (a GPU host
# restoring from the page cache). Measured: docs/performance.md, "Storage for speed or size".
COMPRESSION = {"small": ("byteplane", 1), "fast": ("none", -1)}  # name -> (transform, zstd level)
DEFAULT_COMPRESSION = "small"


def compression_spec(name: str) -> tuple[str, int]:
    """(transform, zstd level) of a setting; UsageError naming the choices for any other name."""
    if name not in COMPRESSION:
        from ..errors import UsageError

        raise UsageError(f"--compression {name}: choose {' or '.join(COMPRESSION)}")
    return COMPRESSION[name]


def compression_name(transform: str, level: int | None) -> str | None:
    """The setting a cache's transform and level are, or None for another combination."""
    return next((name for name, spec in COMPRESSION.items() if spec == (transform, level)), None)
DTYPES = {name: getattr(torch, name) for name in dtypes.DTYPES}  # stored dtype name -> torch dtype
PLANE_CHUNK = 1 << 20  # bytes of one plane decompressed per step when undoing byte planes: no slower than smaller
# reads (tests/bench/bench_restore.py); the scatter is a flat strided copy


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class EncodedLayer:
    data: bytes  # what goes on disk
    raw_bytes: int  # bytes of keys + values as tensors
    decoded_bytes: int  # size of the safetensors payload inside the zstd frame


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The memory of a CPU tensor as a numpy uint8 array [*shape[:-1], shape[-1] * itemsize] (no copy).

    Works for strided tensors too, as long as the last dimension is contiguous (kvcli's restore buffers
    are views with room for more tokens after each head's block)."""
    if t.device.type != "cpu" or (t.dim() and t.stride(-1) != 1):
        raise ValueError("expected a CPU tensor whose last dimension is contiguous")
    return t.detach().view(torch.uint8).numpy()


def _planes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes regrouped as U8 [itemsize, numel]: row k holds byte k of every element."""
    item, n = t.element_size(), t.numel()
    out = torch.empty((item, n), dtype=torch.uint8)
    if n:
        planes, elems = out.numpy(), _byte_view(t.contiguous()).reshape(n, item)
        for k in range(item):  # one strided gather per plane
            planes[k] = elems[:, k]
    return out


def _in_order(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file with the tensors' data in the given order (the library sorts by dtype, but a
    quantized shard is streamed part by part in payload.quant_layout's order, so that order is the format)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtypes.SAFETENSORS.get(dtype_name(t.dtype), "U8"), "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    parts = [struct.pack("<Q", len(head)), head]
    parts += [_byte_view(t.contiguous()).tobytes() if t.numel() else b"" for t in tensors.values()]
    return b"".join(parts)


def encode_layer(keys: torch.Tensor, values: torch.Tensor, *, transform: str, level: int,
                 quant: dict | None = None) -> EncodedLayer:
    """Compress one layer's keys and values ([batch, kv_heads, seq, head_dim] each); with `quant` (the
    manifest's compression.quant block) they are group-quantized first (format/quant.py)."""
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}")
    from safetensors.torch import save

    meta = {"transform": transform, "dtype": dtype_name(keys.dtype)}
    if quant is not None:  # lossy storage: the quantized parts, stored plain
        from . import quant as qt

        meta["kv_bits"] = str(quant["bits"])
        payload = _in_order(qt.quantize_layer(keys, values, quant), meta)
    else:
        layout = _planes if transform == "byteplane" else torch.Tensor.contiguous
        payload = save({"keys": layout(keys), "values": layout(values)}, metadata=meta)  # written by the safetensors library
    data = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    raw = keys.numel() * keys.element_size() + values.numel() * values.element_size()
    return EncodedLayer(data=data, raw_bytes=raw, decoded_bytes=len(payload))


def _blocks(t: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """t's bytes as numpy [blocks, rows, row_bytes], plus rows and elements per row, without copying.

    Each block ([.., seq, head_dim] of one head) is contiguous; blocks may sit apart (room between heads)."""
    if t.dim() < 2:
        t = t.reshape(1, -1)
    arr = _byte_view(t)
    rows, cols = t.shape[-2], t.shape[-1]
    return arr.reshape((-1, rows, arr.shape[-1]), copy=False), rows, cols  # raises rather than copy


def _read_plain(src: payload.PayloadReader, dst: torch.Tensor) -> None:
    """Decompress a tensor's bytes straight into its final memory."""
    blocks, _rows, _cols = _blocks(dst)
    if blocks.flags.c_contiguous:
        src.readinto(blocks)
        return
    for block in blocks:
        if block.flags.c_contiguous:
            src.readinto(block)
        else:  # rows apart from each other: one row at a time
            for row in block:
                src.readinto(row)


def _read_planes(src: payload.PayloadReader, dst: torch.Tensor) -> None:
    """Undo the byte-plane split into the final memory: plane k is decompressed PLANE_CHUNK bytes at a time into
    a scratch buffer and scattered into byte k of each element. The chunks run across head blocks, so zstd
    fills large buffers, and each block is written as one flat [elements, itemsize] array."""
    item = dst.element_size()
    blocks, rows, cols = _blocks(dst)  # [blocks, rows, cols * item]
    if blocks.size == 0:
        return
    per = rows * cols  # elements per block
    try:
        flat = [b.reshape((per, item), copy=False) for b in blocks]  # rows of a block side by side
    except ValueError:  # rows apart from each other: row by row
        flat = [row.reshape((cols, item), copy=False) for b in blocks for row in b]
        per = cols
    total = per * len(flat)
    scratch = np.empty(min(PLANE_CHUNK, total), dtype=np.uint8)
    for k in range(item):
        pos = 0
        while pos < total:
            n = min(len(scratch), total - pos)
            part = np.frombuffer(src.take(n, scratch), dtype=np.uint8)
            done = 0
            while done < n:  # the chunk's pieces, block by block
                b, off = divmod(pos + done, per)
                m = min(per - off, n - done)
                flat[b][off : off + m, k] = part[done : done + m]
                done += m
            pos += n


def decode_layer(
    data,
    *,
    name: str,
    transform: str,
    dtype: torch.dtype,
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    decoded_bytes: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    quant: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of encode_layer, checking every name, dtype, shape and offset against what is expected.

    `data` is the stored bytes (already checked against the manifest's sha256), or a store.ShardStream (hashed
    as it is read: the caller verifies it before using `out`). The payload is streamed: its header is read
    and checked first, then each tensor is decompressed
    straight into its destination (`out`, else fresh tensors). `out` tensors must have the expected
    shapes and dtype, live on the CPU and be contiguous per [seq, head_dim] block (views of larger
    buffers with room for more tokens are fine). Nothing larger than a small scratch is allocated
    (a payload of up to payload.WHOLE_BELOW bytes is held whole).
    With `quant` (the manifest's compression.quant) the parts are dequantized into `out` (format/quant.py).
    """
    payload.check_declared_size(data, decoded_bytes, name)  # before allocating anything
    expected = {"keys": tuple(key_shape), "values": tuple(value_shape)}
    if out is None:
        out = (torch.empty(expected["keys"], dtype=dtype), torch.empty(expected["values"], dtype=dtype))
    for t, shape in zip(out, expected.values()):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"destination {tuple(t.shape)} {t.dtype} does not match {shape} {dtype}")
    with payload.PayloadReader(data, where=name, transform=transform, dtype=dtype_name(dtype), key_shape=expected["keys"],
                               value_shape=expected["values"], decoded_bytes=decoded_bytes, quant=quant) as src:
        if quant is not None:  # 8-/4-bit: the parts streamed in layout order (one may hold nothing), dequantized into out
            from . import quant as qt

            qt.dequantize_layer(lambda _part, buf: _read_plain(src, buf) if buf.numel() else None, out, quant, where=name)
        else:
            read = _read_planes if transform == "byteplane" else _read_plain
            for t in out:  # in payload order: keys, then values
                read(src, t)
        src.finish()
    return out[0], out[1]
