"""--check: measure an answer from the cache against one full forward of the same ids without a cache.

The cached path's raw logits (before any sampling or penalty processor) are captured while the answer
is generated (generate's output_logits). The reference is one forward over prompt + answer[:-1] with no
cache, teacher-forced: at each answer step both paths see exactly the same ids, so their logits can be
compared position by position. Greedy answers are identical as long as both pick the same top token at
every step; where they do not, the top two logits nearly tie (within twice the largest difference).
An 8-/4-bit cache is lossy, and a blend of several caches approximate, so there differences are expected: the check then reports how closely the
answer follows the recompute (share of positions with the same top token, mean KL divergence).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .model.models import LoadedModel


@dataclass(frozen=True)
class Divergence:
    """One answer position where the cached path and the recompute pick different top tokens."""

    position: int  # index into the answer (0: first answer token)
    cached_token: int  # top token of the cached path's logits
    recompute_token: int  # top token of the recomputed logits
    margin: float  # recompute's top-1 minus top-2 logit: small means a near-tie
    cached_margin: float  # the same on the cached path's logits
    logit_diff: float  # largest |cached - recompute| over the vocabulary at this position


@dataclass(frozen=True)
class Check:
    """Cached answer vs full recompute: identical or not, where it first diverges, how far logits differ."""

    identical: bool  # every answer position picks the same top token on both paths
    tokens: int  # answer positions compared
    first_divergence: int | None  # first such position, None when identical
    max_logit_diff: float  # largest |cached - recompute| logit over every compared position and token
    divergences: list[Divergence] = field(default_factory=list)
    dtype: str = ""
    device: str = ""
    agreement: float = 1.0  # share of compared positions whose top token is the recompute's
    kl_mean: float = 0.0  # mean KL(recompute || cached) of the next-token distributions, in nats
    storage: str = "lossless"  # the cache's storage (manifest): "8-bit"/"4-bit" are lossy, differences expected
    weights: str = "float"  # the model's (engine/model/stored.py): "q8", "q4" are approximate, differences expected
    blended: dict[str, Any] | None = None  # several caches blended (engine/cache/blend.py): approximate, differences expected

    def to_json(self) -> dict[str, Any]:
        """JSON of the check; `blended` appears only for a blend."""
        body = asdict(self)
        if self.blended is None:
            del body["blended"]
        return body

    def describe(self) -> str:
        """One line for people (the CLI prints it on stderr)."""
        diff = f"largest logit difference {self.max_logit_diff:.3g}"
        if self.storage != "lossless" or self.weights != "float" or self.blended:  # approximate: the agreement is the news
            same = self.tokens - len(self.divergences)
            where = "" if self.identical else f", first differs at answer token {self.first_divergence}"
            what = (f"{len(self.blended['sections'])} of {self.blended['of']} sections composed ({self.blended['recompute']:g} "
                    "recomputed, against recomputing the same sections' text" if self.blended and "sections" in self.blended
                    else f"{self.blended['documents']} caches blended ({self.blended['recompute']:g} recomputed"
                    + (f", {self.storage} storage" if self.storage != "lossless" else "") if self.blended
                    else f"{self.storage} cache (lossy" if self.storage != "lossless"
                    else f"{self.weights} weights (bfloat16 activations make the cut between cache and question visible")
            return (f"{what}, differences expected): {'identical' if self.identical else 'DIFFERS'}; "
                    f"top token agrees with a full recompute at {same} of {self.tokens} answer tokens ({self.agreement:.1%}){where}; "
                    f"mean KL {self.kl_mean:.2g} nats; {diff}")
        if self.identical:
            return f"identical to a full recompute over {self.tokens} tokens ({diff})"
        margins = ", ".join(f"{d.margin:.3g}" for d in self.divergences[:3]) + (" ..." if len(self.divergences) > 3 else "")
        return (f"DIFFERS from a full recompute at answer token {self.first_divergence} of {self.tokens} "
                f"({len(self.divergences)} position(s) disagree, top-1/top-2 margin {margins}; {diff})")


def compare(lm: LoadedModel, prompt_ids: Sequence[int], answer_ids: Sequence[int], cached_logits: Any,
            storage: str = "lossless", blended: dict[str, Any] | None = None) -> Check:
    """Compare the cached path's logits [answer, vocab] with one uncached forward over the same ids
    (`storage`: the cache's, from its manifest; lossy ones are described as such; `blended`: the blend's
    record, for a cache of several documents blended into one prompt)."""
    import torch

    from ..format.codec import dtype_name

    n = len(answer_ids)
    if n == 0:
        return Check(identical=True, tokens=0, first_divergence=None, max_logit_diff=0.0,
                     dtype=dtype_name(lm.dtype), device=lm.device.type, storage=storage,
                     weights=lm.weights, blended=blended)
    ids = torch.tensor([list(prompt_ids) + list(answer_ids[:-1])], device=lm.device)  # [1, prompt + answer - 1]
    with torch.inference_mode():
        # logits_to_keep=n: only the positions that predict answer tokens, [1, n, vocab]
        out = lm.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=n)
    ref = out.logits[0].float()  # [n, vocab]
    got = cached_logits.to(ref.device).float()  # [n, vocab]
    if got.shape != ref.shape:
        raise ValueError(f"cached logits {tuple(got.shape)} do not match the recompute's {tuple(ref.shape)}")
    diff = (got - ref).abs().amax(dim=-1)  # [n]
    log_ref, log_got = torch.log_softmax(ref, dim=-1), torch.log_softmax(got, dim=-1)  # [n, vocab]
    kl = (log_ref.exp() * (log_ref - log_got)).sum(-1).clamp_min(0)  # [n]
    top_ref, top_got = ref.topk(2, dim=-1), got.topk(2, dim=-1)  # values for the margins
    # the top token as greedy decoding picks it: argmax, whose tie-break (the lowest id) topk does not promise
    pick_ref, pick_got = ref.argmax(dim=-1), got.argmax(dim=-1)  # [n]
    divergences = []
    for i in (pick_ref != pick_got).nonzero().flatten().tolist():
        divergences.append(Divergence(
            position=i,
            cached_token=int(pick_got[i]),
            recompute_token=int(pick_ref[i]),
            margin=float(top_ref.values[i, 0] - top_ref.values[i, 1]),
            cached_margin=float(top_got.values[i, 0] - top_got.values[i, 1]),
            logit_diff=float(diff[i]),
        ))
    return Check(
        identical=not divergences,
        tokens=n,
        first_divergence=divergences[0].position if divergences else None,
        max_logit_diff=float(diff.max()),
        divergences=divergences,
        dtype=dtype_name(lm.dtype),
        device=lm.device.type,
        agreement=(n - len(divergences)) / n,
        kl_mean=float(kl.mean()),
        storage=storage,
        weights=lm.weights,
        blended=blended,
    )


def summarize(checks: Iterable[Check]) -> dict[str, Any]:
    """The same statistics over several answers (kvcli bench): counts, worst difference, near-tie margins."""
    checks = list(checks)
    return {
        "answers": len(checks),
        "identical": sum(c.identical for c in checks),
        "tokens": sum(c.tokens for c in checks),
        "max_logit_diff": max((c.max_logit_diff for c in checks), default=0.0),
        "first_divergence": [c.first_divergence for c in checks],
        "divergent_margins": [d.margin for c in checks for d in c.divergences],
    }
