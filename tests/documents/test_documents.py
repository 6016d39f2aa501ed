"""Reading documents: decode errors name the byte offset, --encoding reads other encodings, binary is refused."""

from __future__ import annotations

import io
import random
import sys

import pytest

from kvcli import documents
from kvcli.errors import DocumentError
from tests.helpers import assert_clean_error, run

TEXT = "Café crème, naïve façade — «quoted» and ½ price.\n"


def refused(data: bytes, encoding: str = "utf-8", name: str = "doc.txt") -> str:
    with pytest.raises(DocumentError) as info:
        documents.decode(data, name, encoding)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("data", "offset", "reason"),
    [
        (b"caf\xc3\xa9 ok \xff rest", 9, "invalid start byte"),
        (b"plain ascii then \xe9t\xe9", 17, "invalid continuation byte"),
        (b"abc\xe2\x82", 3, "unexpected end of data"),
        (b"\xed\xa0\x80 surrogate", 0, "invalid continuation byte"),
        (("x" * 100_000).encode() + b"\x80", 100_000, "invalid start byte"),
    ],
)
def test_utf8_errors_name_the_byte_offset(data, offset, reason):
    message = refused(data)
    assert f"at byte offset {offset}" in message and reason in message and "--encoding" in message
    assert message.startswith("doc.txt: not valid utf-8")


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252", "iso8859_15", "utf-16", "utf-16-le", "UTF_16BE", "utf-32", "utf-8-sig", "mac_roman"])
def test_other_encodings_read_with_encoding(encoding):
    data = TEXT.encode(encoding, errors="replace")  # a few characters do not exist in every encoding
    doc = documents.decode(data, "doc.txt", encoding)
    assert doc.text == data.decode(encoding).removeprefix("\ufeff")
    assert doc.sha256 == __import__("hashlib").sha256(data).hexdigest()
    if encoding in ("latin-1", "cp1252"):
        assert "at byte offset" in refused(data)  # the same bytes as utf-8: refused, with where


def test_utf16_errors_name_the_byte_offset():
    data = "ok".encode("utf-16-le") + b"\x00\xd8" + "x".encode("utf-16-le")  # a lone high surrogate
    message = refused(data, "utf-16-le")
    assert "byte offset 4" in message and "utf-16-le" in message


@pytest.mark.parametrize("encoding", ["no-such-encoding", "rot13", "base64", "hex", "zlib", "bz2"])
def test_unknown_or_non_text_encodings(encoding):
    assert refused(b"hello", encoding) == f"--encoding {encoding}: unknown encoding"


@pytest.mark.parametrize(
    ("label", "data"),
    [
        ("ELF", b"\x7fELF\x02\x01\x01\x00" + bytes(64)),
        ("PNG", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(32)),
        ("gzip", __import__("gzip").compress(b"hello world" * 50, mtime=0)),
        ("NUL after 1 MiB of text", b"a" * (1 << 20) + b"\x00" + b"b" * 100),
        ("one NUL", b"a perfectly normal line\x00\n"),
    ],
)
def test_binary_files_are_refused(label, data):
    message = refused(data)
    assert "binary" in message
    nul = data.find(b"\x00")
    if nul >= 0:
        assert f"byte offset {nul}" in message


def test_binary_without_nul_bytes_is_refused_even_in_a_permissive_encoding():
    rng = random.Random(3)
    data = bytes(b for b in rng.randbytes(20_000) if b)  # random bytes, no NUL: latin-1 decodes anything
    assert "binary" in refused(data, "latin-1")


def test_binary_in_a_wide_encoding_is_refused():
    data = "text".encode("utf-16-le") + b"\x00\x00" + "more".encode("utf-16-le")  # U+0000 inside UTF-16 text
    assert "binary" in refused(data, "utf-16-le")


@pytest.mark.parametrize(
    "text",
    [
        "\x1b[31mred\x1b[0m log line\n" * 50,  # coloured logs are text
        "col1\tcol2\fpage two\r\nline\vtab\n" * 20,
        "a few stray \x07 bells \x08 in a long text " * 10 + "x" * 5000,
    ],
)
def test_control_characters_of_real_text_are_accepted(text):
    assert documents.decode(text.encode(), "doc.txt").text == text


