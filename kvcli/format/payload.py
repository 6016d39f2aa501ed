"""The layout of a shard's payload, checked without torch: shared by restore (codec) and verify (store).

A shard is one zstd frame of a safetensors file holding "keys" and "values" (lossless) or their
quantized parts (see quant_layout). These rules decide
whether its frame and header are exactly what the manifest describes, and PayloadReader streams a
payload under them: restore decompresses the tensors' bytes into their destinations, verify counts them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import zstandard

from ..errors import CacheCorruptError

from .dtypes import ITEM_SIZES, SAFETENSORS as ST_DTYPES
MAX_HEADER = 64 * 1024  # a shard's safetensors header is a few hundred bytes; anything bigger is hostile
SOURCE_READ = 1 << 20  # bytes zstd asks of a streamed source (store.ShardStream) at a time
WHOLE_BELOW = 4 << 20  # decoded bytes up to which a payload is decompressed in one call, which holds no lock that
# other threads wait on (a section's small shards then decode in parallel); larger ones stream in bounded pieces


def check_declared_size(data, size: int, where: str) -> int:
    """A zstd frame that declares a content size other than the manifest's is refused unread (bomb guard); the
    size it declares (-1: none) is returned.

    `data`: the stored bytes, or a stream with peek() and read() (store.ShardStream)."""
    try:
        declared = zstandard.frame_content_size(data.peek() if hasattr(data, "peek") else data)  # the frame's first bytes
    except zstandard.ZstdError:
        raise CacheCorruptError(f"{where}: not a zstandard frame") from None
    if declared >= 0 and declared != size:
        raise CacheCorruptError(f"{where}: declares {declared} decompressed bytes, manifest says {size}")
    return declared


@dataclass(frozen=True)
class Entry:
    """One tensor of a shard's payload: its name, safetensors dtype, shape and byte count."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def code_bytes(numel: int, bits: int) -> int:
    """Bytes holding `numel` codes of `bits` bits (4-bit codes two per byte)."""
    return numel if bits == 8 else (numel + 1) // 2


def layout(dtype: str, key_shape, value_shape, *, transform: str = "none", quant: dict | None = None) -> list[Entry]:
    """Every tensor a shard's payload holds, in order, as the manifest implies them (shared by
    manifest sizes, verify and restore). Lossless: "keys", "values". Quantized: see quant_layout."""
    if quant is not None:
        return quant_layout(dtype, key_shape, value_shape, quant)
    item = ITEM_SIZES[dtype]
    out = []
    for name, shape in (("keys", tuple(key_shape)), ("values", tuple(value_shape))):
        numel = math.prod(shape)
        if transform == "byteplane":
            out.append(Entry(name, "U8", (item, numel), item * numel))
        else:
            out.append(Entry(name, ST_DTYPES[dtype], shape, item * numel))
    return out


def quant_split(n: int, quant: dict) -> tuple[int, int, int]:
    """(first, quantized, last) token counts of a layer storing n tokens: the first `exact_tokens` (attention
    sinks) and the last `recent_tokens` (the recent window; absent in older caches: 0) stay exact, the rest is
    quantized. A layer shorter than both together stores everything exact."""
    first = min(quant["exact_tokens"], n)
    last = min(quant.get("recent_tokens", 0), n - first)
    return first, n - first - last, last


