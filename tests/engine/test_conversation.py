"""Follow-up questions: a conversation appended after the cached document, exact against recompute.

Each follow-up's answer must equal greedy generate() on the whole conversation's ids without a cache,
and the model must run only the new turn's ids and the answer, never the document or earlier turns
again from the cache's point of view (they are appended, not cached, so they are run once per turn).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import kvcli
from kvcli.documents import decode
from kvcli.engine.prompt import conversation as cv, framing as fr
from kvcli.engine.prefilling import prefill
from kvcli.errors import ConversationError, ModelError
from tests.conftest import TokenCounter, reference_answer, sample_text
from tests.architectures import ARCHS, build

MAX_NEW = 8
OPTS = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
TURNS = ("What does the word Licensor mean?", "And who is the Licensee?", "Say that again in one line.")


@pytest.fixture(scope="module")
def made(tokenizer, plain_tokenizer, tmp_path_factory):
    built: dict[str, SimpleNamespace] = {}

    def get(name: str, system: str | None = None) -> SimpleNamespace:
        key = f"{name}-{system}"
        if key not in built:
            tok = plain_tokenizer if ARCHS[name][1] else tokenizer
            model = build(name, tok)
            lm = kvcli.from_objects(model, tok, name=f"tiny-{name}")
            path = tmp_path_factory.mktemp(name) / "doc.kv"
            doc = decode(sample_text()[:1800].encode(), "licence.txt")  # ~360 tokens: longer than every window
            prefill(lm, doc, path, system=system, chunk_size=100)
            built[key] = SimpleNamespace(model=model, tok=tok, lm=lm, path=path, doc=doc)
        return built[key]

    return get


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "phi3", "gemma3_text", "gpt2"])
def test_follow_ups_equal_generate_on_the_whole_conversation(made, name):
    m = made(name)
    session = kvcli.Session(m.lm, m.path)
    counter = TokenCounter(m.model)
    history: list[tuple[str, str]] = []
    try:
        for q in TURNS:
            counter.reset()
            a = session.ask(q, OPTS, history=history)
            counted = list(counter.calls)
            assert a.prompt_token_ids[: a.cached_tokens] == session.token_ids
            assert counted[0] == a.new_tokens and counted[1:] == [1] * (len(a.answer_token_ids) - 1)
            ref = reference_answer(m.model, a.prompt_token_ids, MAX_NEW)
            assert len(set(ref)) >= 3, f"degenerate reference {ref}"
            assert a.answer_token_ids == ref, (name, q)
            assert a.history == [{"question": hq, "answer": ha} for hq, ha in history]
            history.append((q, a.answer))
    finally:
        counter.close()
    text = m.tok.decode(a.prompt_token_ids)
    for q, ans in history[:-1]:
        assert q in text and ans.strip() in text
    assert text.index(TURNS[0]) < text.index(TURNS[1]) < text.rindex(TURNS[2])


def test_chat_prompt_is_the_template_rendered_on_the_whole_conversation(made):
    m = made("llama", system="Answer briefly.")
    session = kvcli.Session(m.lm, m.path)
    history = [(TURNS[0], "It is the owner. "), (TURNS[1], "  The one who receives it.")]
    ids = session.prompt_ids(TURNS[2], history)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": m.doc.text.strip() + "\n\n" + TURNS[0]},
                {"role": "assistant", "content": "It is the owner."},
                {"role": "user", "content": TURNS[1]},
                {"role": "assistant", "content": "The one who receives it."},
                {"role": "user", "content": TURNS[2]}]
    assert m.tok.decode(ids) == m.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    a = session.ask(TURNS[2], OPTS, history=history)
    assert a.answer_token_ids == reference_answer(m.model, ids, MAX_NEW)


def test_plain_follow_up_format(made):
    m = made("gpt2")
    ids = kvcli.Session(m.lm, m.path).prompt_ids("Q2?", [("Q1?", " A1 ")])
    assert m.tok.decode(ids) == m.doc.text.strip() + "\n\nQuestion: Q1?\nAnswer: A1\n\nQuestion: Q2?\nAnswer:"


def test_no_history_is_the_single_question_framing(tokenizer, plain_tokenizer):
    for tok, kind in ((tokenizer, "chat"), (plain_tokenizer, "plain")):
        f = fr.Framing(kind=kind, system="Be brief." if kind == "chat" else None)
        assert cv.appended_ids(tok, f, [], " Why? ") == fr.question_ids(tok, f, "Why?")


# Templates of other families, written out small: the split must hold for each, or be refused.
GEMMA_LIKE = (  # system folded into the first user turn; assistant is "model"
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
THINK_STRIPPING = (  # drops everything up to </think> from earlier answers: the text would change
    "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LAST_TURN_ONLY = (  # renders the document's turn differently once a conversation follows
    "{% for m in messages %}{% if loop.last or m['role'] != 'user' or messages|length == 1 %}"
    "{{ m['role'] + ': ' + m['content'] + '\n' }}{% else %}{{ 'earlier: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture
def templated(tokenizer):
    def with_template(template: str):
        import copy

        tok = copy.deepcopy(tokenizer)
        tok.chat_template = template
        return tok

    return with_template


@pytest.mark.parametrize("template", [GEMMA_LIKE, LLAMA3_LIKE])
def test_other_templates_keep_the_cached_prefix(templated, template):
    tok = templated(template)
    framing = fr.Framing(kind="chat", system="Be brief.")
    doc = "The Licensor is Acme."
    history = [("Who is it?", "Acme."), ("Where?", "Nowhere.")]
    cached = fr.document_ids(tok, framing, doc)
    ids = cached + cv.appended_ids(tok, framing, history, "Sure?")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": doc + "\n\nWho is it?"},
                {"role": "assistant", "content": "Acme."}, {"role": "user", "content": "Where?"},
                {"role": "assistant", "content": "Nowhere."}, {"role": "user", "content": "Sure?"}]
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template, needle", [(THINK_STRIPPING, "changes the conversation's text"),
                                              (LAST_TURN_ONLY, "renders the document differently")])
def test_templates_that_rewrite_the_conversation_are_refused(templated, template, needle):
    tok = templated(template)
    framing = fr.Framing(kind="chat")
    fr.question_ids(tok, framing, "first")  # one question alone is fine
    with pytest.raises(ModelError, match=needle):
        cv.appended_ids(tok, framing, [("Who?", "<think>hm</think>Acme.")], "Sure?")


def test_from_messages():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "1"}]},
            {"role": "user", "content": "q2"}]
    assert cv.from_messages(msgs) == ("S", [("q1", "a1")], "q2")
    assert cv.from_messages([{"role": "user", "content": "q"}]) == (None, [], "q")
    bad = [
        ("messages", []),
        ("messages[1].role", [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}]),
        ("messages[1].role", [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]),
        ("messages[0].content", [{"role": "user", "content": 5}]),
        ("messages[0]", ["not an object"]),
    ]
    for field, messages in bad:
        with pytest.raises(ConversationError) as err:
            cv.from_messages(messages)
        assert err.value.field.startswith(field) and str(err.value).startswith(field), (field, str(err.value))
    with pytest.raises(ConversationError, match="must end with a user message"):
        cv.from_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])


def test_a_system_message_goes_after_the_document_unless_it_is_the_caches_own():
    brief = fr.Framing(kind="chat", system="Be brief.")
    assert cv.with_system(brief, " Be brief. ", [], "q") == ([], "q")  # already in the cached ids
    assert cv.with_system(fr.Framing(kind="chat"), None, [("q0", "a0")], "q") == ([("q0", "a0")], "q")
    assert cv.with_system(fr.Framing(kind="chat"), "  ", [], "q") == ([], "q")
    assert cv.with_system(brief, "Be long.", [], "q") == ([], "Be long.\n\nq")
    history, question = cv.with_system(fr.Framing(kind="plain"), "Pirate.", [("q0", "a0"), ("q1", "a1")], "q")
    assert history == [("Pirate.\n\nq0", "a0"), ("q1", "a1")] and question == "q"  # before the first question only
