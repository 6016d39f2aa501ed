"""Prompt ids for a conversation about a cached document: the first question, earlier answers, follow-ups.

The cached ids stay an exact prefix of every turn's prompt, so a follow-up only runs its own new ids.

Chat framing: the first user turn is the document, a blank line and the first question (as for one
question, see framing.py); each earlier answer is an assistant turn; each follow-up a user turn; then
the generation prompt. The template is rendered once for the whole conversation with placeholders and
split around them; the text before the document must be the cached head, and substituting the real
texts must give what the template renders for them, else the template is refused (use plain framing).

Plain framing: `DOC` then, for each earlier exchange, `\\n\\nQuestion: Q\\nAnswer: A`, then
`\\n\\nQuestion: Q\\nAnswer:` for the question being asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import ConversationError, ModelError
from ...format.identity import ids_digest
from . import framing as fr

Exchange = tuple[str, str]  # (question, answer) of an earlier turn


def appended_ids(tokenizer: Any, framing: fr.Framing, history: Sequence[Exchange], question: str,
                 cached: Sequence[int] | None = None) -> list[int]:
    """Token ids appended after the cached document (`cached`) for `question`, following the earlier `history`.

    With a cut framing (see framing.py) the anchor and pending text are tokenized with the conversation and
    the anchor's ids, which the cache holds, are checked and dropped, exactly as for a single question."""
    if not history:
        return fr.question_ids(tokenizer, framing, question, None if cached is None else list(cached))
    turns = [(q.strip(), a.strip()) for q, a in history]
    question = question.strip()
    if framing.kind == "plain":
        text = "".join(f"{fr.SEPARATOR}Question: {q}\nAnswer: {a}" for q, a in turns)
        text += f"{fr.SEPARATOR}Question: {question}\nAnswer:"
    else:
        text = _chat_text(tokenizer, framing, turns, question)
    ids = list(tokenizer(framing.anchor + framing.pending + text, add_special_tokens=False)["input_ids"])
    k = framing.anchor_tokens
    if k:
        if cached is not None and ids[:k] != list(cached[-k:]):
            raise ModelError("this conversation changes how the end of the document is tokenized, so the cache cannot "
                             "be reused exactly for it; rephrase the question or use --framing plain")
        ids = ids[k:]
    return ids


def _mark(kind: str, i: int) -> str:
    return f"\u2063KVCLI-{kind}{i}\u2063"


def _messages(framing: fr.Framing, document: str, texts: list[str]) -> list[dict[str, str]]:
    """system?, user (document + first question), then assistant/user turns alternating."""
    messages = [{"role": "system", "content": framing.system}] if framing.system else []
    for i, text in enumerate(texts):
        if i == 0:
            messages.append({"role": "user", "content": document + fr.SEPARATOR + text})
        else:
            messages.append({"role": "assistant" if i % 2 else "user", "content": text})
    return messages


