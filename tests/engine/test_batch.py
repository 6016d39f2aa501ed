"""Many questions at once (Session.ask_many, engine/decoding/batch.py): one decoding step serves every question.

Batched answers equal the same questions asked one by one, token for token, on every supported
architecture (sliding windows, softcapping, absolute positions), with questions of different lengths,
early stops, stop strings, seeds, and questions joining the batch as others finish. The document's
keys/values are shared, never copied per question, and never written.
"""

from __future__ import annotations

import pytest
import torch

import kvcli
from kvcli.engine.scheduling import probe
from kvcli.engine.decoding import batch
from tests.conftest import TokenCounter
from tests.architectures import ARCHS

QUESTIONS = (
    "What does the word Licensor mean?",
    "When does the patent license terminate?",
    "Is the Work provided with any warranty?",
    "Who?",
    "What must a redistribution of the Work include, and where must the notices be placed in it?",
)
MAX_NEW = 12


@pytest.mark.parametrize("name", list(ARCHS))
def test_batched_answers_equal_single_answers(arch, name):
    a = arch(name)
    session = kvcli.Session(a.lm, a.path)
    opts = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
    single = [session.ask(q, opts) for q in QUESTIONS]
    assert probe.batchable(a.model)
    counter = TokenCounter(a.model)
    try:
        many = session.ask_many(QUESTIONS, opts, batch_size=3)  # 5 questions, 3 rows: two join later
    finally:
        counter.close()
    for s, m in zip(single, many):
        assert m.question == s.question and m.prompt_token_ids == s.prompt_token_ids
        assert m.answer_token_ids == s.answer_token_ids, (name, m.question)
        assert m.answer == s.answer and m.finish_reason == s.finish_reason
        assert m.processed_tokens == s.processed_tokens == s.new_tokens + len(s.answer_token_ids) - 1
    # the model ran each question's ids and answers, never the document: forwards of at most 3 rows
    assert sum(counter.calls) <= sum(m.processed_tokens for m in many)


def test_document_is_shared_and_never_written(arch):
    a = arch("gemma2")
    session = kvcli.Session(a.lm, a.path)
    before = [(s.keys.clone(), s.values.clone()) for s in session.states]
    captured = []
    real = batch.SharedPrefixCache.__init__

    def spy(self, states, rows, capacity):
        real(self, states, rows, capacity)
        captured.append(self)

    batch.SharedPrefixCache.__init__ = spy
    try:
        session.ask_many(QUESTIONS, kvcli.GenerationOptions(max_new_tokens=40), batch_size=4)  # growth past 64 slots too
    finally:
        batch.SharedPrefixCache.__init__ = real
    (cache,) = captured
    for layer, s in zip(cache.layers, session.states):
        assert layer.prefix_keys.data_ptr() == s.keys.data_ptr()  # the session's own memory, not a copy
        assert layer.keys.shape[0] == 4  # one suffix row per question decoding, not per question asked
    for (k, v), s in zip(before, session.states):
        assert torch.equal(k, s.keys) and torch.equal(v, s.values)


def test_stops_seeds_and_order(arch):
    a = arch("llama")
    session = kvcli.Session(a.lm, a.path)
    for opts in (kvcli.GenerationOptions(max_new_tokens=MAX_NEW, stop=("e",)),
                 kvcli.GenerationOptions(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=7)):
        single = [session.ask(q, opts) for q in QUESTIONS]
        finished, texts = [], {}
        many = session.ask_many(QUESTIONS, opts, batch_size=4, on_answer=lambda i, ans: finished.append(i),
                                on_text=lambda i, t: texts.__setitem__(i, texts.get(i, "") + t))
        assert [m.answer_token_ids for m in many] == [s.answer_token_ids for s in single]
        assert [m.answer for m in many] == [s.answer for s in single]
        assert [texts.get(i, "") for i in range(len(QUESTIONS))] == [s.answer for s in single]
        assert sorted(finished) == list(range(len(QUESTIONS)))
        if opts.stop:  # "e" ends most answers early: rows leave the batch at different steps
            assert sum(m.finish_reason == "stop" for m in many) >= 2


def test_batch_size_one_asks_one_by_one(arch):
    a = arch("qwen2")
    session = kvcli.Session(a.lm, a.path)
    opts = kvcli.GenerationOptions(max_new_tokens=6)
    assert [m.answer_token_ids for m in session.ask_many(QUESTIONS[:2], opts, batch_size=1)] == \
        [session.ask(q, opts).answer_token_ids for q in QUESTIONS[:2]]


