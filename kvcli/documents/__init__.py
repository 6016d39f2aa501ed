"""Reading documents: text as it is (strict decoding, the byte offset of the first error, binary refused), and PDF,
HTML, DOCX and EPUB converted to text with their pages and headings kept (docs/documents.md).

The format comes from the content (sniff.py). Converters are imported only when a document of their format is read:
pypdf and python-docx come with the `documents` extra; HTML and EPUB use the standard library.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from ..errors import DocumentError, UsageError
from .base import MAX_DOCUMENT_BYTES, Document, describe

__all__ = ["MAX_DOCUMENT_BYTES", "Document", "describe", "TEXT_EXTENSIONS", "DOCUMENT_EXTENSIONS", "decode", "from_bytes", "read",
           "check_encoding", "cache_name"]
_WIDE = ("utf-16", "utf16", "utf-32", "utf32", "ucs-2", "ucs2", "ucs-4", "ucs4")  # where NUL bytes are normal
# Control characters that never appear in text (tab, newlines, form feed and ESC of coloured logs do).
_BINARY_CHARS = re.compile(r"[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f]")
_SNIFF = 65536
# Extensions a cache name replaces with .kv (notes.txt -> notes.kv); any other suffix is part of the name (MPL-2.0 -> MPL-2.0.kv).
TEXT_EXTENSIONS = (".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".html", ".htm", ".xml", ".json", ".jsonl",
                   ".csv", ".tsv", ".log")
DOCUMENT_EXTENSIONS = TEXT_EXTENSIONS + (".xhtml", ".pdf", ".docx", ".epub")


def decode(data: bytes, name: str, encoding: str = "utf-8") -> Document:
    """A text document from its bytes; refuse binary, empty and undecodable input with a precise message."""
    return Document(name=name, text=_text(data, name, encoding), sha256=hashlib.sha256(data).hexdigest())


def from_bytes(data: bytes, name: str, encoding: str = "utf-8") -> Document:
    """A document of any format kvcli reads, from its bytes: text as it is, PDF, HTML, DOCX and EPUB converted."""
    from . import sniff

    kind = sniff.detect(data, name)
    if kind == "text":
        return decode(data, name, encoding)
    sha256 = hashlib.sha256(data).hexdigest()
    if kind == "html":
        return _html(data, name, encoding, sha256)
    if kind == "pdf":
        from . import pdf

        return _checked(pdf.convert(data, name, sha256))
    from . import office

    return _checked((office.docx if kind == "docx" else office.epub)(data, name, sha256))


def _html(data: bytes, name: str, encoding: str, sha256: str) -> Document:
    from . import markup
    from .base import MAX_TEXT_CHARS, Budget, tidy

    try:
        raw = _text(data, name, encoding)
    except DocumentError as first:  # the page declares another charset than --encoding: read it as it says
        declared = markup.charset(data)
        if declared is None or declared.lower().replace("_", "-") == encoding.lower().replace("_", "-"):
            raise
        try:
            raw = _text(data, name, declared)
        except DocumentError:
            raise first from None
    budget = Budget(name, "piece")
    text, headings = markup.to_text(raw, check=lambda: budget.take("", 0))  # the time limit, between pieces
    text = tidy(text)
    if len(text) > MAX_TEXT_CHARS:
        raise DocumentError(f"{name}: more than {MAX_TEXT_CHARS:,} characters of text")
    return _checked(Document(name=name, text=text, sha256=sha256, format="html", converter=f"kvcli-html/{markup.VERSION}",
                             sections=headings))


def _checked(document: Document) -> Document:
    if not document.text.strip():
        raise DocumentError(f"{document.name}: no text in this {document.format.upper()} file")
    return document


def _text(data: bytes, name: str, encoding: str) -> str:
    wide = encoding.lower().replace("_", "-").startswith(_WIDE)
    nul = -1 if wide else data.find(b"\x00")
    if nul >= 0:
        wide_text = _wide_encoding(data)
        if wide_text:
            raise DocumentError(f"{name}: {wide_text} text, not {encoding}; pass --encoding {wide_text.lower()}")
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
    return text


def _wide_encoding(data: bytes) -> str | None:
    """'UTF-16' or 'UTF-32' for text in such an encoding (a byte order mark at its start, or the NUL bytes of mostly
    ASCII text in every second or fourth place), else None."""
    if data.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    head = data[:4096]
    if len(head) >= 8 and len(head) % 2 == 0:
        for size, encoding in ((4, "UTF-32"), (2, "UTF-16")):
            for start in range(size):
                units = [head[i:i + size] for i in range(0, len(head) - size + 1, size)]
                if all(u[start] != 0 and sum(u) == u[start] for u in units[:64]):
                    return f"{encoding}-{'LE' if start == 0 else 'BE'}" if start in (0, size - 1) else None
    return None


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
    return from_bytes(data, str(path), encoding)


def check_encoding(encoding: str) -> None:
    """Refuse an unknown --encoding at once (a usage error), before any model loads."""
    import codecs

    try:
        codecs.lookup(encoding)
    except LookupError:
        raise UsageError(f"--encoding {encoding}: unknown encoding (for example utf-8, latin-1, utf-16, cp1252)") from None


def cache_name(document: str) -> str:
    """The file name of a document's cache (a path or URL): a known document extension replaced by .kv, any other
    name kept whole (a/report.txt -> report.kv, MPL-2.0 -> MPL-2.0.kv, LGPL-2.1 -> LGPL-2.1.kv)."""
    name = PurePosixPath(urlsplit(document).path if "://" in document else document).name or "document"
    stem, dot, ext = name.rpartition(".")
    if dot and stem and f".{ext.lower()}" in DOCUMENT_EXTENSIONS:
        name = stem
    return name + ".kv"
