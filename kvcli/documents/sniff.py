"""Which format a document is, from its bytes: the extension only breaks a tie, and one that contradicts the content
is refused (a renamed file is more often a mistake than a convenience)."""

from __future__ import annotations

import io
import re
import zipfile
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from ..errors import DocumentError

TEXT_LIKE = (".txt", ".text", ".md", ".markdown", ".rst", ".adoc", ".org", ".tex", ".xml", ".json", ".jsonl", ".csv", ".tsv", ".log")
HTML_EXTENSIONS = (".html", ".htm", ".xhtml")
BINARY_EXTENSIONS = {".pdf": "pdf", ".docx": "docx", ".epub": "epub"}
NAMES = {"pdf": "a PDF", "docx": "a Word (DOCX) file", "epub": "an EPUB", "html": "HTML", "text": "text", "zip": "a zip archive"}
_HTML_START = re.compile(rb"^\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*<(!doctype\s+html|html[\s>])", re.I | re.S)


def extension(name: str) -> str:
    """The lower-case extension of a path or URL ('' for none)."""
    path = urlsplit(name).path if "://" in name else name
    return PurePosixPath(path).suffix.lower()


def detect(data: bytes, name: str) -> str:
    """'pdf', 'docx', 'epub', 'html' or 'text'. The content decides; an extension that names another format is refused."""
    ext = extension(name)
    found = _by_content(data, name, ext)
    said = BINARY_EXTENSIONS.get(ext) or ("html" if ext in HTML_EXTENSIONS else "text" if ext in TEXT_LIKE else None)
    if found in ("pdf", "docx", "epub", "zip"):
        if said is not None and said != found:
            raise DocumentError(f"{name}: the name says {NAMES[said]} but the content is {NAMES[found]}; rename it to what it is")
        if found == "zip":
            raise DocumentError(f"{name}: a zip archive that is neither a DOCX nor an EPUB")
        return found
    if said in ("pdf", "docx", "epub"):
        raise DocumentError(f"{name}: the name says {NAMES[said]} but the content is not one "
                            f"({'it looks like HTML' if found == 'html' else 'no ' + _MAGIC_NAMES[said] + ' at its start'}; "
                            "truncated, damaged, or renamed?)")
    if said == "html" or (said is None and found == "html"):
        return "html"
    return "text"  # .txt, .md and the like are read as written, even when they hold markup


_MAGIC_NAMES = {"pdf": "%PDF- header", "docx": "zip header", "epub": "zip header"}


def _by_content(data: bytes, name: str, ext: str) -> str:
    at = data[:1024].find(b"%PDF-")
    # the header first (after blanks), or later in the first KiB of a file named .pdf (readers accept a few bytes of junk
    # before it); a text that merely mentions "%PDF-" stays text
    if at >= 0 and (not data[:at].strip() or ext == ".pdf"):
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        return _zip_kind(data, name)
    head = data[:4096].lstrip(b"\xef\xbb\xbf")
    if _HTML_START.match(head):
        return "html"
    return "text"


def _zip_kind(data: bytes, name: str) -> str:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = set(z.namelist()[:100_000])
            if "word/document.xml" in names:
                return "docx"
            if "mimetype" in names:
                info = z.getinfo("mimetype")
                if info.file_size < 100 and z.read(info).strip() == b"application/epub+zip":
                    return "epub"
            return "epub" if "META-INF/container.xml" in names else "zip"
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise DocumentError(f"{name}: a damaged or truncated zip archive ({exc})") from None
