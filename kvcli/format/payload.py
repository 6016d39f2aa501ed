"""The layout of a shard's payload, checked without torch: shared by restore (codec) and verify (store).

A shard is one zstd frame of a safetensors file holding "keys" and "values". These rules decide
whether its frame and header are exactly what the manifest describes.
"""

from __future__ import annotations

import json
import struct

import zstandard

from ..errors import CacheCorruptError

ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
ITEM_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_HEADER = 64 * 1024  # a shard's safetensors header is a few hundred bytes; anything bigger is hostile


def check_declared_size(data: bytes | memoryview, size: int, where: str) -> None:
    """A zstd frame that declares a content size other than the manifest's is refused unread (bomb guard)."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise CacheCorruptError(f"{where}: not a zstandard frame") from None
    if declared >= 0 and declared != size:
        raise CacheCorruptError(f"{where}: declares {declared} decompressed bytes, manifest says {size}")


def header_length(first8: bytes, decoded_bytes: int, where: str) -> int:
    """The safetensors header length from the payload's first 8 bytes, refused if it cannot fit."""
    if len(first8) < 8:
        raise CacheCorruptError(f"{where}: decompresses to {len(first8)} bytes, manifest says {decoded_bytes}")
    (n,) = struct.unpack("<Q", first8)
    if n > MAX_HEADER or 8 + n > decoded_bytes:
        raise CacheCorruptError(f"{where}: safetensors header of {n} bytes does not fit")
    return n


def check_header(raw: bytes, *, where: str, transform: str, dtype: str, key_shape, value_shape, decoded_bytes: int) -> None:
    """The header must name exactly keys and values, with the expected dtype, shape and adjacent offsets."""

    def bad(what: str) -> CacheCorruptError:
        return CacheCorruptError(f"{where}: {what}")

    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSONDecodeError, huge int literals
        raise bad("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("safetensors header is not an object")
    expected = {"keys": tuple(key_shape), "values": tuple(value_shape)}
    if set(header) - {"__metadata__"} != set(expected):
        raise bad(f"holds tensors {sorted(header)[:8]}, expected keys and values")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("transform", "none") != transform:
        raise bad("transform in shard does not match the manifest")
    if meta.get("dtype", dtype) != dtype:  # byte planes are U8: only this tells bf16 from f16
        raise bad("dtype in shard does not match the manifest")
    item = ITEM_SIZES[dtype]
    end_prev = 0
    for name, shape in expected.items():
        entry = header[name]
        numel = 1
        for s in shape:
            numel *= s
        want = ("U8", [item, numel]) if transform == "byteplane" else (ST_DTYPES[dtype], list(shape))
        if not isinstance(entry, dict) or (entry.get("dtype"), entry.get("shape")) != want:
            raise bad(f"{name} has dtype/shape {repr(entry)[:200]}, expected {want}")
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise bad(f"{name} data offsets are malformed")
        begin, end = offsets
        if begin != end_prev or end != begin + numel * item:
            raise bad(f"{name} data offsets are inconsistent")
        end_prev = end
    if 8 + len(raw) + end_prev != decoded_bytes:
        raise bad("trailing bytes after the tensors" if 8 + len(raw) + end_prev < decoded_bytes
                  else f"tensors run past the {decoded_bytes} bytes the manifest gives")
