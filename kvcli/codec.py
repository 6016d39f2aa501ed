"""Layer tensors <-> stored shard bytes: safetensors inside zstandard, with a lossless byte-plane split.

Byte planes: a float tensor's bytes are regrouped so that byte k of every element comes together
([numel, itemsize] -> [itemsize, numel]). Exponent bytes then sit side by side and zstd finds far more
to compress than in interleaved floats. The transform is recorded per cache ("none" or "byteplane").
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
import zstandard

from .errors import CacheCorruptError

TRANSFORMS = ("none", "byteplane")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}
MAX_HEADER = 64 * 1024  # a shard's safetensors header is a few hundred bytes; anything bigger is hostile


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class EncodedLayer:
    data: bytes  # what goes on disk
    raw_bytes: int  # bytes of keys + values as tensors
    decoded_bytes: int  # size of the safetensors payload inside the zstd frame


def _planes(t: torch.Tensor) -> torch.Tensor:
    """[..] float -> [itemsize, numel] uint8, byte k of every element in row k."""
    flat = t.contiguous().view(-1).view(torch.uint8).view(t.numel(), t.element_size())
    return flat.t().contiguous()


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Serialise like safetensors.torch.save, without an intermediate copy of each tensor."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    parts = [struct.pack("<Q", len(head)), head]
    parts += [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values()]
    return b"".join(parts)


def encode_layer(keys: torch.Tensor, values: torch.Tensor, *, transform: str, level: int) -> EncodedLayer:
    """Compress one layer's keys and values ([batch, kv_heads, seq, head_dim] each)."""
    if transform not in TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}")
    meta = {"transform": transform, "dtype": dtype_name(keys.dtype)}
    if transform == "byteplane":
        tensors = {"keys": _planes(keys), "values": _planes(values)}
    else:
        tensors = {"keys": keys.contiguous(), "values": values.contiguous()}
    payload = _safetensors_bytes(tensors, meta)
    data = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(payload)
    raw = keys.numel() * keys.element_size() + values.numel() * values.element_size()
    return EncodedLayer(data=data, raw_bytes=raw, decoded_bytes=len(payload))


def _decompress_exact(data: bytes | memoryview, size: int, name: str) -> torch.Tensor:
    """Decompress into a fresh uint8 tensor of exactly `size` bytes; more or less is corruption."""
    _check_declared_size(data, size, name)  # before allocating anything
    out = torch.empty(size, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")
    try:
        with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=False) as reader:
            got = 0
            while got < size:
                n = reader.readinto(view[got:])
                if n == 0:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CacheCorruptError(f"{name}: not a valid zstandard stream ({exc})") from None
    if got != size or extra:
        raise CacheCorruptError(f"{name}: decompresses to {'more' if extra else got} bytes, manifest says {size}")
    return out


def _check_declared_size(data: bytes | memoryview, size: int, name: str) -> None:
    """A zstd frame that declares a content size other than the manifest's is refused unread (zip-bomb guard)."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise CacheCorruptError(f"{name}: not a zstandard frame") from None
    if declared >= 0 and declared != size:
        raise CacheCorruptError(f"{name}: declares {declared} decompressed bytes, manifest says {size}")


def _parse_header(buf: torch.Tensor, name: str) -> tuple[dict, int]:
    if buf.numel() < 8:
        raise CacheCorruptError(f"{name}: payload too short for a safetensors header")
    (n,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if n > MAX_HEADER or 8 + n > buf.numel():
        raise CacheCorruptError(f"{name}: safetensors header of {n} bytes does not fit")
    try:
        header = json.loads(buf[8 : 8 + n].numpy().tobytes())
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSONDecodeError, huge int literals
        raise CacheCorruptError(f"{name}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CacheCorruptError(f"{name}: safetensors header is not an object")
    return header, 8 + n


def decode_layer(
    data: bytes | memoryview,
    *,
    name: str,
    transform: str,
    dtype: torch.dtype,
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    decoded_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of encode_layer, checking every name, dtype, shape and offset against what is expected."""
    buf = _decompress_exact(data, decoded_bytes, name)
    header, start = _parse_header(buf, name)
    item = torch.empty((), dtype=dtype).element_size()
    expected = {"keys": key_shape, "values": value_shape}
    if set(header) - {"__metadata__"} != set(expected):
        raise CacheCorruptError(f"{name}: holds tensors {sorted(header)}, expected keys and values")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("transform", "none") != transform:
        raise CacheCorruptError(f"{name}: transform in shard does not match the manifest")
    if meta.get("dtype", dtype_name(dtype)) != dtype_name(dtype):  # byte planes are U8: only this tells bf16 from f16
        raise CacheCorruptError(f"{name}: dtype in shard does not match the manifest")
    out = []
    end_prev = 0
    for tname in ("keys", "values"):
        entry, shape = header[tname], expected[tname]
        numel = 1
        for s in shape:
            numel *= s
        if transform == "byteplane":
            want = ("U8", [item, numel])
        else:
            want = (_ST_DTYPE[dtype], list(shape))
        if not isinstance(entry, dict) or (entry.get("dtype"), entry.get("shape")) != want:
            raise CacheCorruptError(f"{name}: {tname} has dtype/shape {repr(entry)[:200]}, expected {want}")
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CacheCorruptError(f"{name}: {tname} data offsets are malformed")
        begin, end = offsets
        if begin != end_prev or end != begin + numel * item:
            raise CacheCorruptError(f"{name}: {tname} data offsets are inconsistent")
        end_prev = end
        raw = buf[start + begin : start + end]
        if transform == "byteplane":
            planes = raw.view(item, numel)
            t = torch.empty(numel, item, dtype=torch.uint8)
            for k in range(item):  # one strided copy per plane: far faster than a transposing copy
                t[:, k].copy_(planes[k])
            out.append(t.view(-1).view(dtype).view(shape))
        else:
            out.append(raw.view(dtype).view(shape))
    if start + end_prev != buf.numel():
        raise CacheCorruptError(f"{name}: trailing bytes after the tensors")
    return out[0], out[1]
