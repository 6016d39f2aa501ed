"""Checkers of single manifest fields (type, range, pattern, length, shape), each raising CacheCorruptError
naming the cache and the field. manifest.py validates whole manifests with them."""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import CacheCorruptError

MAX_DIM = 1 << 24
MAX_TEXT = 4096  # names, versions, hashes, paths: anything longer is not something kvcli wrote

# C0/C1 control characters (ESC starts terminal escape sequences): never in a name kvcli writes or prints.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def bad(where: str, what: str) -> CacheCorruptError:
    return CacheCorruptError(f"{where}: {what}")


def get_field(obj: dict, key: str, types: type | tuple, where: str, *, optional: bool = False) -> Any:
    """obj[key] checked for type; `key` may be dotted ("model.dtype") to name the field in messages."""
    name = key.rpartition(".")[2]
    if name not in obj:
        if optional:
            return None
        raise bad(where, f"manifest field '{key}' is missing")
    value = obj[name]
    if optional and value is None:
        return None
    bool_ok = bool in (types if isinstance(types, tuple) else (types,))  # True is no int in a manifest
    if not isinstance(value, types) or (isinstance(value, bool) and not bool_ok):
        raise bad(where, f"manifest field '{key}' has the wrong type")
    return value


def int_field(obj: dict, key: str, where: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
    value = get_field(obj, key, int, where, optional=optional)
    if value is not None and not lo <= value <= hi:
        raise bad(where, f"manifest field '{key}' = {value} is out of range")
    return value


def str_field(obj: dict, key: str, where: str, *, optional: bool = False, pattern: re.Pattern | None = None,
              limit: int | None = MAX_TEXT) -> str | None:
    value = get_field(obj, key, str, where, optional=optional)
    if value is None:
        return None
    if pattern is not None and not pattern.fullmatch(value):
        raise bad(where, f"manifest field '{key}' is malformed")
    if limit is not None and len(value) > limit:
        raise bad(where, f"manifest field '{key}' is implausibly long")
    if limit is not None and CONTROL.search(value):
        raise bad(where, f"manifest field '{key}' holds control characters")
    return value


def shape_field(obj: dict, key: str, where: str) -> tuple[int, ...]:
    value = get_field(obj, key, list, where)
    if len(value) != 4 or any(type(v) is not int or not 0 <= v <= MAX_DIM for v in value):
        raise bad(where, f"manifest field '{key}' is not a 4-d shape")
    return tuple(value)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


DOCUMENT_FORMATS = ("text", "html", "pdf", "docx", "epub")
_HEX256 = re.compile(r"^[0-9a-f]{64}$")


def document_record(document: dict, where: str) -> None:
    """The manifest's document record: digest, length and name; a converted document's format, converter, digest of
    its text, pages and headings (kvcli/documents/)."""
    str_field(document, "document.sha256", where, pattern=_HEX256)
    int_field(document, "document.chars", where, 0, 1 << 40)
    str_field(document, "document.name", where, optional=True)
    if str_field(document, "document.format", where, optional=True) not in (None, *DOCUMENT_FORMATS):
        raise bad(where, "unknown document format")
    str_field(document, "document.converter", where, optional=True)
    str_field(document, "document.text_sha256", where, pattern=_HEX256, optional=True)
    int_field(document, "document.pages", where, 0, 1 << 40, optional=True)
    int_field(document, "document.sections", where, 0, 1 << 40, optional=True)
    if str_field(document, "document.page_numbers", where, optional=True) not in (None, "printed", "position"):
        raise bad(where, "document.page_numbers must be \"printed\" or \"position\"")


SHA256 = re.compile(r"^[0-9a-f]{64}$")
SOURCE_FIELDS = {"default": ("path", "sha256"), "gguf": ("path", "sha256"), "folder": ("path",), "hub": ("id",), "object": ()}


def model_source(source: dict, where: str) -> None:
    """Where the model came from: `ask` without --model loads it again, so every field it reads is checked."""
    kind = str_field(source, "model.source.kind", where)
    str_field(source, "model.source.name", where, optional=True)
    for key in SOURCE_FIELDS.get(kind, ()):
        str_field(source, f"model.source.{key}", where, pattern=SHA256 if key == "sha256" else None)
    str_field(source, "model.source.revision", where, optional=True)
