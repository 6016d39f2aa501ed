"""Follow-ups on the command line: `kvcli chat`, and `kvcli ask --json` output fed back with --follow-up."""

from __future__ import annotations

import json

import pytest

import kvcli
from kvcli.documents import decode
from kvcli.engine.prompt.conversation import Chat
from tests.conftest import reference_answer, sample_text
from tests.helpers import assert_clean_error, json_lines, run

Q1, Q2, Q3 = "What does the word Licensor mean?", "And the Licensee?", "Say it again."
OPTS = kvcli.GenerationOptions(max_new_tokens=8)


@pytest.fixture(scope="module")
def cached(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    lm = kvcli.load(str(tiny_model_dir))
    kvcli.prefill(lm, decode(sample_text()[:1500].encode(), "licence.txt"), folder / "doc.kv")
    kvcli.prefill(lm, decode(sample_text()[4000:5000].encode(), "other.txt"), folder / "other.kv")
    return folder, lm


def test_chat_keeps_the_conversation(cached):
    folder, lm = cached
    talk = Chat(kvcli.Session(lm, folder / "doc.kv"))
    expected = [talk.ask(q, OPTS) for q in (Q1, Q2, Q3)]
    for a in expected:  # each turn exact against generate() on the whole conversation
        assert a.answer_token_ids == reference_answer(lm.model, a.prompt_token_ids, 8)
    plain = run("chat", "--cache", folder / "doc.kv", "--max-new-tokens", 8, input=f"{Q1}\n\n{Q2}\n{Q3}\n")
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout == "".join(a.answer + "\n" for a in expected)
    as_json = run("chat", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", input=f"{Q1}\n{Q2}\n{Q3}\n")
    rows = json_lines(as_json.stdout)
    assert [r["answer_token_ids"] for r in rows] == [a.answer_token_ids for a in expected]
    assert "history" not in rows[0] and rows[2]["history"] == [{"question": Q1, "answer": expected[0].answer},
                                                               {"question": Q2, "answer": expected[1].answer}]


def test_ask_json_fed_back_for_a_follow_up(cached, tmp_path):
    folder, lm = cached
    first = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", Q1)
    (tmp_path / "turn1.jsonl").write_text(first.stdout)
    second = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--follow-up", tmp_path / "turn1.jsonl", Q2)
    assert second.exit_code == 0, second.stderr
    (tmp_path / "turn2.jsonl").write_text(second.stdout)
    third = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--follow-up", "-", Q3, input=second.stdout)
    talk = Chat(kvcli.Session(lm, folder / "doc.kv"))
    for out in (first, second, third):
        row = json_lines(out.stdout)[0]
        a = talk.ask(row["question"], OPTS)
        assert row["answer_token_ids"] == a.answer_token_ids == reference_answer(lm.model, a.prompt_token_ids, 8)
        assert row["prompt_token_ids"] == a.prompt_token_ids
    assert json_lines(third.stdout)[0]["history"] == [{"question": Q1, "answer": json_lines(first.stdout)[0]["answer"]},
                                                      {"question": Q2, "answer": json_lines(second.stdout)[0]["answer"]}]
    # chat can start from the same file
    chat = run("chat", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--follow-up", tmp_path / "turn2.jsonl", input=f"{Q3}\n")
    assert json_lines(chat.stdout)[0]["answer_token_ids"] == json_lines(third.stdout)[0]["answer_token_ids"]


def test_follow_up_errors(cached, tmp_path):
    folder, _lm = cached
    other = run("ask", "--cache", folder / "other.kv", "--max-new-tokens", 4, "--json", Q1)
    (tmp_path / "other.jsonl").write_text(other.stdout)
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    (tmp_path / "shape.jsonl").write_text(json.dumps({"question": 1}) + "\n")
    cases = [("other.jsonl", "another document"), ("empty.jsonl", "empty"), ("junk.jsonl", "not JSON"),
             ("shape.jsonl", "not a `kvcli ask --json` answer")]
    for name, needle in cases:
        result = run("ask", "--cache", folder / "doc.kv", "--follow-up", tmp_path / name, Q2)
        assert_clean_error(result, 2, needle)
    assert_clean_error(run("ask", "--cache", folder / "doc.kv", "--follow-up", "-", input=other.stdout), 2, "reads stdin")
