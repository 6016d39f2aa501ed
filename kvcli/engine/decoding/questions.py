"""Questions on one document -> decoding rows -> answers: what the engine (engine/scheduling/scheduler.py) runs.

Each question becomes a Row of engine/decoding/protocol.py (its appended ids, its room, its own chooser: the logits
processors and seeded sampler generate() would apply), with a text stream (engine/decoding/detok.py) that settles
its answer as tokens come; a finished row becomes an Answer. `in_order` renders answers finishing in any
order as if asked one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .detok import TextStream
from .protocol import Row


def greedy(_ids: list[int], logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def processors(lm: Any, options: Any) -> list[Callable]:
    """The per-question logits processors generate() would apply for these options, in its order."""
    from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    out: list[Callable] = []
    penalty = getattr(options, "repetition_penalty", 1.0) or 1.0
    if penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty))
    ngram = getattr(options, "no_repeat_ngram_size", 0) or 0
    if ngram > 0:
        out.append(NoRepeatNGramLogitsProcessor(ngram))
    if options.temperature > 0:
        from .sampling import Sampler

        out.append(Sampler(options.temperature, options.top_p, options.seed, lm.device))
    return out


def chooser(lm: Any, options: Any) -> Callable[[list[int], torch.Tensor], int]:
    """Next id for one question: its processors (incl. its own seeded sampler), then argmax, as generate() does."""
    steps = processors(lm, options)
    if not steps:
        return greedy

    def choose(ids: list[int], logits: torch.Tensor) -> int:
        scores = logits[None]  # [1, vocab]
        input_ids = torch.tensor([ids], device=logits.device)
        for step in steps:
            scores = step(input_ids, scores)
        return int(torch.argmax(scores[0]))

    return choose


@dataclass
class Question:
    """One question's row and its text stream, built (and checked: prompt room) before it joins a batch."""

    text: str
    row: Row
    stream: TextStream
    history: Sequence[Any] = ()

    def answer(self, session: Any, start: float, turn: Callable[[], Any] | None = None) -> Any:
        """The finished row as an Answer (timings counted from `start`); with check, measured against a
        recompute, run under `turn` (the model's: engine/scheduling/scheduler.py) when given."""
        from contextlib import nullcontext

        from .request import Answer

        r = self.row
        cached = len(session.token_ids)
        finished = r.finished_at - start  # the answer's own time: the check's recompute is not in it
        checked = None
        if r.logits is not None:
            from .. import check as ck

            with (turn or nullcontext)():
                checked = ck.compare(session.lm, r.prompt, r.answer, torch.stack(r.logits) if r.logits else None,
                                     storage=session.storage, blended=session.blended)
        return Answer(
            question=self.text,
            answer=self.stream.text,
            prompt_token_ids=r.prompt,
            answer_token_ids=r.answer,
            cached_tokens=cached,
            new_tokens=len(r.appended),
            processed_tokens=r.processed,
            ttft_s=(r.first_token_at - start) if r.first_token_at else None,
            total_s=finished,
            finish_reason=r.finish_reason,
            cache=str(session.path),
            check=checked,
            blended=session.blended,
            history=[{"question": q, "answer": a} for q, a in self.history],
        )


def question(session: Any, index: int, text: str, options: Any, *, history: Sequence[Any] = (),
             on_text: Callable[[str], None] | None = None, check: bool = False, prompt: list[int] | None = None) -> Question:
    """The row for one question on the session's document (raises GenerationError if its prompt does not fit);
    check: keep its raw logits, so its Answer is measured against a full recompute (engine/check.py). prompt:
    its prompt ids, when already tokenized (Session.check_prompt)."""
    from .request import prompt_room

    lm = session.lm
    prompt = prompt or session.prompt_ids(text, history)
    stream = TextStream(lm.tokenizer, options.stop, on_text)
    eos = session.eos
    looped = loop_watch(getattr(options, "stop_loops", 0) or 0)

    def on_token(token: int) -> bool | str:
        if token in eos:  # the end of turn is not text: the answer is complete
            stream.end()
            return False
        stopped = stream.put(token)
        if not stopped and looped(token):
            stream.end()
            return "loop"
        if not stopped and len(stream.ids) >= row.max_new:
            stream.end()
        return stopped

    row = Row(index=index, prompt=prompt, appended=prompt[len(session.token_ids):], max_new=prompt_room(lm, prompt, options),
              choose=chooser(lm, options), on_token=on_token, logits=[] if check else None)
    return Question(text, row, stream, tuple(history))


def loop_watch(n: int) -> Callable[[int], bool]:
    """A watch over one answer's ids: True once its last n ids have come three times in it (a small model caught in
    a loop); never for n = 0. It only ends an answer: every id before is the one the model chose."""
    ids: list[int] = []
    seen: dict[tuple[int, ...], int] = {}

    def looped(token: int) -> bool:
        if n <= 0:
            return False
        ids.append(token)
        if len(ids) < n:
            return False
        gram = tuple(ids[-n:])
        seen[gram] = seen.get(gram, 0) + 1
        return seen[gram] >= 3

    return looped


def in_order(count: int, begin: Callable[[int], None], finish: Callable[[int, Any], None],
             write: Callable[[str], None] | None) -> tuple[Callable[[int, str], None], Callable[[int, Any], None]]:
    """(on_text, on_answer) that render answers finishing in any order as if asked one by one: the first
    unfinished question's text streams live through write(), later ones are held until it completes;
    begin(i) runs before question i's text, finish(i, answer) after it."""
    held: dict[int, str] = {}
    done: dict[int, Any] = {}
    head = 0
    begin(0)

    def text(i: int, t: str) -> None:
        if write is None:
            return
        if i == head:
            write(t)
        else:
            held[i] = held.get(i, "") + t

    def answered(i: int, a: Any) -> None:
        nonlocal head
        done[i] = a
        while head in done:
            finish(head, done.pop(head))
            head += 1
            if head < count:
                begin(head)
                if write is not None and held.get(head):
                    write(held.pop(head))

    return text, answered
