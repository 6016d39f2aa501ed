"""Word (DOCX, with python-docx from the documents extra) and EPUB (a zip of XHTML chapters, read with the standard
library and markup.py): headings as `# Heading` lines, in the document's order.

Both are zip archives: every part's unpacked size, as the archive declares it, is checked before any part is read
(zipfile never reads past a declared size), so a decompression bomb costs nothing.
"""

from __future__ import annotations

import io
import posixpath
import re
import zipfile
from xml.etree import ElementTree

from ..errors import DocumentError
from .base import MAX_ZIP_MEMBER_BYTES, MAX_ZIP_MEMBERS, MAX_ZIP_TOTAL_BYTES, Budget, Document, missing_extra, tidy
from . import markup

VERSION = 1  # of this module's output: bump it when the text it makes changes, so caches of DOCX and EPUB are rebuilt
_HEADING = re.compile(r"^(?:heading|überschrift|titre|titolo|título|kop)\s*(\d)$", re.I)
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError, KeyError)


def checked_zip(data: bytes, name: str, what: str) -> zipfile.ZipFile:
    """The archive, once its part count and declared unpacked sizes are within bounds."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        infos = z.infolist()
    except _ZIP_ERRORS as exc:
        raise DocumentError(f"{name}: a damaged or truncated {what} ({exc})") from None
    if len(infos) > MAX_ZIP_MEMBERS:
        raise DocumentError(f"{name}: {len(infos):,} parts in the {what}, more than {MAX_ZIP_MEMBERS:,}")
    big = max(infos, key=lambda i: i.file_size, default=None)
    total = sum(i.file_size for i in infos)
    if big is not None and (big.file_size > MAX_ZIP_MEMBER_BYTES or total > MAX_ZIP_TOTAL_BYTES):
        raise DocumentError(f"{name}: unpacks to {total:,} bytes ({big.filename}: {big.file_size:,}), more than kvcli reads "
                            f"({MAX_ZIP_MEMBER_BYTES // 2**20} MiB a part, {MAX_ZIP_TOTAL_BYTES // 2**20} MiB in all); a decompression bomb?")
    return z


def docx(data: bytes, name: str, sha256: str) -> Document:
    try:
        import docx as python_docx
        from docx.table import Table
        from docx.text.paragraph import Paragraph
    except ImportError:
        raise missing_extra(name, "Word (DOCX) files") from None
    from importlib.metadata import version

    checked_zip(data, name, "DOCX").close()
    budget, lines, headings = Budget(name, "paragraph"), [], 0
    try:
        doc = python_docx.Document(io.BytesIO(data))
        for index, block in enumerate(doc.iter_inner_content(), 1):
            if isinstance(block, Paragraph):
                text = " ".join(budget.take(block.text, index).split())
                if not text:
                    continue
                level = _level(block)
                if level:
                    headings += 1
                    lines.append(f"\n{'#' * level} {text}")
                else:
                    lines.append(f"- {text}" if _listed(block) else text)
            elif isinstance(block, Table):
                for row in block.rows:
                    cells = [" ".join(c.text.split()) for c in row.cells]
                    row_text = " | ".join(dict.fromkeys(c for c in cells if c))  # merged cells repeat: once each
                    if row_text:
                        lines.append(budget.take(row_text, index))
    except DocumentError:
        raise
    except Exception as exc:  # python-docx and lxml raise many kinds on a damaged part
        raise DocumentError(f"{name}: a damaged DOCX ({exc.__class__.__name__}: {str(exc)[:200]})") from None
    return Document(name=name, text=tidy("\n".join(lines)), sha256=sha256, format="docx",
                    converter=f"kvcli-docx/{VERSION} python-docx/{version('python-docx')}", sections=headings)


def _level(paragraph) -> int:
    """The heading level of a paragraph from its style's name ("Heading 2", "Title"), 0 for body text."""
    try:
        style = paragraph.style.name if paragraph.style is not None else ""
    except (KeyError, AttributeError, ValueError):
        return 0
    if style.lower() == "title":
        return 1
    m = _HEADING.match(style.strip())
    return min(6, int(m.group(1))) if m else 0


def _listed(paragraph) -> bool:
    """Whether a paragraph is a list item (numbered or bulleted)."""
    ppr = paragraph._p.pPr
    style = (paragraph.style.name if paragraph.style is not None else "") or ""
    return (ppr is not None and ppr.numPr is not None) or style.lower().startswith("list")


_OPF = "{http://www.idpf.org/2007/opf}"
_CONTAINER = "{urn:oasis:names:tc:opendocument:xmlns:container}"


def epub(data: bytes, name: str, sha256: str) -> Document:
    z = checked_zip(data, name, "EPUB")
    budget, parts, headings = Budget(name, "chapter"), [], 0
    try:
        with z:
            opf_path = _xml(z, "META-INF/container.xml", name).find(f".//{_CONTAINER}rootfile").get("full-path")
            opf = _xml(z, opf_path, name)
            base = posixpath.dirname(opf_path)
            items = {i.get("id"): i for i in opf.iter(f"{_OPF}item")}
            spine = [items[r.get("idref")] for r in opf.iter(f"{_OPF}itemref") if r.get("idref") in items and r.get("linear") != "no"]
            for index, item in enumerate(spine, 1):
                if "html" not in (item.get("media-type") or ""):
                    continue
                raw = z.read(posixpath.normpath(posixpath.join(base, item.get("href") or "")))
                text, found = markup.to_text(raw.decode(markup.charset(raw) or "utf-8", errors="replace"), web=False,
                                             check=lambda: budget.take("", index))
                parts.append(budget.take(text, index))
                headings += found
    except DocumentError:
        raise
    except (*_ZIP_ERRORS, ElementTree.ParseError, AttributeError, TypeError, LookupError) as exc:
        raise DocumentError(f"{name}: a damaged EPUB ({exc.__class__.__name__}: {str(exc)[:200]})") from None
    return Document(name=name, text=tidy("\n\n".join(p for p in parts if p)), sha256=sha256, format="epub",
                    converter=f"kvcli-epub/{VERSION}+html/{markup.VERSION}", sections=headings)


def _xml(z: zipfile.ZipFile, path: str, name: str) -> ElementTree.Element:
    """A small XML part of the archive; a DTD or entity declaration (never in an EPUB's manifests) is refused."""
    raw = z.read(path)
    if b"<!ENTITY" in raw or b"<!DOCTYPE" in raw:
        raise DocumentError(f"{name}: {path} declares a DTD or entities; refused")
    return ElementTree.fromstring(raw)
