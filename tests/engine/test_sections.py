"""Documents longer than the window: sectioned caches (format 4), per-question selection, sources cited.

Cutting keeps every line in one section at headings, pages and paragraphs; the manifest records each section's
lines, pages and headings and is validated; each section stores only its own keys/values, equal to the model's
after the head and the section's primer; a grown document computes only its new sections; composing chosen sections
gives the documented prompt ids, and with every token recomputed equals a prefill of those ids, and the one-pass
recompute equals recomputing section by section; ask cites its sources (JSON and text), takes --sections/--all,
and a missing or damaged section refuses the cache naming the section (ask, verify).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine.cache import blend
from kvcli.engine.cache.kvcache import KVCache
from kvcli.engine.sections.build import prefill
from kvcli.engine.prompt import framing as fr
from kvcli.engine.sections import build, compose, cutting, select
from kvcli.engine.sections.session import SectionedSession, Sections
from kvcli.errors import CacheCorruptError, DocumentError, UsageError
from kvcli.format import manifest as mf, parts, store
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, json_lines, run
from tests.architectures import build as build_model

WINDOW = 1024


def words(texts):
    return [len(t.split()) for t in texts]


def test_cut_keeps_every_line_once_and_cuts_at_headings_and_pages():
    body = "\n".join(f"line {i} " + "word " * 20 for i in range(12))
    text = f"[page 1]\n# Intro\n{body}\n\n[page 2]\n# Terms\n{body}\n\n## Payment\n{body}"
    cuts = cutting.cut(text, words, target=200, least=100, most=300)
    lines = text.split("\n")
    held = [i for c in cuts for i in range(c.start_line, c.end_line + 1) if lines[i - 1].strip()]
    assert sorted(held) == [i + 1 for i, line in enumerate(lines) if line.strip()]  # each non-blank line once
    assert [c.text.split("\n")[0] for c in cuts][:3] == ["[page 1]", "[page 2]", "## Payment"]
    assert cuts[0].pages == [1] and cuts[0].headings == ["Intro"]
    assert cuts[1].pages == [2] and cuts[1].headings == ["Terms"]
    assert cuts[2].pages == [2] and cuts[2].headings == ["Payment"]
    assert all(sum(words([c.text])) <= 300 + 20 for c in cuts)


def test_a_long_paragraph_and_a_long_line_are_cut():
    para = "\n".join("w " * 50 for _ in range(20))  # one block of 1,000 words
    line = "v " * 900  # one line of 900 words
    cuts = cutting.cut(para + "\n\n" + line, words, target=200, least=100, most=300)
    assert len(cuts) >= 5
    assert all(len(c.text.split()) <= 300 for c in cuts)
    assert sum(len(c.text.split()) for c in cuts) == 1900  # nothing lost
    assert cuts[-1].start_line == cuts[-1].end_line == 22  # the long line's pieces share its number


def test_choose_fits_the_budget_in_document_order():
    sizes, ranks = [100, 100, 100, 100], [0.0, 2.0, 0.5, 3.0]
    c = select.choose(sizes, ranks, budget=205)
    assert c.chosen == [1, 3] and c.how == "ranked"  # the two best, in document order
    assert select.choose(sizes, [0.0] * 4, budget=205).chosen == [0, 1]  # nothing shared: the start
    assert select.choose(sizes, ranks, budget=1000).chosen == [1, 3]  # unscored and far weaker sections are left out
    many = select.choose([10] * 20, [1.0] * 20, budget=1000)
    assert many.chosen == list(range(select.DEFAULT_COUNT))  # at most DEFAULT_COUNT unless --sections says more
    assert select.choose(sizes, ranks, budget=1000, count=1).chosen == [3]
    assert select.choose(sizes, ranks, budget=10, every=True).chosen == [0, 1, 2, 3]


def test_bm25_ranks_the_section_that_holds_the_words():
    texts = ["The licensor grants a licence.", "Payment is due within thirty days of the invoice.", "Notices go by post."]
    s = select.scores(texts, "When is payment due?")
    assert max(range(3), key=s.__getitem__) == 1 and s[0] == 0.0
    defined = ["A Larger Work may be sold; a Larger Work, and a Larger Work again.", '"Larger Work" means a combined work.']
    plain, quoted = select.scores(defined, "What is a Larger Work?"), select.scores(defined, 'What is a "Larger Work"?')
    assert plain[0] > plain[1] and quoted[1] > quoted[0]  # a quoted term: the section defining it in quotes first


def test_the_text_line_cites_neighbouring_sections_as_one_range():
    from kvcli.cli.rendering import sources_line

    a = {"sources": [{"section": 1, "start_line": 3, "end_line": 9, "pages": [1], "headings": ["Terms"]},
                     {"section": 2, "start_line": 10, "end_line": 20, "pages": [1, 2], "headings": ["Payment"]},
                     {"section": 5, "start_line": 40, "end_line": 50, "headings": []}], "document_share": 0.2}
    assert sources_line(a) == '[sources: lines 3-20, pages 1-2, "Terms"; lines 40-50 (20% of the document)]'


@pytest.fixture(scope="module")
def doc(here):
    path = here / "long.txt"
    path.write_text(sample_text(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sectioned(tiny_lm, doc, here):
    out = here / "long.kv"
    r = prefill(tiny_lm, kvcli.read_document(doc), out, window=WINDOW)
    return out, r


def test_a_document_longer_than_the_window_becomes_sections(tiny_lm, sectioned, doc):
    out, r = sectioned
    m = store.read_manifest(out)
    assert m.format_version == mf.SECTIONED_VERSION and m.sections is not None
    parts = m.sections.parts
    head = fr.head_ids(tiny_lm.tokenizer, fr.choose(tiny_lm.tokenizer))
    assert m.token_ids == head and len(m.layers) == tiny_lm.model.config.num_hidden_layers
    assert len(parts) >= 4 and all(p.num_tokens <= cutting.MAX_TOKENS for p in parts)
    assert [p.start_line for p in parts] == sorted(p.start_line for p in parts)
    sep = tiny_lm.tokenizer(fr.SEPARATOR, add_special_tokens=False)["input_ids"]
    assert m.document_tokens == len(head) + sum(p.num_tokens for p in parts) + len(sep) * (len(parts) - 1)
    assert m.document_tokens + 320 > WINDOW and m.sections.window == WINDOW
    lines = doc.read_text().split("\n")
    for p in parts:  # the section's text is its lines of the document
        assert p.text.split("\n")[0].strip() == lines[p.start_line - 1].strip()
        assert all(e.cached_length == p.num_tokens for e in p.layers)
        assert (out / p.dir).is_dir()
    assert r.manifest.bytes_stored == m.bytes_stored == sum(f.stat().st_size for f in out.rglob("*.zst"))


def test_a_document_that_fits_stays_one_cache(tiny_lm, here):
    out = here / "short.kv"
    prefill(tiny_lm, decode(sample_text()[:1500].encode(), "short.txt"), out, window=WINDOW)
    m = store.read_manifest(out)
    assert m.format_version == mf.FORMAT_VERSION and m.sections is None


def test_each_section_stores_its_keys_after_the_head_and_its_primer(tiny_lm, sectioned):
    out, _r = sectioned
    m = store.read_manifest(out)
    head = m.token_ids
    from kvcli.engine.cache.restore import load_states
    from kvcli.format.parts import open_part

    for p in m.sections.parts[:3]:
        primer_len = p.position - len(head)
        assert primer_len == 0 if p.index == 0 else primer_len > build.TAIL_TOKENS
        first = m.sections.parts[0].token_ids
        before = m.sections.parts[p.index - 1].token_ids if p.index else []
        sep = tiny_lm.tokenizer(fr.SEPARATOR, add_special_tokens=False)["input_ids"]
        primer = (first[: build.START_TOKENS] + sep + before[-build.TAIL_TOKENS:] + sep) if p.index else []
        cache = KVCache.for_model(tiny_lm.model.config)
        with torch.inference_mode():
            tiny_lm.model(input_ids=torch.tensor([head + primer + p.token_ids]), cache=cache, use_cache=True)
        with open_part(out, m, p.index) as part:
            states = load_states(part)
        for layer, s in zip(cache.layers, states):
            torch.testing.assert_close(s.keys, layer.keys[:, :, p.position:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(s.values, layer.values[:, :, p.position:], atol=1e-4, rtol=1e-4)


def test_a_grown_document_computes_only_its_new_sections(tiny_lm, here):
    text = sample_text()
    out = here / "grow.kv"
    first = prefill(tiny_lm, decode(text.encode(), "grow.txt"), out, window=WINDOW)
    old = store.read_manifest(out)
    grown = text + "\n\n" + "\n\n".join(f"Annex {i}. The annex adds clause {i} to the terms above." for i in range(40))
    second = prefill(tiny_lm, decode(grown.encode(), "grow.txt"), out, window=WINDOW)
    new = store.read_manifest(out)
    assert second.grown_from == old.document_tokens and len(new.sections.parts) > len(old.sections.parts)
    kept = [p for p in new.sections.parts[: len(old.sections.parts) - 1]]
    for a, b in zip(old.sections.parts, kept):  # unchanged sections: the same shards, not recomputed
        assert [e.digest for e in a.layers] == [e.digest for e in b.layers]
    assert second.computed < first.computed
    parts.verify(out)


def test_refusals_at_prefill(tiny_lm, tokenizer, here):
    long = decode(sample_text().encode(), "long.txt")
    with pytest.raises(UsageError, match="--kv-bits"):
        prefill(tiny_lm, long, here / "q.kv", window=WINDOW, kv_bits=8)
    with pytest.raises(UsageError, match="--window 400"):
        prefill(tiny_lm, long, here / "w.kv", window=400)
    gpt2 = kvcli.from_objects(build_model("gpt2", tokenizer), tokenizer, name="tiny-gpt2")
    with pytest.raises(DocumentError, match="do not fit the window of 1024 positions"):
        prefill(gpt2, long, here / "g.kv", window=WINDOW)
    assert not (here / "q.kv").exists() and not (here / "g.kv").exists()


def test_the_manifest_is_validated(sectioned, here):
    out, _r = sectioned
    raw = json.loads((out / mf.MANIFEST_NAME).read_text())

    def refused(body, match):
        body["manifest_sha256"] = mf.checksum(body)
        with pytest.raises(CacheCorruptError, match=match):
            mf.parse(json.dumps(body).encode(), "m.json")

    body = json.loads(json.dumps(raw))
    body["sections"]["parts"][1]["dir"] = "../s0001"
    refused(body, "section folder")
    body = json.loads(json.dumps(raw))
    body["sections"]["parts"][2]["start_line"] = 1
    refused(body, "overlap or are out of order")
    body = json.loads(json.dumps(raw))
    body["format_version"] = 3
    refused(body, "format version 3 has no 'sections' block")
    body = json.loads(json.dumps(raw))
    body["sections"]["parts"][0]["layers"][0]["file"] = "../layer_000.safetensors.zst"
    refused(body, "shard name")


def test_composed_ids_follow_the_rule(tiny_lm, sectioned):
    out, _r = sectioned
    m = store.read_manifest(out)
    parts = m.sections.parts
    sep = tiny_lm.tokenizer(fr.SEPARATOR, add_special_tokens=False)["input_ids"]
    ids, plans = compose.prompt_ids(tiny_lm, m, [3, 1])
    assert ids == m.token_ids + parts[1].token_ids + sep + parts[3].token_ids
    assert [p.index for p, _g, _s in plans] == [1, 3]


def _sequential(lm, opened, chosen, f):
    """The blend way: each section's glue and first tokens run forward after everything before, one by one."""
    from kvcli.engine.cache.restore import load_cache, load_states
    from kvcli.format.parts import open_part

    m = opened.manifest
    ids, plans = compose.prompt_ids(lm, m, chosen)
    cache = load_cache(opened, room=len(ids))
    with torch.inference_mode():
        for p, glue, start in plans:
            n = p.num_tokens
            r = 0 if start == len(m.token_ids) and (p.position == start or f < 1) else min(n, math.ceil(f * n))
            run_ids = glue + p.token_ids[:r]
            if run_ids:
                lm.model(input_ids=torch.tensor([run_ids]), cache=cache, use_cache=True)
            with open_part(opened.path, m, p.index) as part:
                states = load_states(part, room=0)
            cos, sin = blend.rotation(lm, start - p.position)
            for layer, s in zip(cache.layers, states):
                layer.update(blend.move_keys(s.keys[:, :, r:], cos, sin), s.values[:, :, r:])
    return ids, cache


