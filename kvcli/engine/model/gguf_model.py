"""A GGUF model on its own bits (`weights="gguf"`): the weights streamed from the mapped file into the kernels'
layers (gguf_weights) on a model built from the config and tokenizer models.config_and_tokenizer read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .fingerprint import fingerprint, sha256_json


def packed_folder(converted: Path) -> Path:
    """Where a GGUF file's tensors prepared for the kernels are kept, beside its (float) converted folder's place."""
    return converted.with_name(converted.name + "-packed")


def check_file(source: dict[str, Any], converted: Path) -> None:
    """Refuse a file that is not a whole GGUF before transformers reads its config (ModelError naming it)."""
    from . import gguf_weights

    gguf_weights.check_file(Path(source["path"]), source["sha256"], packed_folder(converted))


def load_gguf(source: dict[str, Any], config: Any, tok: Any, dtype: Any, trust_remote_code: bool,
              converted: Path) -> tuple[Any, dict[str, Any]]:
    """The model of `config` on the file's own blocks, in `dtype` (the activations), and its fingerprint; `source`
    records the weights."""
    from . import attention, gguf_weights

    model = gguf_weights.skeleton(config, dtype, trust_remote_code)
    report = gguf_weights.load(Path(source["path"]), source["sha256"], model, packed_folder(converted))
    model.config._name_or_path = source["path"]  # as from_pretrained names a model by where it came from
    model.eval()
    attention.select(model)
    fp = fingerprint(model, tok)  # the parameters left are the small ones; the file's digest stands for the rest
    fp["weights_sha256"] = sha256_json(["gguf-file", source["sha256"]])
    fp["weights_error"] = {kind: {"layers": n, "max_abs": 0.0, "mean_abs": 0.0} for kind, n in report["layers"].items()}
    source["weights"] = fp["weights"] = "gguf"
    return model, fp
