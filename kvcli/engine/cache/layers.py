"""Which cache layers kvcli can store and restore exactly, and how to move their state in and out.

Two kinds are supported: "full" (transformers' DynamicLayer: every token's keys/values) and
"sliding" (DynamicSlidingWindowLayer: the last window-1 tokens plus the counted length, which must be
restored too or generate() silently recomputes the document). Anything else is refused up front.
kvcli's own cache (kvcache.py) subclasses these two layer types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ModelError
from ..model.fingerprint import text_config


@dataclass(frozen=True)
class LayerState:
    """One layer's cached state: keys/values [batch, kv_heads, cached, head_dim] and its counted length."""

    kind: str
    keys: Any
    values: Any
    seq_length: int
    sliding_window: int | None


def plan(config: Any) -> list[tuple[str, int | None]]:
    """(kind, window) for each decoder layer, from the config alone; ModelError for what kvcli refuses."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    model_type = getattr(config, "model_type", "unknown")
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"model type '{model_type}' is an encoder-decoder model; kvcli caches decoder-only models")
    text = text_config(config)
    if getattr(text, "kv_lora_rank", None):
        raise ModelError(f"model type '{model_type}' uses compressed latent attention (MLA); kvcli cannot cache it exactly")
    _refuse_length_dependent_rope(text, model_type)
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:
        raise ModelError(f"model type '{model_type}': cannot build its cache ({exc.__class__.__name__}: {exc})") from None
    if not cache.layers:
        raise ModelError(f"model type '{model_type}': its config describes no cache layers")
    out = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            out.append(("full", None))
        elif type(layer) is DynamicSlidingWindowLayer:
            out.append(("sliding", int(layer.sliding_window)))
        else:
            raise ModelError(
                f"model type '{model_type}' has a {type(layer).__name__} cache layer (layer {i}); "
                "kvcli caches only attention keys/values (full or sliding-window), not recurrent or other state"
            )
    return out


def _refuse_length_dependent_rope(text: Any, model_type: str) -> None:
    """longrope (Phi-3-128k, Phi-3.5, Phi-4-mini) switches every position's rotary frequencies once a forward
    pass reaches past original_max_position_embeddings: a document cached in shorter passes (or shorter than
    that) gets other keys than the whole prompt recomputed, so answers silently differ. Exact only if no
    sequence kvcli allows can pass that point."""
    limit = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_parameters", None) or {}
    for params in [rope] if "rope_type" in rope else [p for p in rope.values() if isinstance(p, dict)]:
        if params.get("rope_type") != "longrope":
            continue
        original = params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
        if limit is None or original is None or original < limit:
            raise ModelError(
                f"model type '{model_type}' uses longrope rotary scaling, whose frequencies change for every position once "
                f"a sequence passes {original} tokens; kvcli cannot cache it exactly"
            )


def _kind(layer: Any, index: int) -> str:
    """'full' or 'sliding' for transformers' two plain dynamic layers (or kvcli's own subclasses of them)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    base = next(c for c in type(layer).__mro__ if not c.__module__.startswith("kvcli"))
    if base is DynamicLayer:
        return "full"
    if base is DynamicSlidingWindowLayer:
        return "sliding"
    raise ModelError(f"layer {index} is a {type(layer).__name__}; kvcli stores only full or sliding-window attention layers")


def read(cache: Any) -> list[LayerState]:
    """The state of every layer of a filled cache (DynamicCache or KVCache); ModelError for a layer holding anything else."""
    states = []
    for i, layer in enumerate(cache.layers):
        sliding = _kind(layer, i) == "sliding"
        states.append(
            LayerState(
                kind="sliding" if sliding else "full",
                keys=layer.keys,
                values=layer.values,
                seq_length=int(layer.get_seq_length()),
                sliding_window=int(layer.sliding_window) if sliding else None,
            )
        )
    return states
