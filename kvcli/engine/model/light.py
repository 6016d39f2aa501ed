"""A model's config and tokenizer without torch: config.json read as JSON, the tokenizer through transformers'
own TokenizersBackend class (which imports no torch), for `kvcli count` and the checks made before a model loads.

Used only where the result is the one transformers' Auto classes give (tests/cli/test_count.py compares them):
a model type in LIGHT_TYPES, whose config.json states what the cache's shape needs, and a tokenizer_config.json
naming the generic fast tokenizer (AutoTokenizer then loads exactly that class from tokenizer.json). Anything
else returns None with the reason, and the caller loads through transformers (torch imported, still no weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Config classes whose JSON holds everything the cache's shape needs, checked against transformers' own plan.
LIGHT_TYPES = frozenset({"llama", "mistral", "qwen3", "granite"})
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
_NEEDED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings", "vocab_size")
_UNUSUAL = ("kv_sharing_modes", "per_layer_config", "text_config", "kv_lora_rank", "auto_map", "attention_chunk_size")


class JsonConfig:
    """config.json as attributes (only what counting and the layer plan read; a key it leaves out is absent, as
    getattr(..., None) expects), with the text config being itself."""

    def __init__(self, data: dict[str, Any]):
        self.__dict__.update(data)

    def get_text_config(self, decoder: bool = True) -> "JsonConfig":
        return self


def config(folder: Path) -> tuple[JsonConfig | None, str | None]:
    """(config, None) when config.json alone is enough, else (None, why not)."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"config.json unreadable ({exc.__class__.__name__})"
    kind = data.get("model_type")
    if kind not in LIGHT_TYPES:
        return None, f"model type {kind!r} is read through transformers"
    missing = [k for k in _NEEDED if not isinstance(data.get(k), int)]
    unusual = [k for k in _UNUSUAL if data.get(k) is not None]
    if missing or unusual or data.get("is_encoder_decoder"):
        return None, f"config.json {'lacks ' + ', '.join(missing) if missing else 'has ' + ', '.join(unusual or ['is_encoder_decoder'])}"
    for rope in (data.get("rope_scaling"), data.get("rope_parameters")):
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
            return None, "rotary scaling is read through transformers"
    return JsonConfig(data), None


def plan(cfg: JsonConfig) -> list[tuple[str, int | None]]:
    """(kind, window) per layer, as transformers' DynamicCache builds it (cache_utils.get_layer_types_and_kwargs)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # what a config class derives itself (qwen3's max_window_layers) is left to transformers
        if window is not None and cfg.model_type not in ("llama", "mistral"):
            raise ValueError("sliding window without layer_types")
        types = ["full_attention" if window is None else "sliding_attention"] * cfg.num_hidden_layers
    out = []
    for t in types:
        if t == "full_attention":
            out.append(("full", None))
        elif t == "sliding_attention" and isinstance(window, int):
            out.append(("sliding", window))
        else:
            raise ValueError(f"layer type {t!r}")
    return out


def tokenizer(folder: Path) -> tuple[Any | None, str | None]:
    """(tokenizer, None) when AutoTokenizer would load the generic fast tokenizer from tokenizer.json, else (None, why)."""
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "no readable tokenizer_config.json"
    if settings.get("tokenizer_class") not in _GENERIC_TOKENIZERS or settings.get("auto_map") or not (folder / "tokenizer.json").is_file():
        return None, f"tokenizer class {settings.get('tokenizer_class')!r} is loaded through transformers"
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return TokenizersBackend.from_pretrained(str(folder)), None
    except Exception as exc:  # noqa: BLE001  the caller falls back to the Auto classes, which report it properly
        return None, f"tokenizer failed to load alone ({exc.__class__.__name__})"
    finally:
        hf_logging.set_verbosity(level)


def load(folder: Path) -> tuple[JsonConfig, Any, list[tuple[str, int | None]]] | str:
    """(config, tokenizer, layer plan) without torch, or the reason they must come through transformers."""
    cfg, why = config(folder)
    if cfg is None:
        return why or "config"
    try:
        layer_plan = plan(cfg)
    except ValueError as exc:
        return f"config.json has a {exc}"
    tok, why = tokenizer(folder)
    if tok is None:
        return why or "tokenizer"
    return cfg, tok, layer_plan