def test_bom_is_dropped_and_empty_is_refused():
    assert documents.decode(b"\xef\xbb\xbfhello", "d").text == "hello"
    assert documents.decode("\ufeffhello".encode("utf-16"), "d", "utf-16").text == "hello"
    for data in (b"", b"   \n\t\n", b"\xef\xbb\xbf"):
        assert "empty" in refused(data)


def test_read_files_folders_stdin_and_size_limit(tmp_path, monkeypatch):
    path = tmp_path / "doc.txt"
    path.write_bytes(TEXT.encode("latin-1", errors="replace"))
    assert documents.read(path, "latin-1").name == str(path)
    with pytest.raises(DocumentError, match="byte offset"):
        documents.read(path)
    with pytest.raises(DocumentError, match="is a folder"):
        documents.read(tmp_path)
    with pytest.raises(DocumentError, match="no such file"):
        documents.read(tmp_path / "missing.txt")
    monkeypatch.setattr(documents, "MAX_DOCUMENT_BYTES", 10)
    with pytest.raises(DocumentError, match="larger than"):
        documents.read(path, "latin-1")


def test_stdin_document_is_named_dash(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"from a pipe")))
    doc = documents.read("-")
    assert doc.name == "-" and doc.text == "from a pipe" and doc.record()["name"] == "-"


def test_recorded_name_has_no_control_characters(tmp_path, tiny_lm):
    """A file name with terminal escapes is recorded harmlessly, so its cache still validates."""
    from kvcli.format import store
    from kvcli.engine.prefilling import prefill

    path = tmp_path / "evil\x1b]0;title\x07\x1b[2J.txt"
    path.write_text("A short document about ducks and water.", encoding="utf-8")
    doc = documents.read(path)
    assert doc.record()["name"] == "evil?]0;title??[2J.txt"
    prefill(tiny_lm, doc, tmp_path / "evil.kv")
    assert store.verify(tmp_path / "evil.kv").document["name"] == "evil?]0;title??[2J.txt"


def test_cli_encoding_option_and_refusals(tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from kvcli.cli import app

    doc = tmp_path / "latin.txt"
    doc.write_bytes(("Les canards " * 20 + TEXT).encode("latin-1", errors="replace"))
    runner = CliRunner()
    bad = runner.invoke(app, ["prefill", str(doc), "--model", str(tiny_model_dir), "-q"])
    assert bad.exit_code == 1
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    offset = doc.read_bytes().index(b"\xe9")
    assert len(lines) == 1 and f"byte offset {offset}" in lines[0] and "--encoding" in lines[0], lines
    assert not doc.with_suffix(".kv").exists()
    ok = runner.invoke(app, ["prefill", str(doc), "--model", str(tiny_model_dir), "--encoding", "latin-1", "-q"])
    assert ok.exit_code == 0, ok.stderr
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(100))
    refused_bin = runner.invoke(app, ["prefill", str(binary), "--model", str(tiny_model_dir), "--encoding", "latin-1", "-q"])
    assert refused_bin.exit_code == 1 and "binary" in refused_bin.stderr and "Traceback" not in refused_bin.stderr
    assert not binary.with_suffix(".kv").exists()


@pytest.mark.parametrize(("encoding", "data", "suggested"), [
    ("utf-16", "A contract between two parties.\n".encode("utf-16"), "--encoding utf-16"),  # with its byte order mark
    ("utf-16-le", "A contract between two parties.\n".encode("utf-16-le"), "--encoding utf-16-le"),
    ("utf-16-be", "A contract between two parties.\n".encode("utf-16-be"), "--encoding utf-16-be"),
    ("utf-32", "A contract between two parties.\n".encode("utf-32"), "--encoding utf-32"),
])
def test_wide_text_read_as_utf8_names_its_encoding(tmp_path, tiny_model_dir, encoding, data, suggested):
    message = refused(data)
    assert suggested in message and "binary" not in message
    path = tmp_path / "notes.txt"
    path.write_bytes(data)
    assert_clean_error(run("count", path, "--model", tiny_model_dir), 1, "notes.txt", suggested)
    result = run("count", path, "--model", tiny_model_dir, "--encoding", encoding, "--json")
    assert result.exit_code == 0, result.stderr  # what the message suggests reads it
