"""A GGUF file's header read without numpy or its tensors: the scalar fields and where each tensor's bytes lie.

Arrays of numbers are read; arrays of strings (the tokenizer's tokens and merges) are skipped, not decoded, and kept
as their length (Strings): the config is mapped from these fields (gguf_config), the tokenizer is read by
transformers' own GGUF tokenizer reader. Any file that is not a whole GGUF (wrong magic, a
version this reader does not know, a header or tensor data cut short) is a ModelError naming the file.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ModelError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml type id -> (name, weights a block, bytes a block): the types GGUF files hold
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}


@dataclass(frozen=True)
class Strings:
    """An array of strings left in the file (a vocabulary, merges): only its length is read."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its GGUF type name, rows and columns (a 1-D tensor: 1 row), and its bytes' place in the file."""

    name: str
    kind: str
    rows: int
    cols: int
    offset: int  # from the start of the file
    nbytes: int

    def as_list(self) -> list[Any]:
        return [self.kind, self.rows, self.cols, self.offset, self.nbytes]


@dataclass
class Header:
    fields: dict[str, Any]  # scalars and strings; arrays of numbers as tuples, of strings as Strings
    tensors: dict[str, TensorInfo]
    size: int  # the file's size in bytes

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))


class _Cursor:
    def __init__(self, buf: Any, path: Path):
        self.buf, self.at, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ModelError(f"{self.path}: the GGUF header is cut short (truncated file?)")
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise ModelError(f"{self.path}: the GGUF header is cut short (truncated file?)")
        text = bytes(self.buf[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def skip_strings(self, count: int) -> None:
        buf, at, end = self.buf, self.at, len(self.buf)
        for _ in range(count):
            if at + 8 > end:
                break
            at += 8 + int.from_bytes(buf[at:at + 8], "little")
        if at > end:
            raise ModelError(f"{self.path}: the GGUF header is cut short (truncated file?)")
        self.at = at

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                self.skip_strings(count)
                return Strings(count)
            if item not in _SCALARS:
                raise ModelError(f"{self.path}: GGUF array of unknown value type {item}")
            fmt = f"<{count}{_SCALARS[item][1]}"
            if self.at + struct.calcsize(fmt) > len(self.buf):
                raise ModelError(f"{self.path}: the GGUF header is cut short (truncated file?)")
            values = struct.unpack_from(fmt, self.buf, self.at)
            self.at += struct.calcsize(fmt)
            return values
        raise ModelError(f"{self.path}: GGUF field of unknown value type {kind}")


def read_header(path: Path) -> Header:
    """The header of the GGUF file at `path` (ModelError when it is not a whole GGUF file), parsed once per process
    for a file of the same identity (path, size, mtime, inode): checking the file, its config and its tensors read
    one parse."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError:
        return _read(path)  # says what is wrong with the path
    return _read_once(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4)
def _read_once(path: str, size: int, mtime_ns: int, inode: int) -> Header:
    return _read(Path(path))


def _read(path: Path) -> Header:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ModelError(f"{path}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path, size)
    except OSError as exc:
        raise ModelError(f"{path}: cannot read the GGUF file ({exc.strerror or exc})") from exc


def _parse(buf: Any, path: Path, size: int) -> Header:
    if bytes(buf[:4]) != MAGIC:
        raise ModelError(f"{path}: not a GGUF file (its first bytes are {bytes(buf[:4])!r}, not b'GGUF')")
    c = _Cursor(buf, path)
    c.at = 4
    version = c.take("<I")
    if version not in (2, 3):
        raise ModelError(f"{path}: GGUF version {version} (kvcli reads versions 2 and 3)")
    n_tensors, n_fields = c.take("<Q"), c.take("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = c.string()
        fields[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("<Q") for _ in range(c.take("<I"))]
        type_id, offset = c.take("<I"), c.take("<Q")
        if type_id not in TYPES:
            raise ModelError(f"{path}: tensor {name} has GGUF type {type_id}, which kvcli does not know")
        infos.append((name, dims, type_id, offset))
    align = int(fields.get("general.alignment", 32)) or 32
    start = (c.at + align - 1) // align * align
    tensors = {}
    for name, dims, type_id, offset in infos:
        kind, block, block_bytes = TYPES[type_id]
        cols = dims[0] if dims else 1
        rows = 1
        for d in dims[1:]:
            rows *= d
        if cols % block:
            raise ModelError(f"{path}: tensor {name} ({kind}) has rows of {cols} weights, not whole blocks of {block}")
        nbytes = rows * cols // block * block_bytes
        if start + offset + nbytes > size:
            raise ModelError(f"{path}: tensor {name} ends past the end of the file ({size} bytes): the file is truncated")
        tensors[name] = TensorInfo(name, kind, rows, cols, start + offset, nbytes)
    return Header(fields, tensors, size)
