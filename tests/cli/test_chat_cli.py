"""Follow-ups on the command line: `kvcli chat`, and `kvcli ask --json` output fed back with --follow-up."""

from __future__ import annotations

import json

import pytest

import kvcli
from kvcli.documents import decode
from kvcli.engine.prompt.conversation import Chat
from tests.conftest import reference_answer, sample_text, tiny_llama
from tests.helpers import assert_clean_error, json_lines, piped, run
from tests.serve_helpers import ThreadServer, short_dir

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
    assert plain.stdout == piped([{"question": a.question, "answer": a.answer} for a in expected])  # `==> Q <==` before each
    as_json = run("chat", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", input=f"{Q1}\n{Q2}\n{Q3}\n")
    rows = json_lines(as_json.stdout)
    assert [r["answer_token_ids"] for r in rows] == [a.answer_token_ids for a in expected]
    assert "history" not in rows[0] and rows[2]["history"] == [{"question": Q1, "answer": expected[0].answer},
                                                               {"question": Q2, "answer": expected[1].answer}]


def test_ask_json_fed_back_for_a_follow_up(cached, tmp_path):
    folder, lm = cached
    first = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--ids", Q1)
    (tmp_path / "turn1.jsonl").write_text(first.stdout)
    second = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--ids", "--follow-up", tmp_path / "turn1.jsonl", Q2)
    assert second.exit_code == 0, second.stderr
    (tmp_path / "turn2.jsonl").write_text(second.stdout)
    third = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--ids", "--follow-up", "-", Q3, input=second.stdout)
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


def test_a_served_chat_prints_what_an_in_process_one_prints(cached, tmp_path, monkeypatch):
    """The one chat loop both ways, from a --follow-up file: the same answers, histories and stderr."""
    folder, _lm = cached
    first = run("ask", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--no-server", Q1)
    (tmp_path / "turn1.jsonl").write_text(first.stdout)
    args = ("chat", "--cache", folder / "doc.kv", "--max-new-tokens", 8, "--json", "--follow-up", tmp_path / "turn1.jsonl")
    server = ThreadServer(short_dir() / "s.sock")
    monkeypatch.setenv("KVCLI_SOCKET", str(server.path))
    try:
        served = run(*args, "--server", input=f"{Q2}\n\n{Q3}\n")
    finally:
        server.close()
    local = run(*args, "--no-server", input=f"{Q2}\n\n{Q3}\n")
    assert served.exit_code == local.exit_code == 0, (served.stderr, local.stderr)
    assert served.stderr == local.stderr
    here, there = json_lines(local.stdout), json_lines(served.stdout)
    assert [r["served"] for r in here + there] == [False, False, True, True]
    turns = [[(r["question"], r["answer_token_ids"], r["history"]) for r in rows] for rows in (here, there)]
    assert turns[0] == turns[1]
    a1 = json_lines(first.stdout)[0]["answer"]
    assert here[1]["history"] == [{"question": Q1, "answer": a1}, {"question": Q2, "answer": here[0]["answer"]}]


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


def test_chat_takes_the_anti_repetition_options_as_ask_does(cached):
    folder, lm = cached
    session, strict = kvcli.Session(lm, folder / "doc.kv"), kvcli.GenerationOptions(max_new_tokens=24, no_repeat_ngram_size=1, repetition_penalty=1.5)
    # a question whose answer these options change (a random model's answers repeat now and then)
    question = next(q for q in (Q1, Q2, Q3, "Go on.", "Tell me more.", "Why?", "How?")
                    if session.ask(q, strict).answer_token_ids != session.ask(q, kvcli.GenerationOptions(max_new_tokens=24)).answer_token_ids)
    options = ("--max-new-tokens", 24, "--no-repeat-ngram-size", 1, "--repetition-penalty", 1.5, "--json")
    asked = json_lines(run("ask", "--cache", folder / "doc.kv", *options, question).stdout)
    chat = run("chat", "--cache", folder / "doc.kv", *options, input=f"{question}\n")
    assert chat.exit_code == 0, chat.stderr
    assert [r["answer_token_ids"] for r in json_lines(chat.stdout)] == [asked[0]["answer_token_ids"]]
    assert asked[0]["answer_token_ids"] == session.ask(question, strict).answer_token_ids


TURNS = (Q1, Q2, Q3, "Go on.", "Tell me more.", "Why?", "How?", "And then?")


@pytest.fixture(scope="module")
def filling(tokenizer, tmp_path_factory):
    """A short document and the turns of a conversation about it, measured on the tiny llama, up to the first
    turn whose prompt leaves the prefill's reserve behind (a model that ends there still takes the document)."""
    import kvcli as kv
    from kvcli.engine.prefilling import ANSWER_ROOM

    folder = tmp_path_factory.mktemp("filling")
    doc = folder / "doc.txt"
    doc.write_text(sample_text()[:900], encoding="utf-8")
    lm = kv.from_objects(tiny_llama(len(tokenizer)), tokenizer)
    kv.prefill(lm, kv.read_document(doc), folder / "probe.kv")
    session = kv.Session(lm, folder / "probe.kv")
    talk, turns = Chat(session), []
    for q in TURNS:
        turns.append(talk.ask(q, kv.GenerationOptions(max_new_tokens=64)))
        if len(turns[-1].prompt_token_ids) > len(session.token_ids) + ANSWER_ROOM + 8:
            break
    assert len(turns[-1].prompt_token_ids) > len(session.token_ids) + ANSWER_ROOM + 8 and len(turns[-1].answer_token_ids) > 3
    return doc, turns


def _model_with(tokenizer, folder, positions: int):
    """The same tiny llama (same weights) with only `positions` positions, as a model folder."""
    tiny_llama(len(tokenizer), max_position_embeddings=positions).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("where", ["--no-server", "--server"])
@pytest.mark.parametrize("room", [3, -1])  # the last turn's room: 3 tokens, or none (its prompt does not fit)
def test_a_full_conversation_ends_the_chat_cleanly(filling, tokenizer, tmp_path, monkeypatch, where, room):
    doc, turns = filling
    last = turns[-1]
    model = _model_with(tokenizer, tmp_path / "model", len(last.prompt_token_ids) + room)
    built = run("prefill", doc, "--model", model, "-o", tmp_path / "doc.kv", "--no-server")
    assert built.exit_code == 0, built.stderr
    server = ThreadServer(short_dir() / "s.sock") if where == "--server" else None
    if server is not None:
        monkeypatch.setenv("KVCLI_SOCKET", str(server.path))
    try:
        lines = "".join(f"{t.question}\n" for t in turns) + "One more?\n"
        result = run("chat", "--cache", tmp_path / "doc.kv", "--max-new-tokens", 64, where, input=lines)
    finally:
        if server is not None:
            server.close()
    assert result.exit_code == 0, result.stderr
    assert "kvcli: error" not in result.stderr
    before = piped([{"question": t.question, "answer": t.answer} for t in turns[:-1]] + [{"question": "-", "answer": ""}])
    before = before[:before.rindex("\n==> - <==")]  # the earlier turns' labelled answers, each complete
    if room > 0:
        assert result.stdout.startswith(before + f"\n==> {last.question} <==\n") and "One more?" not in result.stdout
        assert f"the answer to {last.question!r} was cut at {room} tokens (the model's positions ran out)" in result.stderr
        assert "the conversation is full (the last answer used the model's last positions); the chat ends here" in result.stderr
    else:
        needs = len(last.prompt_token_ids)
        assert (f"the conversation is full (the prompt needs {needs} of the model's {needs - 1} positions); "
                "the chat ends here") in result.stderr
        assert result.stdout == before
