"""Prompt framing: the token ids cached for a document, and the ids appended for each question.

Chat models: document and question form one user turn (document, blank line, question) after an
optional system message, then the generation prompt. The template is rendered once with
placeholders and split around them, so the cached ids are an exact prefix of every question's
prompt. Models without a template get plain text: "DOC\\n\\nQuestion: Q\\nAnswer:".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ..errors import ModelError

FRAMING_VERSION = 1
SEPARATOR = "\n\n"
_DOC = "\u2063KVCLI-DOCUMENT\u2063"
_QUESTION = "\u2063KVCLI-QUESTION\u2063"


@dataclass(frozen=True)
class Framing:
    kind: str  # "chat" or "plain"
    system: str | None = None

    def record(self, tokenizer: Any) -> dict[str, Any]:
        """What the manifest stores, so a reader can tell a different framing apart."""
        template = getattr(tokenizer, "chat_template", None) if self.kind == "chat" else None
        return {
            "kind": self.kind,
            "system": self.system,
            "version": FRAMING_VERSION,
            "template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None,
        }


def choose(tokenizer: Any, kind: str = "auto", system: str | None = None) -> Framing:
    """auto: chat when the tokenizer has a chat template, else plain."""
    has_template = isinstance(getattr(tokenizer, "chat_template", None), str)
    if kind == "auto":
        kind = "chat" if has_template else "plain"
    if kind == "chat" and not has_template:
        raise ModelError("this model has no chat template; use --framing plain")
    if kind not in ("chat", "plain"):
        raise ModelError(f"unknown framing {kind!r} (auto, chat or plain)")
    return Framing(kind=kind, system=system or None)


def _pieces(tokenizer: Any, framing: Framing) -> tuple[str, str, str]:
    """(head, middle, tail) of the rendered template around the document and question placeholders."""
    messages = [{"role": "system", "content": framing.system}] if framing.system else []
    messages.append({"role": "user", "content": _DOC + SEPARATOR + _QUESTION})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise ModelError(f"the chat template failed to render ({exc}); use --framing plain") from None
    if text.count(_DOC) != 1 or text.count(_QUESTION) != 1 or text.index(_DOC) > text.index(_QUESTION):
        raise ModelError("the chat template does not place the user message verbatim; use --framing plain")
    head, rest = text.split(_DOC)
    middle, tail = rest.split(_QUESTION)
    return head, middle, tail


def document_ids(tokenizer: Any, framing: Framing, document: str) -> list[int]:
    """Token ids of everything before the question: what the cache holds."""
    document = document.strip()
    if framing.kind == "plain":
        text = (framing.system.strip() + SEPARATOR if framing.system else "") + document
        return list(tokenizer(text)["input_ids"])  # the tokenizer's own BOS, if it adds one
    head, middle, tail = _pieces(tokenizer, framing)
    messages = [{"role": "system", "content": framing.system}] if framing.system else []
    messages.append({"role": "user", "content": document + SEPARATOR + "Q"})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != head + document + middle + "Q" + tail:
        raise ModelError("the chat template changes the document text when rendering it; use --framing plain")
    return list(tokenizer(head + document, add_special_tokens=False)["input_ids"])


def question_ids(tokenizer: Any, framing: Framing, question: str) -> list[int]:
    """Token ids appended after the cached prefix for one question (no special tokens added)."""
    question = question.strip()
    if framing.kind == "plain":
        text = f"{SEPARATOR}Question: {question}\nAnswer:"
    else:
        _head, middle, tail = _pieces(tokenizer, framing)
        text = middle + question + tail
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
