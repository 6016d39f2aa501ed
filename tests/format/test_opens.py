"""A request opens its cache once: one `ask` parses the manifest once and opens each shard file once,
in-process and through the warm server; its question and a prefill's document are tokenized once."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest

from kvcli.format import manifest as mf, store
from tests.conftest import sample_text
from tests.helpers import run
from tests.serve_helpers import ThreadServer, short_dir


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    root = short_dir()
    (root / "doc.txt").write_text(sample_text()[:1500], encoding="utf-8")
    built = run("prefill", root / "doc.txt", "-o", root / "doc.kv", "--model", tiny_model_dir, "--no-server")
    assert built.exit_code == 0, built.stderr
    yield root


def _inside(path, cache: Path) -> bool:
    """Whether `path` (a str or PathLike; file descriptors and bytes are never cache files here) lies in `cache`."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    p = Path(os.path.abspath(path))
    return p == cache or p.parent == cache


@pytest.fixture
def opens(monkeypatch, world):
    """Counts, for the cache doc.kv: manifest parses, directory opens, each file opened through the store,
    and any file of it opened some other way (open(), Path.read_bytes) under "other"."""
    cache = Path(os.path.abspath(world / "doc.kv"))
    counts: Counter = Counter()
    real_parse, real_open_in, real_os_open, real_open = mf.parse, store._open_in, os.open, builtins.open

    def parse(raw, where):
        if _inside(where, cache):
            counts["parse"] += 1
        return real_parse(raw, where)

    def open_in(dir_fd, name, where):
        if Path(os.path.abspath(where)) == cache:
            counts[name] += 1
        return real_open_in(dir_fd, name, where)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is None and isinstance(path, (str, os.PathLike)) and Path(os.path.abspath(path)) == cache:
            counts["directory"] += 1
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def other_open(file, *args, **kwargs):
        if _inside(file, cache):
            counts["other"] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(mf, "parse", parse)
    monkeypatch.setattr(store, "_open_in", open_in)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", other_open)
    monkeypatch.setattr(io, "open", other_open)
    return counts


def _once_each(world) -> dict[str, int]:
    m = store.read_manifest(world / "doc.kv")
    return {"parse": 1, "directory": 1, mf.MANIFEST_NAME: 1, **{layer.file: 1 for layer in m.layers}}


def test_reading_a_manifest_opens_no_shard(world, opens):
    m = store.read_manifest(world / "doc.kv")
    assert dict(opens) == {"parse": 1, "directory": 1, mf.MANIFEST_NAME: 1} and len(m.layers) == 2


def test_an_in_process_ask_opens_its_cache_once(world, opens, monkeypatch):
    from kvcli.engine import answer as an

    expected = _once_each(world)
    opens.clear()
    tokenized: list[str] = []
    real = an.Session.prompt_ids
    monkeypatch.setattr(an.Session, "prompt_ids", lambda self, q, history=(): tokenized.append(q) or real(self, q, history))
    result = run("ask", "-c", world / "doc.kv", "What is the Licensor?", "Is there a warranty?", "--max-new-tokens", "4",
                 "--no-server")
    assert result.exit_code == 0, result.stderr
    assert dict(opens) == expected
    assert sorted(tokenized) == ["Is there a warranty?", "What is the Licensor?"]  # each question once


def test_a_served_ask_opens_its_cache_once(world, opens, monkeypatch):
    """Client and server in this process: the counts cover both; a second ask is answered from the held Session."""
    expected = _once_each(world)
    opens.clear()
    server = ThreadServer(short_dir() / "s.sock")
    try:
        monkeypatch.setenv("KVCLI_SOCKET", str(server.path))
        first = run("ask", "-c", world / "doc.kv", "What is the Licensor?", "--max-new-tokens", "4", "--server")
        assert first.exit_code == 0, first.stderr
        assert dict(opens) == expected
        opens.clear()
        again = run("ask", "-c", world / "doc.kv", "Is there a warranty?", "--max-new-tokens", "4", "--server")
        assert again.exit_code == 0, again.stderr
        assert dict(opens) == {}
        assert sum(c["answers"] for c in server.server.warm.status()["caches"]) == 2
    finally:
        server.close()


def test_a_prefill_tokenizes_its_document_once(world, tiny_model_dir, tmp_path, monkeypatch):
    """The fit check made before the model loads hands its split to prefill: the cache holds what the loaded
    model's own tokenizer makes of the document."""
    import kvcli
    from kvcli.engine import prefilling as pf
    from kvcli.engine.prompt import framing as fr

    lm = kvcli.load(str(tiny_model_dir))
    ids, frame = pf.document_split(lm, kvcli.read_document(world / "doc.txt"), fr.choose(lm.tokenizer))

    splits: list[int] = []
    real = fr.split_document
    monkeypatch.setattr(fr, "split_document", lambda tok, framing, text: splits.append(len(text)) or real(tok, framing, text))
    built = run("prefill", world / "doc.txt", "-o", tmp_path / "again.kv", "--model", tiny_model_dir, "--no-server")
    assert built.exit_code == 0, built.stderr
    assert len(splits) == 1
    m = store.read_manifest(tmp_path / "again.kv")
    assert m.token_ids == ids and m.framing == frame.record(lm.tokenizer)
    listing = tmp_path / "list.txt"  # a list run (the same driver, the model loaded first) tokenizes it once too
    listing.write_text(f"{world / 'doc.txt'}\n", encoding="utf-8")
    listed = run("prefill", "--from-list", listing, "-o", tmp_path / "listed", "--model", tiny_model_dir)
    assert listed.exit_code == 0, listed.stderr
    assert len(splits) == 2 and store.read_manifest(tmp_path / "listed" / "doc.kv").token_ids == ids
