"""A PDF's text layer, page by page with pypdf (the documents extra): a `[page N]` line before each page's text, so
an answer can cite the page. N is the page's printed number where the file labels its pages (/PageLabels: iv, 12,
A-3), else its place in the file (what a viewer's "page N of M" shows); the record says which. The headings of the
file's outline (bookmarks) become `#` lines (`##` for a nested one) at the start of the page they point to."""

from __future__ import annotations

import io
import logging
import warnings

from ..errors import DocumentError
from .base import MAX_PAGES, Budget, Document, missing_extra, tidy

VERSION = 2  # of this module's output: bump it when the text it makes changes, so caches of PDFs are rebuilt
OCR_HINT = "run OCR first (e.g. ocrmypdf in.pdf out.pdf)"
MAX_OUTLINE = 20_000  # outline entries read; a hostile outline stops there


def convert(data: bytes, name: str, sha256: str) -> Document:
    try:
        import pypdf
        from pypdf.errors import DependencyError, FileNotDecryptedError, LimitReachedError, PyPdfError
    except ImportError:
        raise missing_extra(name, "PDF") from None
    if b"%%EOF" not in data[-4096:]:  # pypdf would read what is there and say nothing of the pages lost
        raise DocumentError(f"{name}: a truncated PDF (no %%EOF at its end); download or copy it again")
    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its warnings about odd fonts are not the user's business
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = pypdf.PdfReader(io.BytesIO(data), strict=False)
            if reader.is_encrypted:
                _open(reader, name, FileNotDecryptedError, DependencyError)
            count = len(reader.pages)
            if count > MAX_PAGES:
                raise DocumentError(f"{name}: {count:,} pages, more than the {MAX_PAGES:,} kvcli reads")
            labels = _labels(reader, count)
            headings = _outline(reader)
            budget, parts, texts = Budget(name), [], 0
            for index, page in enumerate(reader.pages, 1):
                text = tidy(budget.take(page.extract_text() or "", index))
                texts += bool(text)
                marks = headings.get(index - 1, [])
                if text or marks:
                    number = labels[index - 1] if labels else str(index)
                    parts.append("\n".join([f"[page {number}]", *marks, text]).rstrip("\n"))
    except DocumentError:
        raise
    except LimitReachedError as exc:
        raise DocumentError(f"{name}: a part of the PDF unpacks beyond pypdf's limit ({exc}); a decompression bomb?") from None
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, RecursionError, ZeroDivisionError,
            OverflowError, AssertionError) as exc:  # pypdf's errors on broken files are of many kinds
        raise DocumentError(f"{name}: a damaged or truncated PDF ({exc.__class__.__name__}: {str(exc)[:200]})") from None
    if count == 0:
        raise DocumentError(f"{name}: a PDF without pages")
    if not texts:
        raise DocumentError(f"{name}: no text layer in its {count:,} page(s) (a scanned PDF?); {OCR_HINT}")
    return Document(name=name, text="\n\n".join(parts), sha256=sha256, format="pdf",
                    converter=f"kvcli-pdf/{VERSION} pypdf/{pypdf.__version__}", pages=count,
                    sections=sum(map(len, headings.values())) or None, page_numbers="printed" if labels else "position")


def _labels(reader, count: int) -> list[str] | None:
    """Each page's printed number when the file labels its pages (/PageLabels), else None (pages by position)."""
    try:
        if "/PageLabels" not in reader.trailer["/Root"]:
            return None
        labels = [" ".join(str(label).split()) for label in reader.page_labels]
    except Exception:  # a damaged label tree: the pages are still read, numbered by position
        return None
    return labels if len(labels) == count and all(labels) else None


def _outline(reader) -> dict[int, list[str]]:
    """The outline's headings by the page (index) they point to, each as a `#` line by its depth; {} without one."""
    found: dict[int, list[str]] = {}
    try:
        todo, seen = [(item, 1) for item in reversed(reader.outline)], 0
        while todo and seen < MAX_OUTLINE:  # a bound on a hostile outline
            item, depth = todo.pop()
            seen += 1
            if isinstance(item, list):  # the children of the entry before it
                todo.extend((child, depth + 1) for child in reversed(item))
                continue
            title = " ".join(str(item.title or "").split())
            page = reader.get_destination_page_number(item)
            if title and page is not None and page >= 0:
                found.setdefault(page, []).append(f"{'#' * min(depth, 6)} {title}")
    except Exception:  # a damaged outline: the pages are still read, without its headings
        return {}
    return found


def _open(reader, name: str, not_decrypted: type, dependency: type) -> None:
    """Open a PDF encrypted with an empty user password (printing or copying restricted); refuse one that needs a password."""
    try:
        if reader.decrypt(""):
            return
    except dependency:  # AES without the cryptography package (pypdf[crypto], in the documents extra)
        raise DocumentError(f"{name}: encrypted with AES, which needs the cryptography package: pip install 'kvcli[documents]'") from None
    except (not_decrypted, NotImplementedError):
        pass
    raise DocumentError(f"{name}: encrypted PDF that needs a password; save an unencrypted copy (e.g. qpdf --decrypt)")
