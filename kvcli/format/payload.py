"""The layout of a shard's payload, checked without torch: shared by restore (codec) and verify (store).

A shard is one zstd frame of a safetensors file holding "keys" and "values". These rules decide
whether its frame and header are exactly what the manifest describes, and PayloadReader streams a
payload under them: restore decompresses the tensors' bytes into their destinations, verify counts them.
"""

from __future__ import annotations

import json
import struct

import zstandard

from ..errors import CacheCorruptError

from .dtypes import ITEM_SIZES, SAFETENSORS as ST_DTYPES
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


_CHUNK = 1 << 20  # bytes per read when draining a payload


class PayloadReader:
    """One shard's payload, streamed: the frame's declared size and the safetensors header are checked on
    entry, then exactly the tensors' bytes are handed out; more or fewer is corruption, reported in one line.

        with PayloadReader(data, where=..., transform=..., dtype=..., key_shape=..., value_shape=...,
                           decoded_bytes=...) as src:
            src.readinto(buffer)  # or src.drain()
            src.finish()
    """

    def __init__(self, data: bytes | memoryview, *, where: str, transform: str, dtype: str, key_shape, value_shape,
                 decoded_bytes: int):
        self.data, self.where, self.size, self.got = data, where, decoded_bytes, 0
        self.rules = dict(transform=transform, dtype=dtype, key_shape=tuple(key_shape), value_shape=tuple(value_shape))
        self._reader = None

    def __enter__(self) -> "PayloadReader":
        check_declared_size(self.data, self.size, self.where)  # before decompressing anything
        try:
            self._reader = zstandard.ZstdDecompressor().stream_reader(self.data, read_across_frames=False)
            if self.size < 8:
                raise CacheCorruptError(f"{self.where}: payload too short for a safetensors header")
            first = bytearray(8)
            self.readinto(first)
            raw = bytearray(header_length(bytes(first), self.size, self.where))
            self.readinto(raw)
            check_header(bytes(raw), where=self.where, decoded_bytes=self.size, **self.rules)
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if isinstance(exc, zstandard.ZstdError):
            raise CacheCorruptError(f"{self.where}: not a valid zstandard stream ({exc})") from None

    def readinto(self, buf) -> None:
        """Fill `buf` (any writable buffer) with the next bytes of the payload."""
        view = memoryview(buf).cast("B")
        if self.got + len(view) > self.size:
            raise CacheCorruptError(f"{self.where}: safetensors payload runs past the {self.size} bytes the manifest gives")
        done = 0
        while done < len(view):
            n = self._reader.readinto(view[done:])
            if n == 0:
                raise CacheCorruptError(f"{self.where}: decompresses to {self.got + done} bytes, manifest says {self.size}")
            done += n
        self.got += done

    def drain(self) -> None:
        """Read the rest of the payload in bounded chunks, keeping nothing (verify)."""
        scratch = bytearray(min(_CHUNK, max(self.size - self.got, 1)))
        while self.got < self.size:
            n = min(len(scratch), self.size - self.got)
            self.readinto(memoryview(scratch)[:n])

    def finish(self) -> None:
        """Exactly the declared size was read, and nothing follows it."""
        if self.got != self.size or self._reader.read(1):
            raise CacheCorruptError(f"{self.where}: decompresses to more bytes, manifest says {self.size}")
