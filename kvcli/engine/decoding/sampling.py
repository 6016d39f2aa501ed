"""Seeded sampling that touches no global state: a logits processor with its own torch.Generator.

transformers 5.24's generate() samples with torch's global generator and takes no `generator`; kvcli
runs generate() greedily and lets this processor do temperature, top-p and the draw itself. It
returns scores where only the drawn token is finite, so generate()'s argmax keeps exactly that token.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper


class Sampler(LogitsProcessor):
    """Temperature, then top-p, then one draw per row from `generator` (seeded, or from fresh entropy)."""

    def __init__(self, temperature: float, top_p: float = 1.0, seed: int | None = None, device: Any = "cpu"):
        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)  # [batch, vocab]
        picked = torch.multinomial(probs, num_samples=1, generator=self.generator)  # [batch, 1]
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, picked, 0.0)