def test_cli_batched_output_equals_one_by_one(tiny_model_dir, tmp_path):
    """`ask` answers several questions together by default; stdout (plain and JSON) is what one by one gives."""
    from tests.helpers import json_lines, run

    doc = tmp_path / "doc.txt"
    doc.write_text("The licensor is Example Corp. The licence ends when a patent suit is filed. " * 20)
    cache = tmp_path / "doc.kv"
    assert run("prefill", doc, "-o", cache, "--model", tiny_model_dir, "-q").exit_code == 0
    qs = list(QUESTIONS)
    common = ["ask", "-c", cache, *qs, "--model", tiny_model_dir, "--max-new-tokens", "7", "--no-server"]
    one = run(*common, "--batch-size", "1")
    together = run(*common, "--batch-size", "3")
    assert one.exit_code == together.exit_code == 0, together.stderr
    assert together.stdout == one.stdout and together.stdout.count("\n") >= len(qs)
    one_j, together_j = run(*common, "--batch-size", "1", "--json", "--ids"), run(*common, "--json", "--ids")
    a, b = json_lines(one_j.stdout), json_lines(together_j.stdout)
    assert [x["question"] for x in b] == qs  # question order, whatever order they finished in
    for x, y in zip(a, b):
        for key in ("answer", "answer_token_ids", "prompt_token_ids", "processed_tokens", "finish_reason", "served"):
            assert x[key] == y[key], key


def test_cli_eight_questions_restore_the_cache_once_and_decode_in_one_batch(tiny_model_dir, tmp_path, monkeypatch):
    """`ask` with eight questions on one cache restores it once and runs all eight in every forward pass: the
    first step takes the eight questions' ids together, each later one a token for every row still decoding."""
    from kvcli.engine.cache import restore
    from kvcli.engine.scheduling import scheduler
    from tests.helpers import json_lines, run

    doc = tmp_path / "doc.txt"
    doc.write_text("The licensor is Example Corp. The licence ends when a patent suit is filed. " * 20)
    cache = tmp_path / "doc.kv"
    assert run("prefill", doc, "-o", cache, "--model", tiny_model_dir, "-q").exit_code == 0
    restores, rows = [], []
    load, step = restore.load_cache, scheduler.Engine._step
    monkeypatch.setattr(restore, "load_cache", lambda *a, **k: restores.append(a[0]) or load(*a, **k))

    def counted(engine, session, decoder):
        step(engine, session, decoder)
        rows.append(decoder.last_rows)

    monkeypatch.setattr(scheduler.Engine, "_step", counted)
    qs = [*QUESTIONS, "Who is the licensor?", "When does the licence end?", "What is filed?"]
    result = run("ask", "-c", cache, *qs, "--model", tiny_model_dir, "--max-new-tokens", "6", "--no-server", "--json")
    assert result.exit_code == 0, result.stderr
    answers = json_lines(result.stdout)
    assert [a["question"] for a in answers] == qs and {a["decoding"] for a in answers} == {"batched"}
    assert len(restores) == 1  # one restore for the eight
    longest = max(len(a["answer_token_ids"]) for a in answers)
    assert rows[0] == 8 and len(rows) == longest  # one forward pass per token, every row in it
    assert rows == sorted(rows, reverse=True)  # rows only leave as their answers end


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])  # full attention; sliding windows
def test_every_batched_answer_is_checked_against_a_recompute(arch, name):
    """ask_many(check=True) measures the batched path's own logits against one uncached forward (--check)."""
    a = arch(name)
    session = kvcli.Session(a.lm, a.path)
    opts = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
    alone = [session.ask(q, opts, check=True) for q in QUESTIONS]
    many = session.ask_many(QUESTIONS, opts, batch_size=3, check=True)
    for s, m in zip(alone, many):
        assert m.answer_token_ids == s.answer_token_ids
        assert m.check is not None and m.check.identical and m.check.tokens == len(m.answer_token_ids)
        assert m.check.max_logit_diff < 1e-3, m.check  # float32: rounding only, far from any near-tie here
        assert s.check.identical


def test_cli_check_runs_batched(tiny_model_dir, tmp_path):
    from tests.helpers import json_lines, run

    doc = tmp_path / "doc.txt"
    doc.write_text("The licensor is Example Corp. The licence ends when a patent suit is filed. " * 20)
    cache = tmp_path / "doc.kv"
    assert run("prefill", doc, "-o", cache, "--model", tiny_model_dir, "-q").exit_code == 0
    common = ["ask", "-c", cache, *QUESTIONS[:3], "--model", tiny_model_dir, "--max-new-tokens", "6", "--no-server", "--check"]
    together, one = run(*common, "--json"), run(*common, "--json", "--batch-size", "1")
    assert together.exit_code == one.exit_code == 0, together.stderr
    rows, single = json_lines(together.stdout), json_lines(one.stdout)
    assert [r["question"] for r in rows] == list(QUESTIONS[:3])
    for r, s in zip(rows, single):
        assert r["answer_token_ids"] == s["answer_token_ids"] and r["check"]["identical"] is True
        assert r["check"]["tokens"] == len(r["answer_token_ids"])
    plain = run(*common)
    assert plain.exit_code == 0 and plain.stderr.count("check:") == 3
