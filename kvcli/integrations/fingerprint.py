"""kvcli's model fingerprint, computed from a model folder an engine serves (not from a loaded kvcli model).

The manifest records `config_sha256`, `weights_sha256`, `tokenizer_sha256` and `chat_template_sha256` as
kvcli/engine/model/fingerprint.py computes them from the transformers objects it loaded. An engine such as vLLM
loads the weights its own way, so the same values are recomputed here from the folder (or hub snapshot)
with the engine environment's transformers and safetensors, imported inside the functions (never at
import: `import kvcli.integrations.vllm` stays free of transformers). The rules are format/identity.py's, the
engine's own (tests/integrations/test_vllm_connector.py checks both give the same values for the default model);
a value that cannot be computed is None and the connector then refuses caches on that field.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..format.identity import config_sha256, template_sha256, tokenizer_sha256, weights_sha256 as hash_weights


def weights_sha256(folder: Path, config: Any) -> str | None:
    """The engine's weights_sha256 (format/identity.py: every element as bfloat16) from the safetensors files in
    `folder`, the parameters in the order transformers' model class lists them (built on the meta device,
    nothing allocated). None if a parameter is not found under its name or has another shape."""
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
    opened: dict[Path, Any] = {}

    def tensors():
        for name, shape in names:
            f = where[name]
            if f not in opened:
                opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            t = opened[f].get_tensor(name)
            if list(t.shape) != shape:
                raise _Mismatch(name)
            yield name, t

    with ExitStack() as stack:  # every file opened, closed at the end
        try:
            return hash_weights(tensors())
        except _Mismatch:
            return None


class _Mismatch(Exception):
    """A parameter of the served folder has another shape than the model class says."""


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
