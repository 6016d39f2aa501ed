"""What identifies a loaded model and tokenizer: the fingerprint a cache records and is checked against."""

from __future__ import annotations

import hashlib
import json
from typing import Any

def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()).hexdigest()


_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_model_name_or_path", "_commit_hash", "dtype", "torch_dtype", "use_cache"}


def fingerprint(model: Any, tokenizer: Any) -> dict[str, Any]:
    """What must match between the model that built a cache and the one that reads it."""
    from ...format.codec import dtype_name

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1  # falcon-7b: one key/value head whatever num_kv_heads says (gpt_bigcode's config says 1 itself)
    template = getattr(tokenizer, "chat_template", None)
    return {
        "name": getattr(config, "_name_or_path", "") or config.model_type,
        "model_type": config.model_type,
        "config_sha256": sha256_json(cfg),
        "weights_sha256": weights_sha256(model),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None,
        "dtype": dtype_name(model.dtype),
        "num_layers": getattr(text, "num_hidden_layers", None),
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "max_positions": getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None),
    }


def weights_sha256(model: Any, samples: int = 1024) -> str:
    """Hash a fixed sample of every weight (as bfloat16, so dtype is checked separately): cheap at any
    model size, and it tells a fine-tune apart from its base model, which share config and tokenizer."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            k = min(samples, flat.numel())
            idx = (torch.arange(k, dtype=torch.long) * (flat.numel() - 1) // max(k - 1, 1)).to(flat.device)
            sample = flat[idx].to("cpu", torch.bfloat16).view(torch.int16)
            h.update(f"{name}:{list(param.shape)}:".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """Hash the tokenizer as loaded: class, full backend pipeline, special tokens and BOS/EOS behaviour."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
        "bos": getattr(tokenizer, "bos_token_id", None),
        "eos": getattr(tokenizer, "eos_token_id", None),
        "add_bos": getattr(tokenizer, "add_bos_token", None),
        "add_eos": getattr(tokenizer, "add_eos_token", None),
    }
    return sha256_json(parts)
