"""Cache directory -> transformers cache object, after checking that it fits the loaded model."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import layers, manifest as mf
from .codec import DTYPES, decode_layer
from .errors import CacheMismatchError
from .framing import FRAMING_VERSION
from .models import LoadedModel
from .store import OpenedCache

_CHECKED = (
    ("model_type", "model type"),
    ("config_sha256", "model config"),
    ("weights_sha256", "weights"),
    ("tokenizer_sha256", "tokenizer"),
    ("num_layers", "layer count"),
    ("num_kv_heads", "key/value heads"),
    ("head_dim", "head dim"),
)


def check_fits(manifest: mf.Manifest, lm: LoadedModel, where: str, *, convert_dtype: bool = False) -> None:
    """Refuse (CacheMismatchError) a cache built with another model, tokenizer, template, dtype or layout."""
    have, want = lm.fingerprint, manifest.model
    diffs = [label for key, label in _CHECKED if have.get(key) != want.get(key)]
    if manifest.framing.get("kind") == "chat":
        template = have.get("chat_template_sha256")
        if template is None or template != manifest.framing.get("template_sha256"):
            diffs.append("chat template")
    if manifest.framing.get("version") != FRAMING_VERSION:
        diffs.append("prompt framing version")
    if have.get("dtype") != want.get("dtype") and not convert_dtype:
        diffs.append(f"dtype (cache {want.get('dtype')}, model {have.get('dtype')}; --convert-dtype allows it)")
    if diffs:
        name = want.get("source", {}).get("name", want.get("name"))
        raise CacheMismatchError(f"{where}: built for another model ({name}): differs in {', '.join(diffs)}")
    plan = layers.plan(lm.model.config)
    for layer, (kind, window) in zip(manifest.layers, plan):
        if (layer.kind, layer.sliding_window) != (kind, window):
            raise CacheMismatchError(
                f"{where}: layer {layer.index} is {layer.kind} (window {layer.sliding_window}) in the cache, "
                f"{kind} (window {window}) in the model"
            )


def load_states(cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None) -> list[layers.LayerState]:
    """Read, verify and decompress every shard in parallel threads; tensors land on `device` in `dtype`."""
    m = cache.manifest
    stored = DTYPES[m.dtype]
    target = dtype or stored

    def one(i: int) -> layers.LayerState:
        entry = m.layers[i]
        data = cache.read_shard(i)
        keys, values = decode_layer(
            data,
            name=str(cache.path / entry.file),
            transform=m.transform,
            dtype=stored,
            key_shape=entry.key_shape,
            value_shape=entry.value_shape,
            decoded_bytes=entry.decoded_bytes,
        )
        del data
        if target != stored or str(device) != "cpu":
            keys, values = keys.to(device=device, dtype=target), values.to(device=device, dtype=target)
        return layers.LayerState(entry.kind, keys, values, entry.seq_length, entry.sliding_window)

    workers = threads or min(len(m.layers), max(2, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, range(len(m.layers))))


def new_cache(lm: LoadedModel, states: list[layers.LayerState]):
    """A fresh DynamicCache for the model holding the given states (cheap: no tensor is copied)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    layers.fill(cache, states)
    return cache
