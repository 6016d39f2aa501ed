"""Caches that extend caches (`prefill --after`) and documents that grew: exact, link by link.

"Exact" as everywhere: the answer ids from the restored chain equal greedy generate() on the whole prompt's
ids with no cache, on every tiny architecture (full and sliding-window layers), and the model ran forward
only the new document's tokens at prefill and only the question's at answer time.
"""

from __future__ import annotations

import json
import shutil

import pytest

import kvcli
from kvcli.documents import decode
from kvcli.engine.prefilling import prefill
from kvcli.errors import CacheMismatchError, CacheMissingError
from kvcli.format import store
from tests.conftest import TokenCounter, reference_answer, sample_text
from tests.helpers import assert_clean_error, run
from tests.architectures import ARCHS, build

QUESTION = "What does the word Licensor mean?"
OPTS = kvcli.GenerationOptions(max_new_tokens=8)
PARTS = (sample_text()[:900], sample_text()[900:1500], sample_text()[1500:2100])


def _doc(text: str, name: str):
    return decode(text.encode(), name)


def _chain(lm, tmp_path, parts=PARTS, chunk_size=40):
    """Prefill parts[0], then each next part --after the one before; the caches' paths."""
    paths = []
    for i, text in enumerate(parts):
        path = tmp_path / f"part{i + 1}.kv"
        prefill(lm, _doc(text, f"part{i + 1}.txt"), path, chunk_size=chunk_size, after=paths[-1] if paths else None)
        paths.append(path)
    return paths


@pytest.mark.parametrize("name", [n for n in ARCHS if n != "gpt2"] + ["gpt2"])
def test_chain_answers_equal_generate_on_the_whole_prompt(tokenizer, plain_tokenizer, tmp_path, name):
    tok = plain_tokenizer if ARCHS[name][1] else tokenizer
    model = build(name, tok)
    lm = kvcli.from_objects(model, tok, name=f"tiny-{name}")
    parts = PARTS if name != "gpt2" else tuple(p[:300] for p in PARTS)  # gpt2's absolute positions end at 1024
    counter = TokenCounter(model)
    paths = _chain(lm, tmp_path, parts)
    m1, m2, m3 = (store.read_manifest(p) for p in paths)
    # each link ran only its own document's tokens, and stores only those of its full layers
    assert counter.total == m3.num_tokens
    assert m2.base["num_tokens"] == m1.num_tokens and m3.base["num_tokens"] == m2.num_tokens
    assert m3.token_ids[: m2.num_tokens] == m2.token_ids
    for entry in m3.layers:
        want = m3.num_tokens - m2.num_tokens if entry.kind == "full" else min(m3.num_tokens, entry.sliding_window - 1)
        assert entry.cached_length == want
    session = kvcli.Session(lm, paths[-1])
    assert session.token_ids == m3.token_ids
    counter.reset()
    a = session.ask(QUESTION, OPTS)
    assert counter.total == len(a.prompt_token_ids) - m3.num_tokens + len(a.answer_token_ids) - 1
    assert a.answer_token_ids == reference_answer(model, a.prompt_token_ids, OPTS.max_new_tokens)
    counter.close()


def test_chain_ids_are_those_of_the_joined_document(default_lm, tmp_path):
    """With the default model's tokenizer, base ids + link ids tokenize the documents joined by a blank line
    exactly as one prefill of the whole text would."""
    from kvcli.engine.prompt import framing as fr

    paths = _chain(default_lm, tmp_path, PARTS[:2], chunk_size=256)
    whole = fr.split_document(default_lm.tokenizer, fr.choose(default_lm.tokenizer), PARTS[0].strip() + "\n\n" + PARTS[1].strip())[0]
    assert store.read_manifest(paths[-1]).token_ids == whole
    session = kvcli.Session(default_lm, paths[-1])
    a = session.ask(QUESTION, OPTS)
    assert a.answer_token_ids == reference_answer(default_lm.model, a.prompt_token_ids, OPTS.max_new_tokens)


@pytest.fixture
def llama(tokenizer):
    model = build("llama", tokenizer)
    return kvcli.from_objects(model, tokenizer, name="tiny-llama")


def test_a_broken_link_is_named(llama, tokenizer, tmp_path):
    p1, p2, p3 = _chain(llama, tmp_path)
    assert [c.path for c in store.open_cache(p3).chain()] == [p1, p2, p3]
    shutil.rmtree(p2)
    with pytest.raises(CacheMissingError, match=f"{p3}: extends {p2}"):
        store.open_cache(p3)
    # the middle link made again from other text: the top link no longer fits it
    prefill(llama, _doc(PARTS[1].upper(), "part2.txt"), p2, chunk_size=40, after=p1)
    with pytest.raises(CacheMismatchError, match="has changed since"):
        kvcli.Session(llama, p3)
    # a base of another model is refused when extending it
    other = kvcli.from_objects(build("llama", tokenizer, seed=1), tokenizer, name="tiny-llama-1")
    with pytest.raises(CacheMismatchError):
        prefill(other, _doc(PARTS[2], "part3.txt"), tmp_path / "x.kv", after=p1)


