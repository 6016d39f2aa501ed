"""Cache directory -> transformers cache object, after checking that it fits the loaded model."""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from . import layers

from ..format import manifest as mf
from ..format.codec import DTYPES, decode_layer
from ..errors import CacheMismatchError
from .framing import SUPPORTED_VERSIONS
from .models import LoadedModel
from ..format.store import OpenedCache

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
    if manifest.framing.get("version") not in SUPPORTED_VERSIONS:
        diffs.append("prompt framing version")
    if have.get("dtype") != want.get("dtype") and not convert_dtype:
        diffs.append(f"dtype (cache {want.get('dtype')}, model {have.get('dtype')}; --convert-dtype allows it)")
    limit = have.get("max_positions")
    if limit and manifest.num_tokens >= limit:
        diffs.append(f"length ({manifest.num_tokens} cached tokens, the model takes {limit} positions)")
    if diffs:
        name = want.get("source", {}).get("name", want.get("name"))
        raise CacheMismatchError(f"{where}: built for another model ({name}): differs in {', '.join(diffs)}")
    _check_token_ids(manifest, lm, where)
    plan = layers.plan(lm.model.config)
    for layer, (kind, window) in zip(manifest.layers, plan):
        if (layer.kind, layer.sliding_window) != (kind, window):
            raise CacheMismatchError(
                f"{where}: layer {layer.index} is {layer.kind} (window {layer.sliding_window}) in the cache, "
                f"{kind} (window {window}) in the model"
            )


def vocab_limit(lm: LoadedModel) -> int | None:
    """How many token ids the model and its tokenizer can produce: the smaller of the tokenizer's size and
    the embedding's rows (an embedding padded past the tokenizer has rows no tokenizer output selects)."""
    sizes = []
    try:
        sizes.append(len(lm.tokenizer))
    except TypeError:
        pass
    embed = lm.model.get_input_embeddings() if hasattr(lm.model, "get_input_embeddings") else None
    rows = getattr(embed, "num_embeddings", None)
    if isinstance(rows, int):
        sizes.append(rows)
    return min(sizes) if sizes else None


def _check_token_ids(manifest: mf.Manifest, lm: LoadedModel, where: str) -> None:
    """Refuse cached ids the tokenizer cannot have produced (a forged manifest): an id past the embedding
    would crash the recompute of --check, and one in padded rows would answer from a prompt no text gives."""
    limit = vocab_limit(lm)
    if limit is None or max(manifest.token_ids) < limit:
        return
    for i, t in enumerate(manifest.token_ids):
        if t >= limit:
            raise CacheMismatchError(
                f"{where}: token id {t} at position {i} is outside the model's vocabulary of {limit} ids "
                "(no tokenizer output; the manifest was forged or built for another model)"
            )


ROOM_TOKENS = 256  # spare tokens after each full-attention layer's keys/values: questions append in place


def load_states(
    cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None, room: int | None = None
) -> list[layers.LayerState]:
    """Read, verify and decompress every shard in parallel threads; tensors land on `device` in `dtype`.

    Each shard is read once, in chunks that are hashed and decompressed while still in cache, straight
    into the layer's final tensors: peak memory is the restored cache plus a few small buffers per
    thread. Full-attention layers get `room` (default ROOM_TOKENS) spare tokens after each head's block
    (their tensors are views of larger buffers), so new_cache() can append a question without copying.
    """
    import torch

    m = cache.manifest
    stored = DTYPES[m.dtype]
    target = dtype or stored
    direct = torch.device(device).type == "cpu" and target == stored

    def one(i: int) -> layers.LayerState:
        entry = m.layers[i]
        extra = max(0, ROOM_TOKENS if room is None else room) if entry.kind == "full" else 0
        keys = _roomy_empty(entry.key_shape, extra, target, device)
        values = _roomy_empty(entry.value_shape, extra, target, device)
        if extra:
            keys._kvcli_room_owner = None  # new_cache may lend the room after these tokens to one cache at a time
        if direct:
            _decode_shard(cache, i, stored, (keys, values))
        else:  # another dtype or device: decode on the CPU, then convert into place
            k, v = _decode_shard(cache, i, stored, None)
            keys.copy_(k)
            values.copy_(v)
        return layers.LayerState(entry.kind, keys, values, entry.seq_length, entry.sliding_window)

    workers = threads or min(len(m.layers), max(2, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, range(len(m.layers))))


def _roomy_empty(shape: tuple[int, ...], extra: int, dtype: Any, device: Any):
    """An uninitialised [batch, heads, seq, dim] tensor, as a view of a buffer with `extra` spare tokens."""
    import torch

    b, h, n, d = shape
    if not extra:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty((b, h, n + extra, d), dtype=dtype, device=device)[:, :, :n]


def _decode_shard(cache: OpenedCache, i: int, stored: Any, out):
    """Decode layer i (into `out` if given) after checking the shard's size and sha256.

    The shard is read in one call and hashed before a single byte reaches the decompressor, so damaged
    or swapped bytes are reported as such and never decoded.
    """
    entry = cache.manifest.layers[i]
    data = cache.read_shard(i)  # size and sha256 checked against the manifest
    return decode_layer(
        data,
        name=str(cache.path / entry.file),
        transform=cache.manifest.transform,
        dtype=stored,
        key_shape=entry.key_shape,
        value_shape=entry.value_shape,
        decoded_bytes=entry.decoded_bytes,
        out=out,
    )


