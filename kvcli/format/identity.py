"""How a model's identity is hashed into a manifest's fingerprint: pure rules shared by the engine (which hashes
the objects it loaded) and the vLLM connector (which hashes the folder vLLM serves), so the two cannot drift."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

WEIGHTS_SCHEME = "every-element-bf16"  # what weights_sha256 covers (a cache without a scheme hashed samples of each tensor)
VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_model_name_or_path", "_commit_hash", "dtype",
                        "torch_dtype", "use_cache"}
# fingerprint fields a cache and the model reading it must agree on, as refusals name them (engine/model/fit.py,
# integrations/caches.py): the cache's shape, then what the hashes cover
STRUCTURE = (("model_type", "model type"), ("num_layers", "layer count"), ("num_kv_heads", "key/value heads"),
             ("head_dim", "head dim"))
HASHES = (("config_sha256", "model config"), ("weights_sha256", "weights"), ("tokenizer_sha256", "tokenizer"))
FRAMING_KEYS = ("kind", "system", "template_sha256")  # the framing asked for; where the cut fell (version, anchor,
# pending) follows from it, the document and the tokenizer
_CHUNK = 1 << 24  # elements hashed at a time (bounded extra memory: 32 MiB as bfloat16)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()).hexdigest()


def ids_digest(ids: Any) -> str:
    """The digest of a cache's ids that an `ask --json` answer carries (not the ids), so a follow-up can check it
    continues an answer about that cache."""
    return sha256_json([int(i) for i in ids])


def config_sha256(config: Any) -> str:
    """config: a transformers PretrainedConfig (its to_dict(), less the keys that vary between saves)."""
    return sha256_json({k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS})


def template_sha256(template: Any) -> str | None:
    return hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None


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


def weights_sha256(named: Iterable[tuple[str, Any]]) -> str:
    """sha256 over every element of every weight (name, tensor) in the order given, as bfloat16 (so the dtype
    a model is loaded in, checked separately, does not change it), with each tensor's name and shape."""
    import torch

    h = hashlib.sha256(WEIGHTS_SCHEME.encode())
    with torch.no_grad():
        for name, tensor in named:
            flat = tensor.detach().reshape(-1)
            h.update(f"{name}:{list(tensor.shape)}:".encode())
            for start in range(0, flat.numel(), _CHUNK):
                part = flat[start : start + _CHUNK].to("cpu", torch.bfloat16).view(torch.int16)
                h.update(part.numpy().tobytes())
    return h.hexdigest()
