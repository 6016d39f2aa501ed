"""Documents as users have them: PDF, HTML, DOCX and EPUB read by their content, with pages and headings kept in the
text the model reads, a converted document's identity in the manifest, and a clear refusal of what cannot be read."""

from __future__ import annotations

import json
import sys
import textwrap

import fsspec
import pytest

import kvcli
from kvcli import documents
from kvcli.documents import pdf as pdf_reader
from kvcli.errors import DocumentError
from tests import docfiles
from tests.conftest import reference_answer, sample_text
from tests.helpers import assert_clean_error, json_lines, run, run_python

CONVERTERS = ("pypdf", "docx", "lxml", "kvcli.documents.pdf", "kvcli.documents.office", "kvcli.documents.markup")
FACT = "The Licensor of the Harbour Works is Quillfeather Shipping Ltd of Port Averly."


def pages(count: int = 3) -> list[list[str]]:
    """The sample text cut into lines of a page, a stated fact on the second page (or the only one)."""
    lines = textwrap.wrap(" ".join(sample_text()[:600 * count].split()), 90)
    per = len(lines) // count
    out = [lines[i * per:(i + 1) * per] for i in range(count)]
    out[min(1, count - 1)].insert(3, FACT)
    return out


@pytest.fixture(scope="module")
def report(here):
    path = here / "report.pdf"
    path.write_bytes(docfiles.pdf(pages()))
    return path


# ---- one per format


def test_pdf_keeps_its_pages_in_the_text_and_the_record():
    doc = documents.from_bytes(docfiles.pdf(pages()), "report.pdf")
    assert doc.format == "pdf" and doc.pages == 3 and doc.converter.startswith("kvcli-pdf/2 pypdf/") and doc.page_numbers == "position"
    assert [line for line in doc.text.splitlines() if line.startswith("[page")] == ["[page 1]", "[page 2]", "[page 3]"]
    page2 = doc.text.split("[page 2]\n", 1)[1].split("\n\n[page 3]")[0]
    assert FACT in page2.splitlines()
    record = doc.record()
    assert record["format"] == "pdf" and record["pages"] == 3 and record["chars"] == len(doc.text)
    assert documents.from_bytes(docfiles.pdf(pages()), "report.pdf") == doc  # the same bytes give the same text


def _labelled_pdf() -> bytes:
    """The three pages, the first numbered i (a preface), the others 1 and 2 as printed, and an outline: a chapter on
    the second page, a section of it and a second chapter on the third."""
    import io

    import pypdf

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(docfiles.pdf(pages()))))
    writer.set_page_label(0, 0, style="/r")
    writer.set_page_label(1, 2, style="/D", start=1)
    chapter = writer.add_outline_item(title="Harbour  Works", page_number=1)
    writer.add_outline_item(title="Dues", page_number=2, parent=chapter)
    writer.add_outline_item(title="Appendix", page_number=2)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_pdf_pages_are_numbered_as_printed_and_its_outline_marks_headings():
    doc = documents.from_bytes(_labelled_pdf(), "report.pdf")
    assert [line for line in doc.text.splitlines() if line.startswith(("[page", "#"))] == [
        "[page i]", "[page 1]", "# Harbour Works", "[page 2]", "## Dues", "# Appendix"]
    assert doc.page_numbers == "printed" and doc.sections == 3 and doc.pages == 3
    assert FACT in doc.text.split("# Harbour Works\n", 1)[1].split("[page 2]")[0]
    record = doc.record()
    assert (record["page_numbers"], record["sections"]) == ("printed", 3)
    assert documents.describe(record) == "pdf, 3 pages, 3 sections, page numbers as printed"
    plain = documents.from_bytes(docfiles.pdf(pages()), "report.pdf")  # no labels, no outline: positions, said so
    assert (plain.page_numbers, plain.sections) == ("position", None) and plain.record()["page_numbers"] == "position"


