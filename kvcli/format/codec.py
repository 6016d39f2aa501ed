"""Layer tensors <-> stored shard bytes: safetensors inside zstandard, with a lossless byte-plane split.

Byte planes: a float tensor's bytes are regrouped so that byte k of every element comes together
([numel, itemsize] -> [itemsize, numel]). Exponent bytes then sit side by side and zstd finds far more
to compress than in interleaved floats. The transform is recorded per cache ("none" or "byteplane");
caches written before transforms existed have no transform key anywhere and read as "none".

Decoding streams each shard once: the header is read and checked first, then every tensor is
decompressed straight into its final memory ("none"), or a slice of one byte plane at a time into a
small scratch that is scattered into byte k of each element ("byteplane"). zstandard, numpy copies and
hashing release the GIL, so layers decode in parallel threads.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from . import payload
from ..errors import CacheCorruptError

TRANSFORMS = ("none", "byteplane")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}
CHUNK_ELEMS = 1 << 18  # elements decompressed per step when undoing byte planes: the scratch stays in L2 cache


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


def _payload(tensors: dict[str, torch.Tensor], metadata: dict[str, str], transform: str) -> np.ndarray:
    """The safetensors bytes (as safetensors.torch.save lays them out) built in one buffer.

    With byteplane each tensor is stored as U8 [itemsize, numel]: row k holds byte k of every element.
    Every byte is copied exactly once, straight to its place in the buffer."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        shape = [t.element_size(), t.numel()] if transform == "byteplane" else list(t.shape)
        dtype = "U8" if transform == "byteplane" else _ST_DTYPE[t.dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    out = np.empty(8 + len(head) + offset, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(head)), dtype=np.uint8)
    out[8 : 8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = 8 + len(head)
    for t in tensors.values():
        src = _byte_view(t.contiguous()).reshape(-1)
        n, item = src.size, t.element_size()
        if transform == "byteplane" and n:
            planes, elems = out[pos : pos + n].reshape(item, n // item), src.reshape(n // item, item)
            for k in range(item):  # one strided gather per plane
                planes[k] = elems[:, k]
        else:
            out[pos : pos + n] = src
        pos += n
    return out


def encode_layer(keys: torch.Tensor, values: torch.Tensor, *, transform: str, level: int) -> EncodedLayer:
    """Compress one layer's keys and values ([batch, kv_heads, seq, head_dim] each)."""
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}")
    meta = {"transform": transform, "dtype": dtype_name(keys.dtype)}
    payload = _payload({"keys": keys, "values": values}, meta, transform)
    data = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    raw = keys.numel() * keys.element_size() + values.numel() * values.element_size()
    return EncodedLayer(data=data, raw_bytes=raw, decoded_bytes=int(payload.size))


class _Exact:
    """Reads a zstd stream into caller-given buffers, exactly `size` bytes in all: more or less is corruption."""

    def __init__(self, reader, size: int, name: str):
        self.reader, self.size, self.name, self.got = reader, size, name, 0

    def readinto(self, buf: np.ndarray) -> None:
        view = memoryview(buf).cast("B")
        if self.got + len(view) > self.size:
            raise CacheCorruptError(f"{self.name}: safetensors payload runs past the {self.size} bytes the manifest gives")
        done = 0
        while done < len(view):
            n = self.reader.readinto(view[done:])
            if n == 0:
                raise CacheCorruptError(f"{self.name}: decompresses to {self.got + done} bytes, manifest says {self.size}")
            done += n
        self.got += done

    def finish(self) -> None:
        if self.got != self.size or self.reader.read(1):
            raise CacheCorruptError(f"{self.name}: decompresses to more bytes, manifest says {self.size}")


def _read_header(src: _Exact, *, name: str, transform: str, dtype: torch.dtype, key_shape, value_shape) -> None:
    """Read the safetensors header and check it against the manifest (payload.check_header's rules)."""
    first = np.empty(8, dtype=np.uint8)
    if src.size < 8:
        raise CacheCorruptError(f"{name}: payload too short for a safetensors header")
    src.readinto(first)
    n = payload.header_length(first.tobytes(), src.size, name)
    raw = np.empty(n, dtype=np.uint8)
    src.readinto(raw)
    payload.check_header(raw.tobytes(), where=name, transform=transform, dtype=dtype_name(dtype),
                         key_shape=key_shape, value_shape=value_shape, decoded_bytes=src.size)


def _blocks(t: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """t's bytes as numpy [blocks, rows, row_bytes], plus rows and elements per row, without copying.

    Each block ([.., seq, head_dim] of one head) is contiguous; blocks may sit apart (room between heads)."""
    if t.dim() < 2:
        t = t.reshape(1, -1)
    arr = _byte_view(t)
    rows, cols = t.shape[-2], t.shape[-1]
    return arr.reshape((-1, rows, arr.shape[-1]), copy=False), rows, cols  # raises rather than copy


def _read_plain(src: _Exact, dst: torch.Tensor) -> None:
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


def _read_planes(src: _Exact, dst: torch.Tensor) -> None:
    """Undo the byte-plane split into the final memory: plane k is decompressed a slice at a time into a
    small scratch buffer (which stays in cache) and scattered into byte k of each element."""
    item = dst.element_size()
    blocks, rows, cols = _blocks(dst)
    if blocks.size == 0:
        return
    elems = blocks.reshape((blocks.shape[0], rows, cols, item), copy=False)  # only the last axis is split
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    scratch = np.empty(min(step, rows) * cols, dtype=np.uint8)
    for k in range(item):
        for block in elems:
            for r in range(0, rows, step):
                n = min(step, rows - r)
                part = scratch[: n * cols]
                src.readinto(part)
                block[r : r + n, :, k] = part.reshape(n, cols)


def decode_layer(
    data: bytes | memoryview,
    *,
    name: str,
    transform: str,
    dtype: torch.dtype,
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    decoded_bytes: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of encode_layer, checking every name, dtype, shape and offset against what is expected.

    `data` is the stored bytes (already checked against the manifest's sha256). The payload is streamed: its header is read and checked first, then each tensor is decompressed
    straight into its destination (`out`, else fresh tensors). `out` tensors must have the expected
    shapes and dtype, live on the CPU and be contiguous per [seq, head_dim] block (views of larger
    buffers with room for more tokens are fine). Nothing larger than a small scratch is allocated.
    """
    payload.check_declared_size(data, decoded_bytes, name)  # before allocating anything
    expected = {"keys": tuple(key_shape), "values": tuple(value_shape)}
    if out is None:
        out = (torch.empty(expected["keys"], dtype=dtype), torch.empty(expected["values"], dtype=dtype))
    for t, shape in zip(out, expected.values()):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"destination {tuple(t.shape)} {t.dtype} does not match {shape} {dtype}")
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
            src = _Exact(reader, decoded_bytes, name)
            _read_header(src, name=name, transform=transform, dtype=dtype, key_shape=expected["keys"], value_shape=expected["values"])
            for t in out:  # in payload order: keys, then values
                if transform == "byteplane":
                    _read_planes(src, t)
                else:
                    _read_plain(src, t)
            src.finish()
    except zstandard.ZstdError as exc:
        raise CacheCorruptError(f"{name}: not a valid zstandard stream ({exc})") from None
    return out[0], out[1]
