"""What every reader shares: the Document record, the limits that bound a conversion, and the text tidying that makes
it deterministic."""

from __future__ import annotations

import re
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from ..errors import DocumentError

MAX_DOCUMENT_BYTES = 256 * 1024 * 1024  # a file (or URL) read whole, at most this much
MAX_PAGES = 10_000  # a PDF with more pages is refused before any page is read
MAX_PAGE_CHARS = 1_000_000  # text of one page (or of one DOCX/EPUB part): more is a damaged or hostile file
MAX_TEXT_CHARS = 64 * 1024 * 1024  # converted text in all (far beyond any model's context)
MAX_ZIP_MEMBERS = 20_000  # parts of a DOCX or EPUB
MAX_ZIP_MEMBER_BYTES = 64 * 1024 * 1024  # one part, unpacked (the zip's own declared size bounds what is read)
MAX_ZIP_TOTAL_BYTES = 512 * 1024 * 1024  # all parts, unpacked: a decompression bomb is refused before any is read
MAX_SECONDS = 300.0  # one conversion; a file that takes longer is refused (checked between pages and parts)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_STRAY = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters a converter may pass on; tab and newline stay
_BLANKS = re.compile(r"\n{3,}")
_TRAILING = re.compile(r"[ \t]+\n")


@dataclass(frozen=True)
class Document:
    name: str  # file name, or "-" for stdin
    text: str  # what the model reads: the file's text, or its conversion with [page N] and # heading lines
    sha256: str  # of the bytes as read
    format: str = "text"  # "text", "html", "pdf", "docx" or "epub"
    converter: str | None = None  # what converted it and its version ("kvcli-pdf/1 pypdf/7.1.1"); None for text
    pages: int | None = None  # a PDF's pages
    sections: int | None = None  # headings kept (HTML, DOCX, EPUB; a PDF's outline entries)
    page_numbers: str | None = None  # a PDF's `[page N]`: "printed" (its /PageLabels) or "position" (its place in the file)

    def same_source(self, record: dict) -> bool:
        """Whether a manifest's document record holds this document: the same bytes, read as the same format by the
        same converter and version (a newer converter may make other text, so its caches are rebuilt)."""
        return (record.get("sha256") == self.sha256 and record.get("format", "text") == self.format
                and record.get("converter") == self.converter)

    def grew_from(self, record: dict) -> bool:
        """Whether a manifest's document is a proper start of this one's text (the same document, grown: pages or
        chapters added), read as the same format by the same converter. A text document's digest is its bytes'."""
        import hashlib

        chars = record.get("chars", 0)
        if not 0 < chars < len(self.text) or record.get("format", "text") != self.format or record.get("converter") != self.converter:
            return False
        return hashlib.sha256(self.text[:chars].encode("utf-8")).hexdigest() == record.get("text_sha256", record.get("sha256"))

    def record(self) -> dict:
        """The manifest's document record; a text document's is what it always was, so its caches stay up to date."""
        name = Path(self.name).name if self.name != "-" else "-"
        record = {"name": _CONTROL.sub("?", name), "sha256": self.sha256, "chars": len(self.text)}
        if self.format != "text":
            import hashlib

            record.update(format=self.format, converter=self.converter, text_sha256=hashlib.sha256(self.text.encode("utf-8")).hexdigest())
            record.update({k: v for k, v in (("pages", self.pages), ("sections", self.sections), ("page_numbers", self.page_numbers))
                           if v is not None})
        return record


def describe(record: dict) -> str:
    """A document record's format and structure in words ("pdf, 12 pages", "html, 4 sections"); "" for plain text."""
    fmt = record.get("format", "text")
    if fmt == "text":
        return ""
    counts = [f"{n:,} {what}{'' if n == 1 else 's'}" for what, n in (("page", record.get("pages")), ("section", record.get("sections")))
              if n is not None]
    if record.get("page_numbers") == "printed":
        counts.append("page numbers as printed")
    return ", ".join([fmt, *counts])


def tidy(text: str) -> str:
    """One form for converted text: NFC, no stray control characters, no trailing blanks, at most one empty line."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = _TRAILING.sub("\n", _STRAY.sub("", text) + "\n")
    return _BLANKS.sub("\n\n", text).strip("\n")


class Budget:
    """Bounds one conversion: characters of text, per part and in all, and wall time (checked between parts)."""

    def __init__(self, name: str, what: str = "page"):
        self.name, self.what, self.chars, self.start = name, what, 0, time.monotonic()

    def take(self, text: str, index: int) -> str:
        if len(text) > MAX_PAGE_CHARS:
            raise DocumentError(f"{self.name}: {self.what} {index} holds more than {MAX_PAGE_CHARS:,} characters of text "
                                "(a damaged or hostile file?)")
        self.chars += len(text)
        if self.chars > MAX_TEXT_CHARS:
            raise DocumentError(f"{self.name}: more than {MAX_TEXT_CHARS:,} characters of text")
        if time.monotonic() - self.start > MAX_SECONDS:
            raise DocumentError(f"{self.name}: converting took more than {MAX_SECONDS:.0f} s (stopped at {self.what} {index})")
        return text


def missing_extra(name: str, what: str) -> DocumentError:
    """The refusal of a format whose converter is not installed: one line naming the extra."""
    return DocumentError(f"{name}: reading {what} needs the documents extra: pip install 'kvcli[documents]' "
                         "(in a checkout: pip install -c constraints.txt -e '.[documents]')")