def stats_shape(shape, axis: int, group: int) -> tuple[int, ...]:
    """The shape of a quantized tensor's scales and minimums: one per group of `group` along `axis`."""
    return tuple(-(-n // group) if i == axis else n for i, n in enumerate(shape))


def quant_layout(dtype: str, key_shape, value_shape, quant: dict) -> list[Entry]:
    """Quantized payload: per tensor (keys, then values) NAME.exact (the first exact tokens in the compute
    dtype), NAME.recent (the last recent tokens in the compute dtype; only when the scheme keeps any),
    NAME.codes (U8, packed codes of the tokens between), NAME.scale and NAME.min (one per group: keys group
    `group_size` tokens of one channel, values `group_size` channels of one token)."""
    item, bits, group = ITEM_SIZES[dtype], quant["bits"], quant["group_size"]
    sdtype = quant["scale_dtype"]
    out = []
    for name, shape, axis in (("keys", tuple(key_shape), 2), ("values", tuple(value_shape), 3)):
        b, h, n, d = shape
        first, mid, last = quant_split(n, quant)
        rest = (b, h, mid, d)
        stats = stats_shape(rest, axis, group)
        out.append(Entry(f"{name}.exact", ST_DTYPES[dtype], (b, h, first, d), item * b * h * first * d))
        if quant.get("recent_tokens", 0) > 0:
            out.append(Entry(f"{name}.recent", ST_DTYPES[dtype], (b, h, last, d), item * b * h * last * d))
        out += [
            Entry(f"{name}.codes", "U8", (code_bytes(math.prod(rest), bits),), code_bytes(math.prod(rest), bits)),
            Entry(f"{name}.scale", ST_DTYPES[sdtype], stats, ITEM_SIZES[sdtype] * math.prod(stats)),
            Entry(f"{name}.min", ST_DTYPES[sdtype], stats, ITEM_SIZES[sdtype] * math.prod(stats)),
        ]
    return out


_F16_TOP = bytes(int((b & 0x7C) == 0x7C) for b in range(256))  # high byte of a float16 with an all-ones exponent
_F32_HI = bytes(int((b & 0x7F) == 0x7F) for b in range(256))
_F32_LO = bytes(int(b >= 0x80) for b in range(256))


def check_finite(data: bytes, dtype: str, where: str) -> None:
    """Refuse little-endian float16/float32 bytes holding an inf or NaN (quantization scales, minimums),
    in C-speed byte operations (verify imports no numpy)."""
    if dtype == "float16":
        bad = 1 in data[1::2].translate(_F16_TOP)
    else:
        hi, lo = data[3::4].translate(_F32_HI), data[2::4].translate(_F32_LO)
        bad = bool(int.from_bytes(hi, "little") & int.from_bytes(lo, "little"))
    if bad:
        raise CacheCorruptError(f"{where} holds values that are not finite")


def data_bytes(entries: list[Entry]) -> int:
    return sum(e.nbytes for e in entries)


def check_header(raw: bytes, *, where: str, transform: str, dtype: str, key_shape, value_shape, decoded_bytes: int,
                 quant: dict | None = None) -> None:
    """The header must name exactly the layout's tensors, with the expected dtypes, shapes and adjacent offsets."""

    def bad(what: str) -> CacheCorruptError:
        return CacheCorruptError(f"{where}: {what}")

    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSONDecodeError, huge int literals
        raise bad("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise bad("safetensors header is not an object")
    expected = layout(dtype, key_shape, value_shape, transform=transform, quant=quant)
    if set(header) - {"__metadata__"} != {e.name for e in expected}:
        raise bad(f"holds tensors {sorted(header)[:8]}, expected {', '.join(e.name for e in expected)}")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("transform", "none") != transform:
        raise bad("transform in shard does not match the manifest")
    if meta.get("dtype", dtype) != dtype:  # byte planes are U8: only this tells bf16 from f16
        raise bad("dtype in shard does not match the manifest")
    if meta.get("kv_bits") != (str(quant["bits"]) if quant else None):
        raise bad("quantization in shard does not match the manifest")
    end_prev = 0
    for e in expected:
        entry = header[e.name]
        want = (e.dtype, list(e.shape))
        if not isinstance(entry, dict) or (entry.get("dtype"), entry.get("shape")) != want:
            raise bad(f"{e.name} has dtype/shape {repr(entry)[:200]}, expected {want}")
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise bad(f"{e.name} data offsets are malformed")
        begin, end = offsets
        if begin != end_prev or end != begin + e.nbytes:
            raise bad(f"{e.name} data offsets are inconsistent")
        end_prev = end
    if 8 + len(raw) + end_prev != decoded_bytes:
        raise bad("trailing bytes after the tensors" if 8 + len(raw) + end_prev < decoded_bytes
                  else f"tensors run past the {decoded_bytes} bytes the manifest gives")


_CHUNK = 1 << 20  # bytes per read when draining a payload


def _read_all(stream) -> bytes:
    """Everything a stream with read() (store.ShardStream: hashed as it is read) has left, in one piece."""
    pieces = []
    while piece := stream.read():
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class PayloadReader:
    """One shard's payload, streamed: the frame's declared size and the safetensors header are checked on
    entry, then exactly the tensors' bytes are handed out; more or fewer is corruption, reported in one line.
    `data` is the stored bytes, or a stream with peek() and read() (store.ShardStream, hashed as it is read).

        with PayloadReader(data, where=..., transform=..., dtype=..., key_shape=..., value_shape=...,
                           decoded_bytes=...) as src:
            src.readinto(buffer)  # or src.drain()
            src.finish()
    """

    def __init__(self, data, *, where: str, transform: str, dtype: str, key_shape, value_shape,
                 decoded_bytes: int, quant: dict | None = None):
        self.data, self.where, self.size, self.got = data, where, decoded_bytes, 0
        self.rules = dict(transform=transform, dtype=dtype, key_shape=tuple(key_shape), value_shape=tuple(value_shape),
                          quant=quant)
        self._reader = None
        self._whole: memoryview | None = None  # a small payload, decompressed at once

    def __enter__(self) -> "PayloadReader":
        declared = check_declared_size(self.data, self.size, self.where)  # before decompressing anything
        try:
            if declared == self.size <= WHOLE_BELOW:  # (kvcli's frames declare their size; others stream)
                stored = self.data if isinstance(self.data, (bytes, bytearray, memoryview)) else _read_all(self.data)
                self._whole = memoryview(zstandard.ZstdDecompressor().decompress(stored, allow_extra_data=False))
            else:
                self._reader = zstandard.ZstdDecompressor().stream_reader(self.data, read_size=SOURCE_READ,
                                                                          read_across_frames=False)
            if self.size < 8:
                raise CacheCorruptError(f"{self.where}: payload too short for a safetensors header")
            first = bytearray(8)
            self.readinto(first)  # the safetensors header's length
            (n,) = struct.unpack("<Q", first)
            if n > MAX_HEADER or 8 + n > self.size:
                raise CacheCorruptError(f"{self.where}: safetensors header of {n} bytes does not fit")
            raw = bytearray(n)
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
        self._whole = None
        if isinstance(exc, zstandard.ZstdError):
            raise CacheCorruptError(f"{self.where}: not a valid zstandard stream ({exc})") from None

    def _check_room(self, n: int) -> None:
        if self.got + n > self.size:
            raise CacheCorruptError(f"{self.where}: safetensors payload runs past the {self.size} bytes the manifest gives")
        if self._whole is not None and self.got + n > len(self._whole):
            raise CacheCorruptError(f"{self.where}: decompresses to {len(self._whole)} bytes, manifest says {self.size}")

    def readinto(self, buf) -> None:
        """Fill `buf` (any writable buffer) with the next bytes of the payload."""
        view = memoryview(buf).cast("B")
        self._check_room(len(view))
        if self._whole is not None:
            view[:] = self._whole[self.got : self.got + len(view)]
            self.got += len(view)
            return
        done = 0
        while done < len(view):
            n = self._reader.readinto(view[done:])
            if n == 0:
                raise CacheCorruptError(f"{self.where}: decompresses to {self.got + done} bytes, manifest says {self.size}")
            done += n
        self.got += done

    def take(self, n: int, scratch):
        """The next n bytes of the payload: a read-only view of them where the payload is held whole, else
        scratch[:n] (a numpy or other sliceable writable buffer of at least n bytes) filled with them."""
        if self._whole is not None:
            self._check_room(n)
            part = self._whole[self.got : self.got + n]
            self.got += n
            return part
        part = scratch[:n]
        self.readinto(part)
        return part

    def drain(self) -> None:
        """Read the rest of the payload in bounded chunks, keeping nothing (verify); a quantized payload's
        scales and minimums are checked to be finite on the way."""
        quant = self.rules["quant"]
        if quant is not None:
            r = self.rules
            for e in layout(r["dtype"], r["key_shape"], r["value_shape"], quant=quant):
                left = e.nbytes
                while left:
                    part = bytearray(min(_CHUNK, left))
                    self.readinto(part)
                    if e.name.endswith((".scale", ".min")):
                        check_finite(bytes(part), quant["scale_dtype"], f"{self.where}: {e.name}")
                    left -= len(part)
        scratch = bytearray(min(_CHUNK, max(self.size - self.got, 1)))
        while self.got < self.size:
            n = min(len(scratch), self.size - self.got)
            self.readinto(memoryview(scratch)[:n])

    def finish(self) -> None:
        """Exactly the declared size was read, and nothing follows it."""
        if self.got != self.size or (self._whole is not None and len(self._whole) != self.size) or (
                self._reader is not None and self._reader.read(1)):
            raise CacheCorruptError(f"{self.where}: decompresses to more bytes, manifest says {self.size}")
