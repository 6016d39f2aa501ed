"""A GGUF file's transformers config and tokenizer, read from its header once and quickly.

transformers reads a GGUF config with gguf-py's reader, which decodes every field element by element (the vocabulary
and merges included: seconds for a 150k vocabulary), and AutoTokenizer reads the config that way again before it
builds the tokenizer. Here the config is mapped from gguf_file's header (arrays of strings skipped) with
transformers' own tables, as its `load_gguf_checkpoint` maps them, for the architectures it maps without special
cases; the tokenizer is built by transformers' GGUF tokenizer reader, told the model type so it reads no config.
Any other file is read through transformers' AutoConfig and AutoTokenizer as they stand.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from .gguf_file import Header, Strings, read_header

# architectures load_gguf_checkpoint renames or gives extra keys beyond its tables: read through transformers
_SPECIAL = ("t5", "stablelm", "qwen2moe", "qwen3moe", "gpt_oss", "gpt-oss", "minimax-m2", "falcon", "bloom", "gemma3",
            "gemma4", "lfm2")


def config_dict(header: Header) -> dict[str, Any] | None:
    """The config dict transformers makes of this header (None: an architecture left to transformers itself)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config

    fields, arch = header.fields, header.architecture
    if arch in GGUF_CONFIG_ARCHS:  # transformers' own reader of these: fields as it reads them
        return get_gguf_config({k: v.count if isinstance(v, Strings) else list(v) if isinstance(v, tuple) else v
                                for k, v in fields.items()}, tuple(header.tensors))
    if arch not in GGUF_CONFIG_MAPPING or any(s in arch for s in _SPECIAL) or (
            "llama" in arch and fields.get("general.name") == "mistral"):
        return None
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in header.tensors}
    for key, value in fields.items():
        prefix, _, rest = key.partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if name is None or name == -1:
            continue
        if isinstance(value, Strings):
            return None  # a config value this reader skips
        config[name] = (value[0] if len(value) == 1 else list(value)) if isinstance(value, tuple) else value
    if "vocab_size" not in config and isinstance(tokens := fields.get("tokenizer.ggml.tokens"), Strings):
        config["vocab_size"] = tokens.count
    return config


def _tokenizer_class(model_type: str, folder: Path) -> tuple[Any, dict[str, Any]] | None:
    """The tokenizer class AutoTokenizer picks for a GGUF file of this model type, and what to tell it so that it
    builds the tokenizer from the file without reading its config again; None where AutoTokenizer would look
    further (a tokenizer_config.json beside the file, Mistral's tokenizers)."""
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if (folder / "tokenizer_config.json").exists():
        return None
    if model_type not in TOKENIZER_MAPPING_NAMES:  # no tokenizer of its own: transformers' generic one
        return TokenizersBackend, {}
    name = TOKENIZER_MAPPING_NAMES[model_type]
    return (AutoTokenizer, {"tokenizer_type": model_type}) if name and "Mistral" not in name else None


def read(path: Path, *, check: Any = None) -> tuple[Any, Any] | None:
    """(config, tokenizer) of the GGUF file at `path`, read from its header once; None for a file this module
    leaves to transformers. check(config), if given, runs before the tokenizer is built."""
    found = config_dict(read_header(path))
    if found is None:
        return None
    from transformers import AutoConfig

    from .quiet import quiet_transformers

    with quiet_transformers():
        config = AutoConfig.for_model(**found)  # as AutoTokenizer makes a GGUF file's config
    if check is not None:
        check(config)
    how = _tokenizer_class(config.model_type, path.parent)
    if how is None:
        return None
    cls, told = how
    with quiet_transformers():
        tokenizer = cls.from_pretrained(str(path.parent), gguf_file=path.name, **told)
    return config, tokenizer


def save_light(folder: Path, config: Any, tok: Any) -> None:
    """Keep a GGUF model's config and tokenizer as a small folder (atomic), read by later loads and counts instead
    of the file. Failing to save only costs the next load a read of the file's header."""
    from ...format.writing import hidden_sibling

    tmp = hidden_sibling(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
