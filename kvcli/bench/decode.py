"""kvcli bench's decode speeds from a restored cache: one question alone, and several at once through one
Session.ask_many (every running question's next token in one forward pass per step)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine import answer
from ..engine.model.models import LoadedModel

DECODE_TOKENS = 64  # answer tokens generated to measure decode speed (the default)
BATCH_QUESTIONS = 8  # questions decoded together for the batched speed


def _ms(seconds: float, count: int) -> float:
    return seconds * 1000 / count if count > 0 else float("nan")


def one(lm: LoadedModel, path: Path, question: str, tokens: int = DECODE_TOKENS) -> dict[str, Any]:
    """One question from a fresh Session: seconds and tokens after the first, tokens/s and ms a token."""
    a = answer.Session(lm, path).ask(question, answer.GenerationOptions(max_new_tokens=tokens))
    after_first = len(a.answer_token_ids) - 1
    decode_s = a.total_s - a.ttft_s
    return {"decode_tokens": after_first, "decode_s": decode_s,
            "decode_tok_s": after_first / decode_s if after_first > 0 else float("nan"),
            "decode_ms_per_token": _ms(decode_s, after_first)}


def batched(lm: LoadedModel, path: Path, questions: Sequence[str], tokens: int = DECODE_TOKENS) -> dict[str, Any]:
    """The questions decoded together: ms per step (one forward for every running row) and per row-token.

    Timed from the last first token (every row running) to the last answer token; rows that end early
    leave the later steps."""
    session = answer.Session(lm, path)
    session.ask(questions[0], answer.GenerationOptions(max_new_tokens=1))  # the restore is paid here, not by the batch
    steps = session.stats["steps"]
    answers = session.ask_many(questions, answer.GenerationOptions(max_new_tokens=tokens), batch_size=len(questions))
    decode_s = max(a.total_s for a in answers) - max(a.ttft_s for a in answers)
    row_tokens = sum(len(a.answer_token_ids) - 1 for a in answers)
    decode_steps = max(len(a.answer_token_ids) for a in answers) - 1
    return {"batch_questions": len(answers), "batch_decoding": answers[0].decoding,
            "batch_forward_passes": session.stats["steps"] - steps, "batch_decode_steps": decode_steps,
            "batch_decode_row_tokens": row_tokens, "batch_decode_s": decode_s,
            "batch_ms_per_step": _ms(decode_s, decode_steps), "batch_ms_per_row_token": _ms(decode_s, row_tokens)}