def _chat_text(tokenizer: Any, framing: fr.Framing, turns: list[Exchange], question: str) -> str:
    """The rendered conversation after the document: the template split around placeholders, filled in."""
    texts = [t for pair in turns for t in pair] + [question]  # q0, a0, q1, a1, ..., question
    marks = [_mark("Q" if i % 2 == 0 else "A", i) for i in range(len(texts))]
    head = fr._pieces(tokenizer, framing)[0]  # the cached head: same template, same system
    try:
        rendered = tokenizer.apply_chat_template(_messages(framing, fr._DOC, marks), tokenize=False, add_generation_prompt=True)
        real = tokenizer.apply_chat_template(_messages(framing, "D", texts), tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise ModelError(f"the chat template failed to render a conversation ({exc}); use --framing plain") from None
    if rendered.count(fr._DOC) != 1 or rendered.split(fr._DOC)[0] != head:
        raise ModelError("the chat template renders the document differently when a conversation follows; use --framing plain")
    rest = rendered.split(fr._DOC)[1]
    out = []
    for mark, text in zip(marks, texts):
        if rest.count(mark) != 1:
            raise ModelError("the chat template does not place each conversation turn verbatim; use --framing plain")
        before, rest = rest.split(mark)
        out += [before, text]
    text = "".join(out) + rest
    if real != head + "D" + text:
        raise ModelError("the chat template changes the conversation's text when rendering it; use --framing plain")
    return text


def with_system(framing: fr.Framing, system: str | None, history: Sequence[Exchange], question: str
                ) -> tuple[list[Exchange], str]:
    """A conversation's system message honoured: the cache's own (in the cached ids) or none changes nothing; any
    other goes right after the document, before the first question (where a cached prompt can still take it)."""
    history = list(history)
    if system is None or not system.strip() or system.strip() == (framing.system or "").strip():
        return history, question
    if history:
        first_question, first_answer = history[0]
        return [(f"{system.strip()}\n\n{first_question}", first_answer), *history[1:]], question
    return history, f"{system.strip()}\n\n{question}"


def from_messages(messages: Any, field: str = "messages") -> tuple[str | None, list[Exchange], str]:
    """OpenAI-style messages -> (system or None, earlier exchanges, question); ConversationError names the field.

    Accepted: an optional first system (or developer) message, then user, assistant, user, ... ending on
    a user message. Content is a string or a list of text parts.
    """
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"{field}: must be a non-empty list of messages", field=field)
    system = None
    texts: list[str] = []
    for i, msg in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise ConversationError(f"{where}: must be an object with role and content", field=where)
        role = msg.get("role")
        content = _content(msg.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            if i != 0:
                raise ConversationError(f"{where}.role: a system message may only come first", field=f"{where}.role")
            system = content
            continue
        want = "user" if len(texts) % 2 == 0 else "assistant"
        if role != want:
            raise ConversationError(
                f"{where}.role: expected {want!r} here (user and assistant turns alternate, starting and ending with user), got {role!r}",
                field=f"{where}.role",
            )
        texts.append(content)
    if not texts or len(texts) % 2 == 0:
        raise ConversationError(f"{field}: the conversation must end with a user message (the question)", field=field)
    if not texts[-1].strip():
        raise ConversationError(f"{field}[{len(messages) - 1}].content: the question is empty", field=f"{field}[{len(messages) - 1}].content")
    history = [(texts[k], texts[k + 1]) for k in range(0, len(texts) - 1, 2)]
    return system, history, texts[-1]


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ConversationError(f"{where}: must be a string or a list of text parts", field=where)


class Chat:
    """A conversation about one cached document: each ask() follows the earlier questions and answers."""

    def __init__(self, session: Any, history: Sequence[Exchange] = ()):
        self.session = session
        self.history: list[Exchange] = list(history)

    def ask(self, question: str, options: Any = None, on_text: Any = None):
        answer = self.session.ask(question, options, on_text, history=self.history)
        self.history.append((question, answer.answer))
        return answer


def from_answer_json(record: Any, token_ids: Sequence[int], where: str = "--follow-up") -> list[Exchange]:
    """The conversation so far from one `kvcli ask --json` line: its history, then its question and answer.

    The record's prompt must start with this cache's document ids: a follow-up to an answer about
    another document is refused rather than answered.
    """
    if not isinstance(record, dict) or not isinstance(record.get("question"), str) or not isinstance(record.get("answer"), str):
        raise ConversationError(f"{where}: not a `kvcli ask --json` answer (needs question and answer)", field=where)
    history = record.get("history") or []
    if not isinstance(history, list) or not all(
        isinstance(h, dict) and isinstance(h.get("question"), str) and isinstance(h.get("answer"), str) for h in history
    ):
        raise ConversationError(f"{where}: history must be a list of {{question, answer}} objects", field=where)
    prompt = record.get("prompt_token_ids")
    digest = record.get("document_ids_sha256")  # what `ask --json` carries instead of the ids (without --ids)
    if isinstance(prompt, list) and list(prompt[: len(token_ids)]) != list(token_ids) or (
            not isinstance(prompt, list) and isinstance(digest, str) and digest != ids_digest(token_ids)):
        raise ConversationError(f"{where}: that answer came from another document or cache "
                                "(its prompt does not start with this cache's ids)", field=where)
    return [(h["question"], h["answer"]) for h in history] + [(record["question"], record["answer"])]