def test_html_keeps_the_main_content_and_its_headings():
    page = docfiles.web_page("Harbour dues rise", ["Dues rise by 4% from March.", FACT], menu_items=20)
    doc = documents.from_bytes(page.encode(), "news.html")
    assert doc.format == "html" and doc.sections == 2 and doc.converter == "kvcli-html/1"
    assert doc.text.splitlines()[0] == "# Harbour dues rise" and "\n## Background\n" in doc.text and FACT in doc.text
    for furniture in ("Section 3", "Most read", "Copyright", "dataLayer", "font-family", "Example News"):
        assert furniture not in doc.text


def test_html_in_a_declared_charset_is_read_as_declared():
    page = "<html><head><meta charset='latin-1'></head><body><h1>Caf\xe9</h1><p>Cr\xe8me br\xfbl\xe9e.</p></body></html>"
    doc = documents.from_bytes(page.encode("latin-1"), "menu.htm")
    assert doc.text == "# Café\nCrème brûlée."


def test_docx_keeps_headings_lists_and_tables_in_order():
    data = docfiles.docx([("Title", "Service Agreement"), ("Normal", "Between two parties."), ("Heading1", "Term"),
                          ("Normal", "It runs for five years."), ("table", [["Party", "Role"], ["Acme", "Supplier"]]),
                          ("Heading2", "Renewal"), ("Normal", "It renews  yearly.")])
    doc = documents.from_bytes(data, "agreement.docx")
    assert doc.format == "docx" and doc.sections == 3 and "python-docx/" in doc.converter
    assert doc.text == ("# Service Agreement\nBetween two parties.\n\n# Term\nIt runs for five years.\nParty | Role\nAcme | Supplier"
                        "\n\n## Renewal\nIt renews yearly.")


def test_epub_reads_its_chapters_in_spine_order():
    data = docfiles.epub([("One", "<h1>Chapter One</h1><p>The ship left at dawn.</p>"),
                          ("Two", "<nav><p>Contents</p></nav><h1>Chapter Two</h1><p>It came back at dusk.</p>")])
    doc = documents.from_bytes(data, "voyage.epub")
    assert doc.format == "epub" and doc.sections == 2
    assert doc.text == "# Chapter One\nThe ship left at dawn.\n\n# Chapter Two\nIt came back at dusk."


def test_text_and_markdown_are_read_as_written_with_the_record_they_always_had(tmp_path):
    md = tmp_path / "notes.md"
    md.write_text("# Notes\n\n<b>kept</b> as written\n", encoding="utf-8")
    doc = documents.read(md)
    assert doc.format == "text" and doc.text == md.read_text() and doc.converter is None
    assert set(doc.record()) == {"name", "sha256", "chars"}  # caches of text documents stay up to date


# ---- one per refusal


def refusal(data: bytes, name: str) -> str:
    with pytest.raises(DocumentError) as info:
        documents.from_bytes(data, name)
    message = str(info.value)
    assert message.startswith(f"{name}: ") and "\n" not in message
    return message


def test_encrypted_pdf_is_refused():
    assert "encrypted PDF that needs a password" in refusal(docfiles.encrypted_pdf(pages(1)), "locked.pdf")


def test_pdf_restricted_with_an_empty_password_is_read():
    for algorithm in ("RC4-128", "AES-256"):
        doc = documents.from_bytes(docfiles.encrypted_pdf(pages(1), password="", algorithm=algorithm), "restricted.pdf")
        assert doc.pages == 1 and FACT in doc.text


def test_pdf_without_text_layer_suggests_ocr():
    message = refusal(docfiles.pdf([["x"], ["y"]], text_layer=False), "scan.pdf")
    assert "no text layer" in message and "scanned" in message and "OCR" in message


