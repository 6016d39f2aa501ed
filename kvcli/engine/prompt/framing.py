"""Prompt framing: the token ids cached for a document, and the ids appended for each question.

Chat models: document and question form one user turn (document, blank line, question) after an
optional system message, then the generation prompt. The template is rendered once with
placeholders and split around them, so the cached ids are an exact prefix of every question's
prompt. Models without a template get plain text: "DOC\\n\\nQuestion: Q\\nAnswer:".

Where the tokenizer does not break at the document's end (SentencePiece-style tokenizers: a prefix
space added to text tokenized alone, pieces such as ".\\n\\n" merging the document's last character
with what follows), the cut moves: the last `pending` characters of the document are left out of the
cache and tokenized with each question, after `anchor` (the text of the last `anchor_tokens` cached
ids, tokenized again and dropped, their ids checked). The cut is chosen and verified against probe
questions at prefill so that cached ids + question ids equal the tokenization of the whole prompt.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ...errors import ModelError
from ...format.manifest import FRAMING_VERSION, FRAMING_VERSION_CUT, FRAMING_VERSIONS as SUPPORTED_VERSIONS  # noqa: F401  (readers of version 1 refuse a cut)
_PROBES = ("Q", "What is it?", "(a) 42, or 'b'?", "\u00dcn\u00efc\u00f6d\u00e9 \u6771\u4eac", "x\ny", "...")
_MAX_PENDING = 6  # tokens of the document's end that may be left out of the cache
_MAX_ANCHOR = 24  # cached tokens that may be tokenized again with each question
SEPARATOR = "\n\n"
_DOC = "\u2063KVCLI-DOCUMENT\u2063"
_QUESTION = "\u2063KVCLI-QUESTION\u2063"


@dataclass(frozen=True)
class Framing:
    kind: str  # "chat" or "plain"
    system: str | None = None
    anchor: str = ""  # text of the last anchor_tokens cached ids, tokenized again before each question
    anchor_tokens: int = 0
    pending: str = ""  # the document's last characters, not cached: tokenized with each question

    @property
    def cut(self) -> bool:
        return bool(self.anchor_tokens or self.pending)

    def record(self, tokenizer: Any) -> dict[str, Any]:
        """What the manifest stores, so a reader can tell a different framing apart."""
        template = getattr(tokenizer, "chat_template", None) if self.kind == "chat" else None
        body = {
            "kind": self.kind,
            "system": self.system,
            "version": FRAMING_VERSION_CUT if self.cut else FRAMING_VERSION,
            "template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None,
        }
        if self.cut:
            body.update(anchor=self.anchor, anchor_tokens=self.anchor_tokens, pending=self.pending)
        return body

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Framing":
        return cls(kind=record["kind"], system=record.get("system"), anchor=record.get("anchor") or "",
                   anchor_tokens=int(record.get("anchor_tokens") or 0), pending=record.get("pending") or "")


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


def _texts(tokenizer: Any, framing: Framing, document: str) -> tuple[str, str, str, bool]:
    """(text before the question, text around it: prefix and suffix, add special tokens?) for a document."""
    document = document.strip()
    if framing.kind == "plain":
        text = (framing.system.strip() + SEPARATOR if framing.system else "") + document
        return text, f"{SEPARATOR}Question: ", "\nAnswer:", True  # the tokenizer's own BOS, if it adds one
    head, middle, tail = _pieces(tokenizer, framing)
    messages = [{"role": "system", "content": framing.system}] if framing.system else []
    messages.append({"role": "user", "content": document + SEPARATOR + "Q"})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered != head + document + middle + "Q" + tail:
        raise ModelError("the chat template changes the document text when rendering it; use --framing plain")
    return head + document, middle, tail, False


def split_document(tokenizer: Any, framing: Framing, document: str) -> tuple[list[int], Framing]:
    """The ids the cache holds, and the framing (with the cut) that every question's ids follow.

    Tries cuts from none (the cache ends with the document) to a few tokens before the end, and keeps the
    first for which cached ids + question ids equal the whole prompt's tokenization for every probe question.
    If none does (a tokenizer kvcli cannot split), the cut stays at the document's end.
    """
    before, middle, tail, special = _texts(tokenizer, framing, document)
    return _split(tokenizer, Framing(framing.kind, framing.system), before, middle, tail, special)


def split_extension(tokenizer: Any, base: Framing, base_ids: list[int], text: str) -> tuple[list[int], Framing]:
    """The ids a cache that extends `base` holds for `text` (joined to the base's document by SEPARATOR), and
    the framing its questions follow. The base's pending text is tokenized again here, after its anchor (whose
    ids the base holds: checked and dropped), so base ids + these ids tokenize the joined document as the
    whole prompt would."""
    if base.kind == "plain":
        middle, tail = f"{SEPARATOR}Question: ", "\nAnswer:"
    else:
        _head, middle, tail = _pieces(tokenizer, base)
    before = base.anchor + base.pending + SEPARATOR + text.strip()
    held = list(base_ids[len(base_ids) - base.anchor_tokens:]) if base.anchor_tokens else []
    return _split(tokenizer, Framing(base.kind, base.system), before, middle, tail, False, held)


def _split(tokenizer: Any, plain: Framing, before: str, middle: str, tail: str, special: bool,
           held: list[int] | None = None) -> tuple[list[int], Framing]:
    """split_document's search for the cut, over the text `before` the question; `held`: ids already cached
    that `before` starts with (an extension's anchor), checked and left out of the ids returned."""
    held = held or []
    enc = tokenizer(before, add_special_tokens=special, return_offsets_mapping=True)
    every = list(enc["input_ids"])
    if every[: len(held)] != held:
        raise ModelError("the new text changes how the end of the cache it extends is tokenized; "
                         "prefill the whole text as one document instead")
    ids, h = every[len(held):], len(held)
    wholes = [list(tokenizer(before + middle + q + tail, add_special_tokens=special)["input_ids"])[h:] for q in _PROBES]
    if all(whole == ids + question_ids(tokenizer, plain, q) for whole, q in zip(wholes, _PROBES)):
        return ids, plain
    starts = _token_starts(enc, len(before))
    if starts is None:
        return ids, plain
    for pending in range(0, min(_MAX_PENDING, len(ids) - 1) + 1):
        for anchor in range(0, min(_MAX_ANCHOR, len(ids) - pending - 1) + 1):
            if not pending and not anchor:
                continue
            keep = len(ids) - pending
            a, p = starts[h + keep - anchor], starts[h + keep] if pending else len(before)
            if not a <= p <= len(before):
                continue
            cut = Framing(plain.kind, plain.system, anchor=before[a:p], anchor_tokens=anchor, pending=before[p:])
            cached = ids[:keep]
            try:
                if all(whole == cached + question_ids(tokenizer, cut, q, cached) for whole, q in zip(wholes, _PROBES)):
                    return cached, cut
            except ModelError:
                continue
    return ids, plain


def _token_starts(enc: Any, end: int) -> list[int] | None:
    """Character offset where each token starts (special tokens: where they sit), or None without offsets."""
    offsets = enc.get("offset_mapping") if hasattr(enc, "get") else None
    if not offsets:
        return None
    starts, end_so_far = [], 0
    for start, stop in offsets:
        starts.append(start if stop > start else end_so_far)  # an added special token (BOS) has no span
        end_so_far = max(end_so_far, stop)
    return starts


def head_ids(tokenizer: Any, framing: Framing) -> list[int]:
    """The ids every document of this framing starts with, tokenized alone: chat, the template up to the
    document; plain, the tokenizer's own start (BOS, if it adds one) and the system text."""
    if framing.kind == "plain":
        text = framing.system.strip() + SEPARATOR if framing.system else ""
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    head, _middle, _tail = _pieces(tokenizer, framing)
    return list(tokenizer(head, add_special_tokens=False)["input_ids"])


def document_ids(tokenizer: Any, framing: Framing, document: str) -> list[int]:
    """Token ids of everything before the question: what the cache holds."""
    return split_document(tokenizer, framing, document)[0]


def question_ids(tokenizer: Any, framing: Framing, question: str, cached: list[int] | None = None) -> list[int]:
    """Token ids appended after the cached prefix for one question (no special tokens added).

    With a cut (see split_document), the anchor and pending text are tokenized together with the question
    and the anchor's ids, which the cache already holds, are checked against `cached` and dropped.
    """
    question = question.strip()
    if framing.kind == "plain":
        text = f"{SEPARATOR}Question: {question}\nAnswer:"
    else:
        _head, middle, tail = _pieces(tokenizer, framing)
        text = middle + question + tail
    ids = list(tokenizer(framing.anchor + framing.pending + text, add_special_tokens=False)["input_ids"])
    k = framing.anchor_tokens
    if k:
        if cached is not None and ids[:k] != list(cached[-k:]):
            raise ModelError("this question changes how the end of the document is tokenized, so the cache cannot be "
                             "reused exactly for it; rephrase the question or use --framing plain")
        ids = ids[k:]
    return ids