@pytest.mark.parametrize("chosen", [[0, 2, 4], [1, 3]])
def test_one_pass_recompute_equals_section_by_section(tiny_lm, sectioned, chosen):
    out, _r = sectioned
    with store.open_cache(out) as opened:
        made = compose.compose(tiny_lm, opened, chosen, 0.3)
        ids, ref = _sequential(tiny_lm, opened, chosen, 0.3)
    assert made.token_ids == ids and made.recomputed_tokens > 0
    q = torch.tensor([tiny_lm.tokenizer("What is this?", add_special_tokens=False)["input_ids"]])
    pos = torch.arange(len(ids), len(ids) + q.shape[1])[None]
    with torch.inference_mode():  # the same question on both: same logits (the cache's slot order does not matter)
        a = tiny_lm.model(input_ids=q, position_ids=pos, cache=made.cache, use_cache=True).logits
        b = tiny_lm.model(input_ids=q, position_ids=pos, cache=ref, use_cache=True).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_everything_recomputed_equals_a_prefill_of_the_composed_ids(tokenizer, here, name):
    lm = kvcli.from_objects(build_model(name, tokenizer), tokenizer, name=f"tiny-{name}")
    out = here / f"{name}.kv"
    prefill(lm, decode(sample_text().encode(), "doc.txt"), out, window=WINDOW)
    with store.open_cache(out) as opened:
        made = compose.compose(lm, opened, [1, 2, 4], 1.0)
    ids = made.token_ids + tokenizer("Why?", add_special_tokens=False)["input_ids"]
    q = torch.tensor([ids[len(made.token_ids):]])
    with torch.inference_mode():
        cached = lm.model(input_ids=q, position_ids=torch.arange(len(made.token_ids), len(ids))[None], cache=made.cache,
                          use_cache=True).logits[0, -1]
        full = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chosen", [[0, 2, 4], [1, 3]])