def test_truncated_pdf_is_refused():
    data = docfiles.pdf(pages())
    assert "truncated PDF" in refusal(data[: len(data) * 2 // 3], "cut.pdf")


def test_damaged_pdf_is_refused():
    data = docfiles.pdf(pages()).replace(b"xref", b"xxxx")  # no cross-reference table, no startxref
    assert "a damaged or truncated PDF" in refusal(data, "broken.pdf")


def test_a_huge_page_is_refused(monkeypatch):
    from kvcli.documents import base

    monkeypatch.setattr(base, "MAX_PAGE_CHARS", 200)  # the bound, lowered to the size of a test page
    assert "page 2 holds more than 200 characters of text" in refusal(docfiles.pdf([["short"], ["x" * 90] * 3]), "huge.pdf")


def test_a_pdf_of_too_many_pages_is_refused_before_reading_them(monkeypatch):
    monkeypatch.setattr(pdf_reader, "MAX_PAGES", 2)
    assert "3 pages, more than the 2 kvcli reads" in refusal(docfiles.pdf(pages()), "long.pdf")


def test_an_epub_declaring_entities_is_refused():
    data = docfiles.epub([("One", "<p>x</p>")])
    bad = docfiles._zip([("mimetype", "application/epub+zip"),
                         ("META-INF/container.xml", '<?xml version="1.0"?><!DOCTYPE c [<!ENTITY a "aaaaaaaa">]><container/>')])
    assert documents.from_bytes(data, "ok.epub").text == "x"
    assert "declares a DTD or entities" in refusal(bad, "laughs.epub")


@pytest.mark.parametrize("data, name, says", [
    (docfiles.docx([("Normal", "x")]), "report.pdf", "the name says a PDF but the content is a Word (DOCX) file"),
    (docfiles.pdf([["x"]]), "notes.txt", "the name says text but the content is a PDF"),
    (b"just some words\n", "report.pdf", "the name says a PDF but the content is not one"),
])
def test_an_extension_that_lies_is_refused(data, name, says):
    assert says in refusal(data, name)


def test_content_decides_when_the_name_says_nothing():
    assert documents.from_bytes(docfiles.pdf(pages(1)), "download").format == "pdf"
    assert documents.from_bytes(b"<!DOCTYPE html><html><body><h1>Hi</h1></body></html>", "https://host/page").format == "html"
    assert documents.from_bytes(b"A PDF starts with %PDF-1.7 and ends with %%EOF.\n", "notes").format == "text"


def test_zip_bomb_is_refused_before_anything_is_unpacked():
    assert "decompression bomb" in refusal(docfiles.zip_bomb(), "bomb.docx")


def test_damaged_zip_is_refused():
    data = docfiles.docx([("Normal", "x")])
    assert "damaged or truncated" in refusal(data[: len(data) // 2], "half.docx")


@pytest.mark.parametrize("module, data, name", [("pypdf", docfiles.pdf([["x"]]), "report.pdf"),
                                                ("docx", docfiles.docx([("Normal", "x")]), "letter.docx")])
def test_a_missing_extra_is_named(monkeypatch, module, data, name):
    monkeypatch.setitem(sys.modules, module, None)  # `import pypdf` now fails as it does without the extra
    message = refusal(data, name)
    assert "needs the documents extra: pip install 'kvcli[documents]'" in message


# ---- through the CLI


def test_prefill_of_a_pdf_answers_exactly_and_says_its_pages(report, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    built = run("prefill", report, "--model", tiny_model_dir, "--json")
    assert built.exit_code == 0, built.stderr
    (record,) = json_lines(built.stdout)
    assert record["status"] == "built" and record["format"] == "pdf" and record["cache"].endswith("report.kv")
    cache = report.with_suffix(".kv")
    m = kvcli.read_manifest(cache)
    assert m.document["format"] == "pdf" and m.document["pages"] == 3 and m.document["sha256"] == documents.read(report).sha256
    asked = run("ask", "-c", cache, "--json", "--ids", "--max-new-tokens", "12", "Who is the Licensor of the Harbour Works?")
    assert asked.exit_code == 0, asked.stderr
    (a,) = json_lines(asked.stdout)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert a["answer_token_ids"] == reference_answer(model, a["prompt_token_ids"], 12)  # as exact as for text
    info = run("info", cache)
    assert info.exit_code == 0 and "report.pdf" in info.stdout and "pdf, 3 pages" in info.stdout and "pypdf/" in info.stdout
    as_json = json.loads(run("info", cache, "--json").stdout)
    assert as_json["document"]["format"] == "pdf" and as_json["document"]["pages"] == 3


def test_a_rerun_skips_an_unchanged_pdf_and_rebuilds_for_a_new_converter(report, here, tiny_model_dir, monkeypatch):
    listing = here / "list.txt"
    listing.write_text(f"{report}\n", encoding="utf-8")
    out = here / "caches"

    def statuses() -> list[str]:
        result = run("prefill", "--from-list", listing, "-o", out, "--model", tiny_model_dir, "--json")
        assert result.exit_code == 0, result.stderr
        return [r["status"] for r in json_lines(result.stdout)]

    assert statuses() == ["built"]
    assert statuses() == ["skipped"]  # the same file converts to the same text and record
    monkeypatch.setattr(pdf_reader, "VERSION", pdf_reader.VERSION + 1)
    assert statuses() == ["built"]  # another converter version may read other text: rebuilt


def test_a_pdf_that_grew_extends_its_cache(tmp_path, tiny_model_dir):
    path = tmp_path / "minutes.pdf"
    path.write_bytes(docfiles.pdf(pages(2)))
    assert run("prefill", path, "--model", tiny_model_dir).exit_code == 0
    path.write_bytes(docfiles.pdf(pages(2) + [["Page three adds the budget: 4,000 pounds."]]))
    grown = run("prefill", path, "--model", tiny_model_dir, "--json")
    assert grown.exit_code == 0, grown.stderr
    (record,) = json_lines(grown.stdout)
    assert record["status"] == "extended" and record["computed_tokens"] < record["num_tokens"]


@pytest.mark.parametrize("make, name, needle", [
    (lambda: docfiles.encrypted_pdf(pages(1)), "locked.pdf", "encrypted PDF"),
    (lambda: docfiles.pdf([["x"]], text_layer=False), "scan.pdf", "no text layer"),
    (lambda: docfiles.zip_bomb(), "bomb.docx", "decompression bomb"),
])
def test_prefill_refuses_with_one_line_and_writes_nothing(tmp_path, tiny_model_dir, make, name, needle):
    path = tmp_path / name
    path.write_bytes(make())
    result = run("prefill", path, "--model", tiny_model_dir)
    assert_clean_error(result, 1, name, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_count_of_a_pdf_shows_pages_and_loads_no_model(report, tiny_model_dir):
    human = run("count", report, "--model", tiny_model_dir)
    assert human.exit_code == 0 and "pdf, 3 pages" in human.stdout
    code = ("import json, sys\nfrom kvcli.cli import app\n"
            f"try:\n    app(['count', {str(report)!r}, '--model', {str(tiny_model_dir)!r}, '--json'], prog_name='kvcli')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print(json.dumps({'torch': 'torch' in sys.modules}))\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    (c,) = json_lines(lines[0])
    assert c["format"] == "pdf" and c["pages"] == 3 and c["tokens"] > 100 and json.loads(lines[-1]) == {"torch": False}


def test_count_of_text_and_help_import_no_converter(doc_file, tiny_model_dir):
    code = ("import json, sys\nfrom kvcli.cli import app\n"
            "for argv in (['--help'], ['count', sys.argv[1], '--model', sys.argv[2], '--json']):\n"
            "    try:\n        app(argv, prog_name='kvcli')\n    except SystemExit as e:\n        assert e.code in (0, None), e.code\n"
            f"print(json.dumps(sorted(m for m in {CONVERTERS!r} if m in sys.modules)))\n")
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code, str(doc_file), str(tiny_model_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_pdf_at_a_url_is_read_like_a_local_one():
    from kvcli.remote import objects

    url = "memory://kvcli-formats/report.pdf"
    with fsspec.open(url, "wb") as f:
        f.write(docfiles.pdf(pages()))
    doc = objects.read_document(url)
    assert doc.format == "pdf" and doc.pages == 3 and doc.text == documents.from_bytes(docfiles.pdf(pages()), "x.pdf").text