# ---------------------------------------------------------------- cache objects with room to grow

_claim_lock = threading.Lock()


def new_cache(lm: LoadedModel, states: list[layers.LayerState]):
    """A fresh DynamicCache for the model holding the given states (cheap: no tensor is copied).

    Full-attention layers whose saved tensors have spare room (see load_states) append new tokens in
    place instead of concatenating a copy of the whole cache at every forward pass. The saved tokens are
    never written; the room after them is lent to one live cache at a time (a cache built while another
    still holds the room concatenates as transformers does, so sharing states stays safe, just slower).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=lm.model.config)
    layers.fill(cache, states)
    owner = weakref.ref(cache)
    with _claim_lock:
        for layer, state in zip(cache.layers, states):
            if type(layer) is not DynamicLayer or not hasattr(state.keys, "_kvcli_room_owner"):
                continue  # only load_states' buffers: other tensors' spare memory may belong to a live cache
            if not (_room(state.keys) and _room(state.values)):
                continue
            held = state.keys._kvcli_room_owner
            if held is not None and held() is not None:
                continue
            state.keys._kvcli_room_owner = owner
            layer.__class__ = roomy_layer_class()
    return cache


def _room(t) -> int:
    """How many more tokens a [1, heads, seq, dim] view can take in place (0 if none or not such a view)."""
    if t.dim() != 4 or t.shape[0] != 1 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        return 0
    heads, n, dim = t.shape[1], t.shape[2], t.shape[3]
    end = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()  # elements from the view's start
    per_head = t.stride(1) // dim if heads > 1 else end // dim
    last = (end - (heads - 1) * t.stride(1)) // dim if dim else 0  # the last head's block can use the storage's end
    return max(0, min(per_head, last) - n)


def _append(old, new):
    """old extended by new along the sequence, written in place after old's tokens; None without room."""
    if new.dtype != old.dtype or new.device != old.device or new.shape[:2] != old.shape[:2] or new.shape[3] != old.shape[3]:
        return None
    n, q = old.shape[2], new.shape[2]
    if _room(old) < q:
        return None
    view = old.as_strided((old.shape[0], old.shape[1], n + q, old.shape[3]), old.stride(), old.storage_offset())
    view[:, :, n:].copy_(new)
    return view


def _grow(old, new):
    """Concatenate into a private buffer with room for more tokens (what DynamicLayer does, plus room)."""
    import torch

    b, h, n, d = old.shape
    q = new.shape[2]
    buf = torch.empty((b, h, n + q + max(ROOM_TOKENS, (n + q) // 4), d), dtype=torch.promote_types(old.dtype, new.dtype), device=old.device)
    buf[:, :, :n].copy_(old)
    buf[:, :, n : n + q].copy_(new)
    return buf[:, :, : n + q]


_ROOMY: list = []


def roomy_layer_class():
    """RoomyLayer, defined on first use (importing transformers at import time would slow every command)."""
    if _ROOMY:
        return _ROOMY[0]
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A full-attention DynamicLayer that appends into spare room after its tokens instead of
        concatenating: the same keys/values (as views) for the attention, without copying the cache.

        `reserve` (tokens) sizes the buffer allocated at the first update (prefill of a known length)."""

        reserve = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.device = key_states.device
                self.keys = _empty_like(key_states, self.reserve)
                self.values = _empty_like(value_states, self.reserve)
                self.is_initialized = True
            keys, values = _append(self.keys, key_states), _append(self.values, value_states)
            if keys is None or values is None:
                keys, values = _grow(self.keys, key_states), _grow(self.values, value_states)
            self.keys, self.values = keys, values
            return keys, values

    _ROOMY.append(RoomyLayer)
    return RoomyLayer


def _empty_like(states, tokens: int):
    """A [batch, heads, 0, dim] view of a fresh buffer with room for `tokens` tokens."""
    import torch

    b, h, q, d = states.shape
    return torch.empty((b, h, max(tokens, q), d), dtype=states.dtype, device=states.device)[:, :, :0]


def roomy(cache, reserve: int = 0):
    """Make every plain full-attention layer of a fresh DynamicCache append in place (see RoomyLayer)."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layer.__class__ = roomy_layer_class()
            layer.reserve = reserve
    return cache


# ---------------------------------------------------------------- attention without repeating keys

_gqa_lock = threading.Lock()
_gqa_users = 0
_gqa_saved: str | None = None
_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextmanager
def fast_attention(lm: LoadedModel):
    """While active, CPU sdpa attention with a mask (a question after a cached document, a prefill chunk)
    runs grouped-query attention natively instead of first copying every key/value head n_rep times.

    transformers only does that without a mask unless TRANSFORMERS_SDPA_FORCE_GQA=1; on CPU, torch's
    kernel gives bit-identical results either way (tests compare answers with recompute). Elsewhere
    (CUDA may fall back to a slower kernel) this does nothing.
    """
    global _gqa_users, _gqa_saved
    import torch

    if torch.device(lm.device).type != "cpu":
        yield
        return
    with _gqa_lock:
        if _gqa_users == 0:
            _gqa_saved = os.environ.get(_GQA_ENV)
            os.environ[_GQA_ENV] = "1"
        _gqa_users += 1
    try:
        yield
    finally:
        with _gqa_lock:
            _gqa_users -= 1
            if _gqa_users == 0:
                if _gqa_saved is None:
                    os.environ.pop(_GQA_ENV, None)
                else:
                    os.environ[_GQA_ENV] = _gqa_saved
