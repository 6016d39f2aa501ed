"""Which kvcli caches an engine may load, and which cache a prompt starts with. No torch, no engine.

An engine (vLLM) describes the model it runs as an `EngineModel` in the manifest's own terms; `refusal`
applies the fit rules of `kvcli ask` (kvcli/engine/model/fit.py) to a manifest and returns the reason a cache
does not fit, or None. `CacheIndex` holds the caches that fit, keyed by their first block of token ids,
and `match` finds, for a prompt's ids, the cache sharing the longest prefix with it, in whole blocks and
never the whole prompt (the engine must compute at least one token to produce logits).

Causal attention makes every prefix of a cache a valid cache: the keys and values of position i depend
only on tokens 0..i. So a prompt that shares only the first k ids of a cache can load those k.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import KvcliError
from ..format import manifest as mf, store
from ..format.identity import HASHES, STRUCTURE
from .. import remote

@dataclass(frozen=True)
class EngineModel:
    """The model an engine serves, described with the manifest's fields.

    `layers` is (kind, window) per decoder layer as the engine's paged cache holds it ("full", None) or
    ("sliding", window). A hash that could not be computed is None, and a cache then cannot be shown to fit:
    it is refused naming the field, unless the field is in `unchecked` (an operator's explicit choice).
    """

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    layers: tuple[tuple[str, int | None], ...]
    max_positions: int | None = None
    vocab_size: int | None = None
    hashes: dict[str, str | None] = field(default_factory=dict)  # config/weights/tokenizer/chat_template _sha256
    unchecked: frozenset[str] = frozenset()
    allow_lossy: bool = False


def refusal(m: mf.Manifest, engine: EngineModel) -> str | None:
    """Why the cache with manifest `m` must not be loaded into `engine`, or None if it fits."""
    want = m.model
    diffs = [label for key, label in STRUCTURE if want.get(key) != getattr(engine, key)]
    for key, label in HASHES:
        if key in engine.unchecked:
            continue
        have = engine.hashes.get(key)
        if have is None:
            diffs.append(f"{label} (the engine's could not be computed)")
        elif have != want.get(key):
            diffs.append(label)
    if m.framing.get("kind") == "chat" and "chat_template_sha256" not in engine.unchecked:
        template = engine.hashes.get("chat_template_sha256")
        if template is None or template != m.framing.get("template_sha256"):
            diffs.append("chat template")
    if m.framing.get("version") not in mf.FRAMING_VERSIONS:  # prompt ids are matched, so every version reads alike
        diffs.append("prompt framing version")
    if m.dtype != engine.dtype:
        diffs.append(f"dtype (cache {m.dtype}, engine {engine.dtype})")
    if m.weights != "float":  # kvcli's --weights q8 or q4: keys/values of arithmetic no engine runs
        diffs.append(f"weights (the cache was computed on kvcli's {m.weights} weights; rebuild it with --weights float)")
    if diffs:
        return f"built for another model ({m.model_name}): differs in {', '.join(diffs)}"
    if engine.max_positions and m.num_tokens >= engine.max_positions:
        return f"{m.num_tokens} cached tokens do not fit the engine's {engine.max_positions} positions"
    if engine.vocab_size is not None and max(m.token_ids) >= engine.vocab_size:
        return f"token id {max(m.token_ids)} is outside the engine's vocabulary of {engine.vocab_size} ids (forged manifest?)"
    if m.base is not None:
        return "extends another cache (a chain made by prefill --after); the connector loads single caches"
    if m.quant is not None and not engine.allow_lossy:
        return (f"{m.storage} cache (lossy: answers would differ from the engine's own prefill); "
                "set \"allow_lossy\": true in kv_connector_extra_config to load it dequantized")
    if m.num_tokens < engine.block_size:
        return f"{m.num_tokens} cached tokens are less than one block of {engine.block_size}"
    if len(engine.layers) != len(m.layers):
        return f"{len(m.layers)} layers in the cache, the engine's paged cache has {len(engine.layers)}"
    for layer, (kind, window) in zip(m.layers, engine.layers):
        if layer.value_shape[3] != layer.key_shape[3]:
            return f"layer {layer.index} has value head dim {layer.value_shape[3]} != key head dim {layer.key_shape[3]}"
        if layer.kind == "sliding":
            if kind != "sliding" or window != layer.sliding_window:
                return (f"layer {layer.index} is sliding (window {layer.sliding_window}) in the cache, "
                        f"{kind} (window {window}) in the engine")
            if layer.cached_length != m.num_tokens:
                return (f"layer {layer.index} keeps only the last {layer.cached_length} of {m.num_tokens} tokens "
                        f"(sliding window {layer.sliding_window}); the engine's paged cache takes every token's keys, "
                        "so this cache cannot be loaded whole")
        elif kind != "full":
            return f"layer {layer.index} is full in the cache, {kind} (window {window}) in the engine"
    return None


@dataclass(frozen=True)
class Entry:
    """One indexed cache: where it is (folder or URL), its manifest, and its manifest's checksum."""

    location: str
    manifest: mf.Manifest
    manifest_sha256: str


def common_prefix(a: list[int], b: list[int], step: int = 256) -> int:
    """Length of the common prefix of two id lists (slices compared a step at a time, then one by one)."""
    n = min(len(a), len(b))
    i = 0
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CacheIndex:
    """Caches keyed by their first block of token ids; `match` returns the longest whole-block prefix."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._by_head: dict[tuple[int, ...], list[Entry]] = {}
        self.entries: list[Entry] = []

    def add(self, entry: Entry) -> None:
        ids = entry.manifest.token_ids
        if len(ids) < self.block_size:
            raise ValueError(f"{entry.location}: shorter than one block")
        self._by_head.setdefault(tuple(ids[: self.block_size]), []).append(entry)
        self.entries.append(entry)

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, prompt: list[int]) -> tuple[Entry, int] | None:
        """(cache, tokens to load) for the cache sharing the longest prefix with `prompt`, in whole blocks and
        at most len(prompt) - 1 tokens; None when no cache shares a whole block. Ties go to the first added."""
        b = self.block_size
        if len(prompt) <= b:
            return None
        best: tuple[Entry, int] | None = None
        for entry in self._by_head.get(tuple(prompt[:b]), ()):
            n = min(common_prefix(entry.manifest.token_ids, prompt), len(prompt) - 1) // b * b
            if n and (best is None or n > best[1]):
                best = (entry, n)
        return best


def discover(root: str) -> Iterator[tuple[str, mf.Manifest | None, str | None]]:
    """(location, manifest, error) for the cache at `root` or each cache directly under it.

    Local folders: `root` itself if it holds a manifest, else every subfolder that does (sorted), read with
    kvcli's own reader (format/store.py: bounded, no links, every shard present). URLs (any fsspec URL, as
    `kvcli ls`): the same one level down, manifests only. A manifest that fails validation comes with its
    error instead."""
    if remote.is_url(root):
        from ..remote import objects

        for url in objects.cache_urls(root):  # the URL as given (credentials included) to read it; print it with objects.redact
            try:
                yield url, objects.read_manifest(url), None
            except KvcliError as exc:
                yield url, None, str(exc)
        return
    base = Path(root)
    if not base.is_dir():
        raise KvcliError(f"{root}: no such folder")
    if (base / mf.MANIFEST_NAME).exists():
        candidates = [base]
    else:
        candidates = sorted(p for p in base.iterdir() if p.is_dir() and store.TMP_MARK not in p.name
                            and (p / mf.MANIFEST_NAME).exists())
    for path in candidates:
        try:
            yield str(path), store.read_manifest(path, shards=True), None  # a missing shard: refused by name
        except KvcliError as exc:
            yield str(path), None, str(exc)


def build_index(root: str, engine: EngineModel, log: Any = None) -> tuple[CacheIndex, dict[str, str]]:
    """Index every cache under `root` that fits `engine`; returns the index and {location: refusal reason}."""
    index, refused = CacheIndex(engine.block_size), {}
    for location, m, error in discover(root):
        reason = error if m is None else refusal(m, engine)
        if reason is None:
            index.add(Entry(location, m, m.to_json()["manifest_sha256"]))
        else:
            refused[location] = reason
            if log is not None:
                log(location, reason)
    return index, refused


def stats_writer(path: str | None):
    """A function that appends one JSON line per event to `path` (nothing when no path): the connector's counters."""
    lock = threading.Lock()

    def write(**record: Any) -> None:
        if not path:
            return
        line = json.dumps({"t": round(time.time(), 3), "pid": os.getpid(), **record}) + "\n"
        with lock, open(path, "a") as f:
            f.write(line)

    return write

