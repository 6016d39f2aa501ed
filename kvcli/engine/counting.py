"""Know before you pay: a document's tokens, its cache's size and the room left, from config and tokenizer only.

No weights are loaded and nothing runs through the model. Sizes on disk and times are estimates from
ratios measured in this repository (README, "Performance"), not promises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .prompt import framing as fr
from .cache import layers
from .model import models
from .prefilling import ANSWER_ROOM
from ..documents import Document

# stored / raw for byte planes + zstd level 1, measured on the default model's caches (README, "Performance")
DISK_RATIO = {"float32": 0.83, "bfloat16": 0.67, "float16": 0.84}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# Prefill seconds on this project's 2-core CPU for the 135M default model, fitted to the README's
# recompute times (1,024 tokens: 1.73 s; 4,096: 9.94 s): t = n * (A + B * n), scaled by parameter count.
_A, _B, _REF_PARAMS = 1.44e-3, 2.4e-7, 134.5e6


@dataclass
class Count:
    document: str
    tokens: int  # the framed document's ids: what the cache holds
    dtype: str
    bytes_raw: int  # keys and values of every layer
    bytes_on_disk_estimate: int
    max_positions: int | None
    room: int | None  # positions left for a question and its answer
    fits: bool  # room for kvcli's minimum question-and-answer reserve
    prefill_s_estimate: float | None  # on a 2-core CPU; an accelerator is far faster

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Counter:
    """A model's tokenizer and config, loaded once for counting many documents."""

    def __init__(self, model: str | None = None, *, revision: str | None = None, dtype: str = "auto",
                 framing: str = "auto", system: str | None = None, trust_remote_code: bool = False):
        source = models.resolve(model, revision=revision)
        self.config, self.tokenizer = models.config_and_tokenizer(source, trust_remote_code=trust_remote_code)
        self.plan = layers.plan(self.config)  # refuses models kvcli cannot cache, as prefill would
        self.framing = fr.choose(self.tokenizer, framing, system)
        self.dtype = _dtype_name(dtype, self.config)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
        self.kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        self.params = _parameter_count(self.config)

    def count(self, document: Document) -> Count:
        n = len(fr.document_ids(self.tokenizer, self.framing, document.text))
        per_token = 2 * self.kv_heads * self.head_dim * ITEMSIZE[self.dtype]  # keys + values
        raw = sum(per_token * (n if kind == "full" else min(n, window - 1)) for kind, window in self.plan)
        room = self.max_positions - n if self.max_positions else None
        est = n * (_A + _B * n) * self.params / _REF_PARAMS if self.params else None
        return Count(document=document.name, tokens=n, dtype=self.dtype, bytes_raw=raw,
                     bytes_on_disk_estimate=round(raw * DISK_RATIO[self.dtype]), max_positions=self.max_positions,
                     room=room, fits=room is None or room >= ANSWER_ROOM, prefill_s_estimate=est)


def _dtype_name(dtype: str, config: Any) -> str:
    """The dtype prefill would compute in (auto: float32 on CPU, the model's own on an accelerator)."""
    from ..format.codec import dtype_name

    return dtype_name(models.pick_dtype(dtype, models.pick_device("auto"), config))


def _parameter_count(config: Any) -> int | None:
    """Parameters from the architecture alone (built on the meta device: no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # an architecture transformers cannot build from its config alone: no time estimate
        return None
