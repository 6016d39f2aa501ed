"""Cache directory -> kvcli's cache object: shards read, verified and decoded straight into its buffers."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import layers
from .kvcache import GROW_STEP, FullLayer, KVCache, SlidingLayer
from ...format.codec import DTYPES, decode_layer
from ...format.store import OpenedCache

QUESTION_TOKENS = GROW_STEP  # room for a question (its framing included) ...
ANSWER_TOKENS = 256  # ... plus an answer of the default --max-new-tokens (engine/decoding/request.py)
ROOM_TOKENS = QUESTION_TOKENS + ANSWER_TOKENS  # spare tokens after each full-attention layer's document: a question
# and a default-length answer append in place; a longer one grows the buffer once, to what it needs (solo.py)


def load_cache(cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None,
               room: int | None = None) -> KVCache:
    """Read, verify and decompress every shard in parallel threads into a KVCache on `device` in `dtype`.

    Each shard is read once and decompressed straight into its layer's buffer (full-attention layers get
    `room` spare tokens, default ROOM_TOKENS, after the document): peak memory is the restored cache plus
    a few small buffers per thread. Layer kinds come from the manifest (fit.check_fits compares them
    with the model first).
    """
    import torch

    m = cache.manifest
    stored = DTYPES[m.dtype]
    target = dtype or stored
    direct = torch.device(device).type == "cpu" and target == stored
    extra = max(0, ROOM_TOKENS if room is None else room)

    def one(i: int):
        entry = m.layers[i]
        if entry.kind == "full":
            layer = FullLayer()
            keys, values = layer.allocate(entry.key_shape, entry.value_shape, target, device, extra)
        else:
            layer = SlidingLayer(entry.sliding_window)
            keys = torch.empty(entry.key_shape, dtype=target, device=device)
            values = torch.empty(entry.value_shape, dtype=target, device=device)
        if direct:
            _decode_shard(cache, i, stored, (keys, values))
        else:  # another dtype or device: decode on the CPU, then convert into place
            k, v = _decode_shard(cache, i, stored, None)
            keys.copy_(k)
            values.copy_(v)
        if entry.kind != "full":
            layer.restore(keys, values, entry.seq_length)
        return layer

    workers = threads or min(len(m.layers), max(2, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return KVCache(list(pool.map(one, range(len(m.layers)))))


def load_states(cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None,
                room: int | None = None) -> list[layers.LayerState]:
    """The restored state of every layer (views into the buffers of load_cache's cache)."""
    return load_cache(cache, device=device, dtype=dtype, threads=threads, room=room).states()


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
        quant=cache.manifest.quant,  # 8-/4-bit caches are dequantized straight into `out`
    )