def test_recomputed_tokens_left_pending_run_in_the_questions_pass(tiny_lm, sectioned, chosen):
    """compose(defer=True) leaves the last recomputed tokens on the cache for the question's own forward pass: the
    same logits as composing them first, and through Sessions the same greedy answers, one question or several
    together (a batch settles them first), and again after the first question (they are the document's then)."""
    out, _r = sectioned
    with store.open_cache(out) as opened:
        whole = compose.compose(tiny_lm, opened, chosen, 0.3)
        folded = compose.compose(tiny_lm, opened, chosen, 0.3, defer=True)
        again = [compose.compose(tiny_lm, opened, chosen, 0.3, defer=True) for _ in range(2)]
    pending = folded.cache.pending
    assert whole.cache.pending is None and pending is not None and folded.token_ids == whole.token_ids
    assert len(pending.ids) == whole.recomputed_tokens == folded.recomputed_tokens  # one chunk: all of them pending
    assert folded.cache.get_seq_length() + len(pending.ids) == len(whole.token_ids)
    q = tiny_lm.tokenizer("What is this?", add_special_tokens=False)["input_ids"]
    n = len(whole.token_ids)
    with torch.inference_mode():
        a = tiny_lm.model(input_ids=torch.tensor([q]), position_ids=torch.arange(n, n + len(q))[None], cache=whole.cache,
                          use_cache=True).logits[0, -1]
        b = tiny_lm.model(**folded.cache.forward_inputs(q, tiny_lm.device), cache=folded.cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    folded.cache.settled()
    assert folded.cache.pending is None and {layer.mark for layer in folded.cache.layers} == {n}

    def session(made):
        return kvcli.Session.composed(tiny_lm, out, store.read_manifest(out), made, blended={})

    options = kvcli.GenerationOptions(max_new_tokens=6)
    questions = ["What is this?", "Who pays for patent litigation?"]
    with store.open_cache(out) as opened:
        reference = session(compose.compose(tiny_lm, opened, chosen, 0.3)).ask_many(questions, options, batch_size=1)
    one = session(again[0])
    first = one.ask(questions[0], options)
    assert one.cache.pending is None and first.processed_tokens == reference[0].processed_tokens
    assert [first.answer_token_ids, one.ask(questions[1], options).answer_token_ids] == [r.answer_token_ids for r in reference]
    together = session(again[1]).ask_many(questions, options)
    assert [a.answer_token_ids for a in together] == [r.answer_token_ids for r in reference]


def test_session_answers_with_sources(tiny_lm, sectioned):
    out, _r = sectioned
    with store.open_cache(out) as opened:
        session = SectionedSession(tiny_lm, opened, Sections(count=2), session=kvcli.Session)
        a = session.ask("What about patent litigation?", kvcli.GenerationOptions(max_new_tokens=4))
    m = store.read_manifest(out)
    assert len(a.sources) == 2 and a.blended["sections"] == [s["section"] for s in a.sources]
    for s in a.sources:
        p = m.sections.parts[s["section"]]
        assert (s["start_line"], s["end_line"]) == (p.start_line, p.end_line) and s["score"] >= 0
    assert 0 < a.document_share < 1
    assert "patent" in " ".join(m.sections.parts[a.sources[0]["section"]].text.lower().split()) or any(
        "patent" in m.sections.parts[s["section"]].text.lower() for s in a.sources)
    with pytest.raises(UsageError):
        Sections(count=2, every=True)


@pytest.fixture(scope="module")
def cli_cache(tiny_model_dir, doc, here):
    out = here / "cli.kv"
    result = run("prefill", doc, "-o", out, "--model", tiny_model_dir, "--window", WINDOW, "--json")
    assert result.exit_code == 0, result.stderr
    record = json_lines(result.stdout)[0]
    assert record["sections"] >= 4 and record["num_tokens"] > WINDOW
    return out


def test_cli_ask_cites_its_sources(cli_cache, tiny_model_dir):
    q = "What does the licence say about trademarks?"
    result = run("ask", "--cache", cli_cache, "--model", tiny_model_dir, q, "--json", "--max-new-tokens", "4", "--no-server")
    assert result.exit_code == 0, result.stderr
    a = json_lines(result.stdout)[0]
    assert a["sources"] and {"section", "start_line", "end_line", "headings", "score"} <= set(a["sources"][0])
    assert 0 < a["document_share"] < 1
    assert "sections of a document longer than the window" in result.stderr
    text = run("ask", "--cache", cli_cache, "--model", tiny_model_dir, q, "--max-new-tokens", "4", "--no-server")
    assert text.exit_code == 0, text.stderr
    last = text.stdout.rstrip("\n").split("\n")[-1]
    assert last.startswith("[sources: lines ") and "of the document)]" in last


def test_cli_sections_all_and_check(cli_cache, tiny_model_dir):
    one = run("ask", "--cache", cli_cache, "--model", tiny_model_dir, "Who grants it?", "--sections", "1", "--json",
              "--max-new-tokens", "3", "--no-server")
    assert one.exit_code == 0, one.stderr
    assert len(json_lines(one.stdout)[0]["sources"]) == 1
    every = run("ask", "--cache", cli_cache, "--model", tiny_model_dir, "Who grants it?", "--all", "--json",
                "--max-new-tokens", "3", "--no-server", "--check")
    assert every.exit_code in (0, 4), every.stderr
    a = json_lines(every.stdout)[0]
    m = store.read_manifest(cli_cache)
    assert [s["section"] for s in a["sources"]] == list(range(len(m.sections.parts))) and a["document_share"] == 1.0
    assert a["check"]["blended"]["of"] == len(m.sections.parts)
    said = run("ask", "--cache", cli_cache, "--model", tiny_model_dir, "Who grants it?", "--sections", "2",
               "--max-new-tokens", "3", "--no-server", "--check")
    assert said.exit_code in (0, 4), said.stderr
    assert "2 of" in said.stderr and "sections composed" in said.stderr and "recomputing the same sections' text" in said.stderr


def test_cli_refuses_section_options_on_a_plain_cache(cache_dir, tiny_model_dir):
    result = run("ask", "--cache", cache_dir, "--model", tiny_model_dir, "Who?", "--sections", "2", "--no-server")
    assert_clean_error(result, 2, "--sections and --all", "is not one")
    both = run("ask", "--cache", cache_dir, "--model", tiny_model_dir, "Who?", "--blend", "--cache", cache_dir, "--sections", "2")
    assert both.exit_code == 2


def test_a_missing_or_damaged_section_refuses_the_cache(cli_cache, tiny_model_dir, here):
    missing = here / "missing.kv"
    shutil.copytree(cli_cache, missing)
    shutil.rmtree(missing / "s0002")
    result = run("ask", "--cache", missing, "--model", tiny_model_dir, "Who grants it?", "--no-server")
    assert_clean_error(result, 3, "section 2 (lines")
    assert_clean_error(run("verify", missing), 3, "section 2 (lines")
    damaged = here / "damaged.kv"
    shutil.copytree(cli_cache, damaged)
    shard = damaged / "s0001" / "layer_001.safetensors.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert_clean_error(run("verify", damaged), 3, "section 1 (lines", "damaged")
    every = run("ask", "--cache", damaged, "--model", tiny_model_dir, "Who grants it?", "--all", "--no-server")
    assert_clean_error(every, 3, "section 1 (lines", "damaged")


def test_info_ls_verify_and_rm_know_sections(cli_cache, here):
    m = store.read_manifest(cli_cache)
    info = run("info", cli_cache, "--json")
    assert info.exit_code == 0, info.stderr
    s = json.loads(info.stdout)
    assert s["num_tokens"] == m.document_tokens and len(s["sections"]) == len(m.sections.parts)
    assert s["sections"][1]["start_line"] == m.sections.parts[1].start_line and s["sections"][1]["tokens"] == m.sections.parts[1].num_tokens
    assert s["bytes_on_disk"] == sum(f.stat().st_size for f in cli_cache.rglob("*.zst"))
    text = run("info", cli_cache)
    assert text.exit_code == 0 and f"{len(m.sections.parts)} (a document longer than the window" in text.stdout
    listed = run("ls", cli_cache.parent, "--json")
    row = next(r for r in json.loads(listed.stdout) if r["path"].endswith("cli.kv"))
    assert row["num_tokens"] == m.document_tokens
    ok = run("verify", cli_cache, "--json")
    assert ok.exit_code == 0 and json_lines(ok.stdout)[0]["sections"] == len(m.sections.parts)
    gone = here / "gone.kv"
    shutil.copytree(cli_cache, gone)
    (gone / "s0001" / "notes.txt").write_text("mine")
    assert run("rm", gone).exit_code == 1 and gone.exists()  # a section folder holding other files is not removed
    (gone / "s0001" / "notes.txt").unlink()
    assert run("rm", gone).exit_code == 0 and not gone.exists()
