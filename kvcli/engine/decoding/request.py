"""What a question asks for and what it gets back: generation options, the answer, the room it has."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...errors import PromptTooLongError
from ...generation import DEFAULT_BATCH, DEFAULT_MAX_NEW_TOKENS, GenerationOptions  # noqa: F401  (the engine's names for them)
from ..check import Check


@dataclass
class Answer:
    question: str
    answer: str
    prompt_token_ids: list[int]  # every id the model saw before answering: cached + appended
    answer_token_ids: list[int]
    cached_tokens: int
    new_tokens: int  # appended ids computed for this question
    processed_tokens: int  # ids the model actually ran forward for this question (appended + answer - 1)
    ttft_s: float | None
    total_s: float
    finish_reason: str  # "stop" (end of turn or stop string), "length", or "loop" (stop_loops)
    cache: str = ""
    check: Check | None = None  # with ask(check=True): this answer measured against a full recompute
    history: list[dict[str, str]] = field(default_factory=list)  # earlier {question, answer} turns, oldest first
    blended: dict[str, Any] | None = None  # from a blend of several caches (approximate): documents, recompute, ...
    decoding: str = ""  # how the model's engine ran it: "batched" (rows share forward passes) or "one at a time"
    sources: list[dict[str, Any]] | None = None  # a sectioned cache: the sections used (engine/sections/session.py)
    document_share: float | None = None  # ... and the share of the document's tokens they hold

    def to_json(self) -> dict[str, Any]:
        """JSON of the answer; `check` appears only when measured, `history` only for a follow-up (so one
        line can be fed back), `blended` only for a blend of several caches."""
        body = asdict(self)
        if self.check is None:
            del body["check"]
        else:
            body["check"] = self.check.to_json()
        if not body["history"]:
            del body["history"]
        if self.blended is None:
            del body["blended"]
        for key in ("sources", "document_share"):
            if body[key] is None:
                del body[key]
        return body


def prompt_room(lm: Any, prompt: Sequence[int], opts: GenerationOptions) -> int:
    """How many answer tokens this prompt may have: --max-new-tokens within the model's positions (if it has a limit)."""
    if not lm.max_positions:
        return opts.max_new_tokens
    if len(prompt) >= lm.max_positions:
        raise PromptTooLongError(f"{PromptTooLongError.LEAD}the prompt needs {len(prompt)} of the model's {lm.max_positions} positions")
    return min(opts.max_new_tokens, lm.max_positions - len(prompt))
