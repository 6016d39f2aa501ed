"""Reading documents: strict decoding with the byte offset of the first error, binary refused."""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from .errors import DocumentError, UsageError

MAX_DOCUMENT_BYTES = 256 * 1024 * 1024
_WIDE = ("utf-16", "utf16", "utf-32", "utf32", "ucs-2", "ucs2", "ucs-4", "ucs4")  # where NUL bytes are normal
# Control characters that never appear in text (tab, newlines, form feed and ESC of coloured logs do).
_BINARY_CHARS = re.compile(r"[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f]")
_SNIFF = 65536
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Extensions a cache name replaces with .kv (notes.txt -> notes.kv); any other suffix is part of the name (MPL-2.0 -> MPL-2.0.kv).
TEXT_EXTENSIONS = (".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".html", ".htm", ".xml", ".json", ".jsonl",
                   ".csv", ".tsv", ".log")


@dataclass(frozen=True)
class Document:
    name: str  # file name, or "-" for stdin
    text: str
    sha256: str  # of the bytes as read

    def record(self) -> dict:
        name = Path(self.name).name if self.name != "-" else "-"
        return {"name": _CONTROL.sub("?", name), "sha256": self.sha256, "chars": len(self.text)}


def decode(data: bytes, name: str, encoding: str = "utf-8") -> Document:
    """Decode document bytes; refuse binary, empty and undecodable input with a precise message."""
    wide = encoding.lower().replace("_", "-").startswith(_WIDE)
    nul = -1 if wide else data.find(b"\x00")
    if nul >= 0:
        raise DocumentError(f"{name}: looks like a binary file (NUL byte at byte offset {nul}), not text")
    try:
        text = data.decode(encoding)
    except LookupError:
        raise DocumentError(f"--encoding {encoding}: unknown encoding") from None
    except UnicodeDecodeError as exc:
        raise DocumentError(
            f"{name}: not valid {encoding} at byte offset {exc.start} ({exc.reason}); pass --encoding if it is another encoding"
        ) from None
    text = text.removeprefix("\ufeff")
    head = text[:_SNIFF]
    controls = len(_BINARY_CHARS.findall(head))
    if "\x00" in text or controls > max(2, len(head) // 100):
        raise DocumentError(f"{name}: looks like a binary file ({controls} control characters in its first {len(head):,}), not text")
    if not text.strip():
        raise DocumentError(f"{name}: the document is empty")
    return Document(name=name, text=text, sha256=hashlib.sha256(data).hexdigest())


def read(path: str | Path, encoding: str = "utf-8") -> Document:
    """Read a document from a file, or from stdin when path is '-'."""
    if str(path) == "-":
        data = sys.stdin.buffer.read(MAX_DOCUMENT_BYTES + 1)
    else:
        p = Path(path)
        try:
            if p.is_dir():
                raise DocumentError(f"{p}: is a folder, not a document")
            with open(p, "rb") as f:
                data = f.read(MAX_DOCUMENT_BYTES + 1)
        except FileNotFoundError:
            raise DocumentError(f"{p}: no such file") from None
        except PermissionError:
            raise DocumentError(f"{p}: permission denied") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{path}: larger than {MAX_DOCUMENT_BYTES // (1024 * 1024)} MiB")
    return decode(data, str(path), encoding)


def check_encoding(encoding: str) -> None:
    """Refuse an unknown --encoding at once (a usage error), before any model loads."""
    import codecs

    try:
        codecs.lookup(encoding)
    except LookupError:
        raise UsageError(f"--encoding {encoding}: unknown encoding (for example utf-8, latin-1, utf-16, cp1252)") from None


def cache_name(document: str) -> str:
    """The file name of a document's cache (a path or URL): a known text extension replaced by .kv, any other
    name kept whole (a/report.txt -> report.kv, MPL-2.0 -> MPL-2.0.kv, LGPL-2.1 -> LGPL-2.1.kv)."""
    name = PurePosixPath(urlsplit(document).path if "://" in document else document).name or "document"
    stem, dot, ext = name.rpartition(".")
    if dot and stem and f".{ext.lower()}" in TEXT_EXTENSIONS:
        name = stem
    return name + ".kv"
