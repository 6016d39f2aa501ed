"""What identifies a loaded model and tokenizer: the fingerprint a cache records and is checked against."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...home import remembered_digest
from ...format.identity import (WEIGHTS_SCHEME, config_sha256, sha256_json, template_sha256,  # noqa: F401  (the API's names)
                                tokenizer_sha256, weights_sha256 as hash_weights)


def fingerprint(model: Any, tokenizer: Any, files: Sequence[Path] = (), memo: Path | None = None,
                weights: str | None = None) -> dict[str, Any]:
    """What must match between the model that built a cache and the one that reads it (files, memo: where the
    weights were read from and where their fingerprint is remembered, see weights_sha256; weights: that fingerprint,
    when it was computed as the weights were read)."""
    from ...format.codec import dtype_name

    config = model.config
    template = getattr(tokenizer, "chat_template", None)
    return {
        "name": getattr(config, "_name_or_path", "") or config.model_type,
        "model_type": config.model_type,
        "config_sha256": config_sha256(config),
        "weights_sha256": weights_sha256(model, files, memo, weights),
        "weights_scheme": WEIGHTS_SCHEME,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": template_sha256(template),
        "dtype": dtype_name(model.dtype),
        **shape(config),
    }


def text_config(config: Any) -> Any:
    """The decoder's config: a multimodal model's text part, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shape(config: Any) -> dict[str, Any]:
    """What a config says of the cache's shape and the model's positions (from config.json alone: counting)."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1  # falcon-7b: one key/value head whatever num_kv_heads says (gpt_bigcode's config says 1 itself)
    return {"num_layers": getattr(text, "num_hidden_layers", None), "num_kv_heads": kv_heads,
            "head_dim": getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None),
            "max_positions": getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)}


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_sha256(model: Any, files: Sequence[Path] = (), memo: Path | None = None, known: str | None = None) -> str:
    """sha256 over every element of every weight, as bfloat16 (so the dtype a model is loaded in, checked
    separately, does not change it, and --convert-dtype can match), with each tensor's name and shape: an edit
    of any weight changes it. `files`: the model files the weights were read from; the value is remembered
    in the folder `memo` ($KVCLI_HOME/fingerprints) by their identity (path, size, mtime, inode), so loading
    the same files again costs a stat per file, not a pass over the weights."""
    compute = (lambda: known) if known is not None else (lambda: _hash_every_weight(model))
    key = _files_key(files) if memo is not None else None
    return compute() if key is None else remembered_digest(memo / key, compute)


def _hash_every_weight(model: Any) -> str:
    return hash_weights(model.named_parameters())


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The files a model folder's weights are read from (every one of them, sorted)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def _files_key(files: Sequence[Path]) -> str | None:
    if not files:
        return None
    try:
        ident = [(str(Path(f).resolve()), (st := os.stat(f)).st_size, st.st_mtime_ns, st.st_ino) for f in files]
    except OSError:
        return None
    return sha256_json([WEIGHTS_SCHEME, ident])[:32]
