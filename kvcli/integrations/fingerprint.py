"""kvcli's model fingerprint, computed from a model folder an engine serves (not from a loaded kvcli model).

The manifest records `config_sha256`, `weights_sha256`, `tokenizer_sha256` and `chat_template_sha256` as
kvcli/engine/model/fingerprint.py computes them from the transformers objects it loaded. An engine such as vLLM
loads the weights its own way, so the same values are recomputed here from the folder (or hub snapshot)
with the engine environment's transformers and safetensors, imported inside the functions (never at
import: `import kvcli.integrations.vllm` stays free of transformers). The rules are kept identical to
engine/model/models.py (tests/test_vllm_connector.py checks both give the same values for the default model);
a value that cannot be computed is None and the connector then refuses caches on that field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# engine/model/models.py _VOLATILE_CONFIG_KEYS
VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_model_name_or_path", "_commit_hash", "dtype",
                        "torch_dtype", "use_cache"}
SAMPLES = 1024  # engine/model/models.py weights_sha256(samples=1024)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()).hexdigest()


def config_sha256(config: Any) -> str:
    """config: a transformers PretrainedConfig."""
    return sha256_json({k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS})


def template_sha256(template: Any) -> str | None:
    return hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None


def tokenizer_sha256(tokenizer: Any) -> str:
    """engine/model/models.py tokenizer_sha256: class, full backend pipeline, special tokens and BOS/EOS behaviour."""
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


def weights_sha256(folder: Path, config: Any) -> str | None:
    """engine/model/models.py weights_sha256 from the safetensors files in `folder`: the parameters in the order
    transformers' model class lists them (built on the meta device, nothing allocated), each sampled at the
    same 1,024 evenly spaced elements, as bfloat16. None if a parameter is not found under its name."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                where[key] = f
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = [(name, list(p.shape)) for name, p in skeleton.named_parameters()]
    del skeleton
    if any(name not in where for name, _ in names):
        return None
    h = hashlib.sha256()
    opened: dict[Path, Any] = {}
    try:
        for name, shape in names:
            f = where[name]
            if f not in opened:
                opened[f] = safe_open(str(f), framework="pt").__enter__()
            t = opened[f].get_tensor(name)
            if list(t.shape) != shape:
                return None
            flat = t.reshape(-1)
            k = min(SAMPLES, flat.numel())
            idx = torch.arange(k, dtype=torch.long) * (flat.numel() - 1) // max(k - 1, 1)
            sample = flat[idx].to(torch.bfloat16).view(torch.int16)
            h.update(f"{name}:{shape}:".encode())
            h.update(sample.numpy().tobytes())
    finally:
        for st in opened.values():
            st.__exit__(None, None, None)
    return h.hexdigest()


def of_folder(model: str, *, revision: str | None = None, tokenizer: str | None = None,
              trust_remote_code: bool = False) -> dict[str, str | None]:
    """The four hashes for the model vLLM serves (a folder, or a hub id already in the local hub cache)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, revision=revision, local_files_only=True))
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    tok = AutoTokenizer.from_pretrained(tokenizer or str(folder), trust_remote_code=trust_remote_code)
    out: dict[str, str | None] = {"config_sha256": config_sha256(config), "tokenizer_sha256": tokenizer_sha256(tok),
                                  "chat_template_sha256": template_sha256(getattr(tok, "chat_template", None))}
    try:
        out["weights_sha256"] = weights_sha256(folder, config)
    except Exception:  # an architecture transformers cannot build here: refuse on weights, say so
        out["weights_sha256"] = None
    return out
