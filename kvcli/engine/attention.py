"""Grouped-query attention without repeating key/value heads, selected per model through AttentionInterface.

transformers' sdpa attention copies every key/value head n_rep times before attending whenever a mask
is given (a question after a cached document, a prefill chunk), unless a process-wide environment
switch is set. kvcli registers its own attention function instead, which calls torch's sdpa with
`enable_gqa=True`, and selects it only on models that run sdpa on the CPU, where it was measured
faster and gives the same tokens (tests/test_attention.py). Everything else goes to transformers' sdpa.
"""

from __future__ import annotations

from typing import Any

NAME = "kvcli_gqa_sdpa"
_registered = False


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs) -> tuple[Any, None]:
    """query [b, heads, q, d], key/value [b, kv_heads, kv, d] -> output [b, q, heads, d], as transformers' sdpa."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups <= 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("output_attentions", False)):
        # no mask: transformers already attends grouped heads natively; the rest is sdpa's own business
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False, enable_gqa=True
    )  # [b, heads, q, d]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register kvcli's attention (and sdpa's mask builder under the same name) with transformers, once."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, gqa_sdpa_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


def select(model: Any) -> bool:
    """Switch this model (only) to kvcli's attention when it runs sdpa on the CPU; True if switched."""
    import torch

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or torch.device(model.device).type != "cpu":
        return False
    model.set_attn_implementation(register())
    return model.config._attn_implementation == NAME


def kernel_name(implementation: str | None) -> str:
    """The attention kernel behind an implementation name, as caches record it: kvcli's is torch's sdpa
    (same kernel, grouped heads read in place; tests/test_attention.py shows identical logits)."""
    if implementation == NAME:
        return "sdpa"
    return str(implementation or "unknown")