def test_a_chain_moves_as_one_folder(llama, tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    _chain(llama, a, PARTS[:2])
    shutil.move(a, tmp_path / "b")
    session = kvcli.Session(llama, tmp_path / "b" / "part2.kv")
    assert session.ask(QUESTION, OPTS).answer_token_ids


def test_a_grown_document_computes_only_what_was_added(tokenizer, tmp_path):
    model = build("llama", tokenizer)
    lm = kvcli.from_objects(model, tokenizer, name="tiny-llama")
    path = tmp_path / "doc.kv"
    first = prefill(lm, _doc(PARTS[0], "doc.txt"), path, chunk_size=64)
    counter = TokenCounter(model)
    grown = prefill(lm, _doc(PARTS[0] + PARTS[1], "doc.txt"), path, chunk_size=64)
    assert grown.computed == counter.total < grown.manifest.num_tokens - first.manifest.num_tokens + 8
    fresh = prefill(lm, _doc(PARTS[0] + PARTS[1], "doc.txt"), tmp_path / "fresh.kv", chunk_size=64)
    m = store.read_manifest(path)
    assert grown.grown_from == first.manifest.num_tokens and m.base is None
    assert m.token_ids == fresh.manifest.token_ids  # exactly the ids of the whole new document
    kept = grown.manifest.num_tokens - grown.computed
    assert first.manifest.token_ids[:kept] == m.token_ids[:kept] and kept >= first.manifest.num_tokens - 8
    a = kvcli.Session(lm, path).ask(QUESTION, OPTS)
    assert a.answer_token_ids == reference_answer(model, a.prompt_token_ids, OPTS.max_new_tokens)
    counter.close()


# ---------------------------------------------------------------------------------------------------
# the command line: prefill --after, a document that grew, info, ls, rm; the warm server
# ---------------------------------------------------------------------------------------------------


def test_cli_chain_info_ls_and_rm(tmp_path, tiny_model_dir):
    (tmp_path / "a.txt").write_text(PARTS[0], encoding="utf-8")
    (tmp_path / "b.txt").write_text(PARTS[1], encoding="utf-8")
    a, b = tmp_path / "a.kv", tmp_path / "b.kv"
    assert run("prefill", tmp_path / "a.txt", "--model", tiny_model_dir, "--no-server").exit_code == 0
    r = run("prefill", tmp_path / "b.txt", "--after", a, "--model", tiny_model_dir, "--no-server", "--json")
    assert r.exit_code == 0, r.stderr
    record = json.loads(r.stdout)
    ma, mb = store.read_manifest(a), store.read_manifest(b)
    assert record["status"] == "built" and record["base"] == str(a)
    assert record["computed_tokens"] == mb.num_tokens - ma.num_tokens and record["num_tokens"] == mb.num_tokens
    assert f"after {a}, computed {record['computed_tokens']:,}" in r.stderr
    body = json.loads(run("info", b, "--json").stdout)
    assert [row["path"] for row in body["chain"]] == [str(a), str(b)] and body["base"]["path"] == str(a)
    assert "chain" in run("info", b).stdout
    assert "(after a.kv)" in run("ls", tmp_path).stdout
    # the base is refused by rm while its link stays; both at once, or --force, go
    assert_clean_error(run("rm", a), 1, "b.kv extends it")
    assert a.is_dir()
    answer = run("ask", "--cache", b, "--no-server", "--max-new-tokens", "4", QUESTION, "--model", tiny_model_dir)
    assert answer.exit_code == 0 and answer.stdout.strip()
    assert run("rm", a, "--force").exit_code == 0 and not a.exists()
    assert_clean_error(run("ask", "--cache", b, "--no-server", QUESTION, "--model", tiny_model_dir), 3, f"extends {a}")
    assert_clean_error(run("verify", b), 3, f"extends {a}")


def test_cli_grown_document_says_what_it_computed(tmp_path, tiny_model_dir):
    doc = tmp_path / "doc.txt"
    doc.write_text(PARTS[0], encoding="utf-8")
    assert run("prefill", doc, "--model", tiny_model_dir, "--no-server").exit_code == 0
    before = store.read_manifest(tmp_path / "doc.kv").num_tokens
    doc.write_text(PARTS[0] + PARTS[1], encoding="utf-8")
    r = run("prefill", doc, "--model", tiny_model_dir, "--no-server", "--json")
    assert r.exit_code == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["status"] == "extended" and record["extended_from"] == before
    assert record["computed_tokens"] < record["num_tokens"] - before + 8
    assert f"extended {before:,} -> {record['num_tokens']:,} tokens, computed {record['computed_tokens']:,}" in r.stderr
    # another document is still refused without --force
    doc.write_text(PARTS[2], encoding="utf-8")
    assert_clean_error(run("prefill", doc, "--model", tiny_model_dir, "--no-server"), 1, "has changed since")


def test_served_chain_answers_as_in_process_and_notices_a_changed_base(tiny_model_dir, monkeypatch):
    from tests.serve_helpers import ThreadServer, short_dir

    root = short_dir()
    try:
        for i, text in enumerate(PARTS[:2]):
            (root / f"p{i + 1}.txt").write_text(text, encoding="utf-8")
        srv = ThreadServer(root / "s.sock")
        monkeypatch.chdir(root)
        monkeypatch.setenv("KVCLI_SOCKET", str(srv.path))
        try:
            assert run("prefill", "p1.txt", "--model", tiny_model_dir, "--server").exit_code == 0
            r = run("prefill", "p2.txt", "--after", "p1.kv", "--model", tiny_model_dir, "--server", "--json")
            assert r.exit_code == 0 and json.loads(r.stdout)["served"] is True, r.stderr
            args = ("ask", "-c", "p2.kv", QUESTION, "--max-new-tokens", "6")
            served, local = run(*args, "--server"), run(*args, "--no-server")
            assert served.exit_code == local.exit_code == 0 and served.stdout == local.stdout
            (root / "p1.txt").write_text(PARTS[2], encoding="utf-8")  # the base made again from another text
            assert run("prefill", "p1.txt", "--model", tiny_model_dir, "--server", "--force").exit_code == 0
            assert_clean_error(run(*args, "--server"), 3, "p1.kv", "has changed since")
        finally:
            srv.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_http_serves_a_chain_as_one_model(tiny_model_dir):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from kvcli.serve import http
    from kvcli.serve.docs import WarmProvider
    from tests.serve_helpers import ThreadServer, short_dir

    root = short_dir()
    try:
        lm = kvcli.load(str(tiny_model_dir))
        (root / "docs").mkdir()
        _chain(lm, root / "docs", PARTS[:2])
        want = kvcli.Session(lm, root / "docs" / "part2.kv").ask(QUESTION, OPTS).answer
        srv = ThreadServer(root / "s.sock")
        web = http.start("127.0.0.1", 0, provider=WarmProvider(srv.server.warm, [root / "docs"]))
        try:
            c = openai.OpenAI(base_url=web.base_url, api_key="x", max_retries=0, timeout=60)
            assert {"part1.kv", "part2.kv"} <= {m.id for m in c.models.list().data}
            r = c.chat.completions.create(model="part2.kv", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=OPTS.max_new_tokens)
            assert r.choices[0].message.content == want
            assert r.usage.prompt_tokens_details.cached_tokens == store.read_manifest(root / "docs" / "part2.kv").num_tokens
        finally:
            web.stop()
            srv.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_list_line_may_name_a_base(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for i, text in enumerate(PARTS[:2]):
        (tmp_path / f"p{i + 1}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "list.txt").write_text("p1.txt\np2.txt --after p1.kv\n", encoding="utf-8")
    args = ("prefill", "--from-list", "list.txt", "--model", tiny_model_dir, "--no-server", "--json")
    first = run(*args)
    assert first.exit_code == 0, first.stderr
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert [(r["status"], r["base"]) for r in rows] == [("built", None), ("built", "p1.kv")]
    assert store.read_manifest(tmp_path / "p2.kv").base["num_tokens"] == rows[0]["num_tokens"]
    again = [json.loads(line) for line in run(*args).stdout.splitlines()]
    assert [r["status"] for r in again] == ["skipped", "skipped"]
    (tmp_path / "list.txt").write_text("p1.txt\np2.txt\n", encoding="utf-8")  # no longer a chain: rebuilt alone
    alone = [json.loads(line) for line in run(*args).stdout.splitlines()]
    assert [r["status"] for r in alone] == ["skipped", "built"] and store.read_manifest(tmp_path / "p2.kv").base is None


def test_a_list_run_extends_a_document_that_grew(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.txt").write_text(PARTS[0], encoding="utf-8")
    (tmp_path / "list.txt").write_text("doc.txt\n", encoding="utf-8")
    args = ("prefill", "--from-list", "list.txt", "--model", tiny_model_dir, "--no-server", "--json")
    assert json.loads(run(*args).stdout)["status"] == "built"
    (tmp_path / "doc.txt").write_text(PARTS[0] + PARTS[1], encoding="utf-8")
    grown = json.loads(run(*args).stdout)
    assert grown["status"] == "extended" and grown["computed_tokens"] < grown["num_tokens"] - grown["extended_from"] + 8
    forced = json.loads(run(*args, "--force").stdout)
    assert forced["status"] == "built" and forced["computed_tokens"] == forced["num_tokens"]
