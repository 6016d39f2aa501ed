"""Small real documents built in code: a PDF with a text layer (one content stream a page, Helvetica), a DOCX and an
EPUB (zip archives of XML), and a web page; used by the format tests and tests/bench/bench_documents.py."""

from __future__ import annotations

import io
import zipfile


def _escape(line: str) -> str:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def pdf(pages: list[list[str]], *, text_layer: bool = True) -> bytes:
    """A valid PDF: page k shows pages[k]'s lines (or, without a text layer, only a filled box, as a scan has no text)."""
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        if text_layer:
            body = "BT /F1 11 Tf 14 TL 72 720 Td " + " ".join(f"({_escape(line)}) Tj T*" for line in lines) + " ET"
        else:
            body = "0.5 g 72 72 450 650 re f"
        content = body.encode("latin-1")
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                       b"/Contents %d 0 R >>" % len(objects))
        kids.append(len(objects))
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % k for k in kids), len(kids))
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % o for o in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def encrypted_pdf(pages: list[list[str]], password: str = "secret", algorithm: str = "RC4-128") -> bytes:
    """The same PDF encrypted with a user password ("" opens it: only printing or copying is restricted); pypdf
    writes it (AES with the cryptography package, which the documents extra brings)."""
    import pypdf

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdf(pages))))
    writer.encrypt(user_password=password, owner_password="owner", algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'
_CONTENT_TYPES = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">
<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>
<Default Extension="xml" ContentType="application/xml"/>
<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>
<Override PartName="/word/styles.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.styles+xml"/>
</Types>"""
_RELS = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">
<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/>
</Relationships>"""
_DOC_RELS = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">
<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/styles" Target="styles.xml"/>
</Relationships>"""
_STYLES = f"""<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<w:styles {_W}>
<w:style w:type="paragraph" w:default="1" w:styleId="Normal"><w:name w:val="Normal"/></w:style>
<w:style w:type="paragraph" w:styleId="Title"><w:name w:val="Title"/></w:style>
<w:style w:type="paragraph" w:styleId="Heading1"><w:name w:val="heading 1"/></w:style>
<w:style w:type="paragraph" w:styleId="Heading2"><w:name w:val="heading 2"/></w:style>
</w:styles>"""


def docx(blocks: list[tuple[str, str | list[list[str]]]]) -> bytes:
    """A DOCX of (style, text) paragraphs ("Normal", "Title", "Heading1", "Heading2") and ("table", rows) tables."""
    body = []
    for style, content in blocks:
        if style == "table":
            rows = "".join("<w:tr>" + "".join(f"<w:tc><w:p><w:r><w:t>{c}</w:t></w:r></w:p></w:tc>" for c in row) + "</w:tr>"
                           for row in content)
            body.append(f"<w:tbl>{rows}</w:tbl>")
        else:
            body.append(f'<w:p><w:pPr><w:pStyle w:val="{style}"/></w:pPr><w:r><w:t xml:space="preserve">{content}</w:t></w:r></w:p>')
    document = f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<w:document {_W}><w:body>{"".join(body)}</w:body></w:document>'
    return _zip([("[Content_Types].xml", _CONTENT_TYPES), ("_rels/.rels", _RELS), ("word/_rels/document.xml.rels", _DOC_RELS),
                 ("word/document.xml", document), ("word/styles.xml", _STYLES)])


def epub(chapters: list[tuple[str, str]]) -> bytes:
    """An EPUB 3 of (title, XHTML body) chapters, in spine order."""
    container = ('<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
                 '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>')
    items = "".join(f'<item id="c{i}" href="text/c{i}.xhtml" media-type="application/xhtml+xml"/>' for i in range(len(chapters)))
    spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters)))
    opf = ('<?xml version="1.0" encoding="UTF-8"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id">'
           '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:identifier id="id">kvcli-test</dc:identifier>'
           f'<dc:title>Test</dc:title></metadata><manifest>{items}</manifest><spine>{spine}</spine></package>')
    parts = [("mimetype", "application/epub+zip"), ("META-INF/container.xml", container), ("OEBPS/content.opf", opf)]
    for i, (title, body) in enumerate(chapters):
        parts.append((f"OEBPS/text/c{i}.xhtml", '<?xml version="1.0" encoding="UTF-8"?>\n<html xmlns="http://www.w3.org/1999/xhtml">'
                      f"<head><title>{title}</title></head><body>{body}</body></html>"))
    return _zip(parts)


def _zip(parts: list[tuple[str, str | bytes]]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, content in parts:
            z.writestr(name, content, compress_type=zipfile.ZIP_STORED if name == "mimetype" else zipfile.ZIP_DEFLATED)
    return out.getvalue()


def zip_bomb(inner: str = "word/document.xml", size: int = 80 * 1024 * 1024) -> bytes:
    """A DOCX-looking zip whose one part unpacks to `size` bytes of zeros from a few hundred KB."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("[Content_Types].xml", _CONTENT_TYPES)
        with z.open(zipfile.ZipInfo(inner), "w", force_zip64=True) as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(size >> 20):
                f.write(chunk)
    return out.getvalue()


def web_page(title: str, paragraphs: list[str], *, menu_items: int = 30) -> str:
    """A page as sites serve them: head with styles and scripts, a menu, the article, a sidebar and a footer."""
    menu = "".join(f'<li><a href="/s{i}">Section {i}</a></li>' for i in range(menu_items))
    body = "".join(f"<p>{p}</p>" for p in paragraphs)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title} | Example News</title>"
            "<style>body{font-family:sans-serif}.nav li{display:inline}</style>"
            "<script>window.dataLayer=[];function track(e){dataLayer.push(e)}</script></head><body>"
            f'<header class="masthead"><a href="/">Example News</a><nav class="nav"><ul>{menu}</ul></nav></header>'
            f'<main><article><h1>{title}</h1><p class="byline">By A. Writer</p>{body}<h2>Background</h2>{body[:400]}</article></main>'
            f'<aside class="sidebar"><h3>Most read</h3><ul>{menu}</ul></aside>'
            '<footer><p>Copyright Example News. All rights reserved.</p><a href="/privacy">Privacy</a></footer>'
            "<script>track({page:'article'})</script></body></html>")
