"""How closely a lossy (8-/4-bit) cache follows the lossless one: agreement measured on real questions.

The lossless cache's greedy answers are the reference. Each reference answer is teacher-forced (question
plus answer tokens in one forward pass) through both restored caches, and the next-token distributions
are compared at every answer position: top-1 agreement with the reference tokens, and the mean KL
divergence KL(lossless || lossy). The candidate's own greedy answers are compared whole, too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .model.models import LoadedModel


@dataclass
class Agreement:
    questions: int
    answer_tokens: int  # reference answer tokens teacher-forced (the positions compared)
    top1: float  # share of positions whose most likely token is the reference token
    top1_vs_lossless: float  # share of positions whose most likely token is the lossless forward's
    kl_mean: float  # mean KL(lossless || candidate) of the next-token distributions, in nats
    kl_max: float
    answers_identical: float | None  # share of whole greedy answers identical to the reference (None: not compared)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def answer_logprobs(lm: LoadedModel, states, prompt_tail: Sequence[int], answer: Sequence[int]):
    """Log-probabilities [len(answer), vocab] (float32) of each answer position, with `prompt_tail` (the
    question's ids after the cached tokens) and the answer teacher-forced after the restored `states`."""
    import torch

    from .cache.kvcache import KVCache

    ids = list(prompt_tail) + list(answer[:-1])
    x = torch.tensor([ids], device=lm.device)  # [1, question + answer - 1]
    cache = KVCache.from_states(states, room=len(ids))  # a private copy: the states are never written
    with torch.inference_mode():
        logits = lm.model(input_ids=x, cache=cache, use_cache=True).logits[0]  # [len(ids), vocab]
    return torch.log_softmax(logits[len(prompt_tail) - 1 :].float(), dim=-1)


def compare(lm: LoadedModel, reference_states, candidate_states, prompts: Sequence[Sequence[int]],
            answers: Sequence[Sequence[int]], candidate_answers: Sequence[Sequence[int]] | None = None) -> Agreement:
    """Agreement of the candidate states with the reference states over (question ids, reference answer) pairs.

    `prompts` are each question's ids after the cached tokens; `answers` the reference (lossless greedy)
    answer ids; `candidate_answers`, if given, the candidate's own greedy answers (compared whole)."""
    import torch

    same = same_ref = total = 0
    kls: list[float] = []
    for tail, answer in zip(prompts, answers):
        if not answer:
            continue
        ref = answer_logprobs(lm, reference_states, tail, answer)
        got = answer_logprobs(lm, candidate_states, tail, answer)
        target = torch.tensor(list(answer))
        top = got.argmax(-1)
        same += int((top == target).sum())
        same_ref += int((top == ref.argmax(-1)).sum())
        kl = (ref.exp() * (ref - got)).sum(-1)  # [positions]
        kls += kl.clamp_min(0).tolist()
        total += len(answer)
    identical = None
    if candidate_answers is not None:
        identical = sum(list(a) == list(b) for a, b in zip(answers, candidate_answers)) / max(1, len(answers))
    return Agreement(
        questions=len(prompts),
        answer_tokens=total,
        top1=same / total if total else float("nan"),
        top1_vs_lossless=same_ref / total if total else float("nan"),
        kl_mean=sum(kls) / len(kls) if kls else float("nan"),
        kl_max=max(kls) if kls else float("nan"),
        answers_identical=identical,
    )
