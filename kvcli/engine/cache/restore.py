"""Cache directory -> kvcli's cache object: shards read, verified and decoded straight into its buffers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import layers
from .kvcache import GROW_STEP, FullLayer, KVCache, SlidingLayer
from ...errors import CacheCorruptError
from ...format.codec import DTYPES, decode_layer
from ...format.store import OpenedCache, usable_cores

QUESTION_TOKENS = GROW_STEP  # room for a question (its framing included) ...
ANSWER_TOKENS = 256  # ... plus an answer of the default --max-new-tokens (engine/decoding/request.py)
ROOM_TOKENS = QUESTION_TOKENS + ANSWER_TOKENS  # spare tokens after each full-attention layer's document: a question
# and a default-length answer append in place; a longer one grows the buffer once, to what it needs (engine/decoding/solo.py)


def load_cache(cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None,
               room: int | None = None) -> KVCache:
    """Read, verify and decompress every shard in parallel threads into a KVCache on `device` in `dtype`.

    Each shard is streamed once, hashed as it is decompressed straight into its layer's buffer
    (full-attention layers get `room` spare tokens, default ROOM_TOKENS, after the document): peak memory
    is the restored cache plus a few 1 MiB buffers per thread. Layer kinds come from the manifest (fit.check_fits compares them
    with the model first).
    """
    import torch

    m = cache.manifest
    links = cache.chain()  # one cache, or the links of a chain (`prefill --after`), the first first
    stored = DTYPES[m.dtype]
    target = dtype or stored
    direct = torch.device(device).type == "cpu" and target == stored
    extra = max(0, ROOM_TOKENS if room is None else room)

    def allocate(i: int):
        entry = m.layers[i]
        if entry.kind == "full":  # the whole chain's tokens: each link fills its own span
            layer = FullLayer()
            keys, values = layer.allocate(_whole(entry.key_shape, m), _whole(entry.value_shape, m), target, device, extra)
        else:  # a sliding window holds the chain's last tokens: the top link's shard alone
            layer = SlidingLayer(entry.sliding_window)
            keys = torch.empty(entry.key_shape, dtype=target, device=device)
            values = torch.empty(entry.value_shape, dtype=target, device=device)
        return layer, keys, values

    def fill(i: int, link, keys, values) -> None:
        start = link.manifest.base_tokens if m.layers[i].kind == "full" else 0
        span = link.manifest.layers[i].key_shape[2]
        out = (keys[:, :, start : start + span], values[:, :, start : start + span])  # [1, kv_heads, span, head_dim]
        if direct:
            _decode_shard(link, i, stored, out)
        else:  # another dtype or device: decode on the CPU, then convert into place
            k, v = _decode_shard(link, i, stored, None)
            out[0].copy_(k)
            out[1].copy_(v)

    def one(i: int) -> None:  # a layer's links in one task: as many tasks as a single cache has
        for link in links if m.layers[i].kind == "full" else [cache]:
            fill(i, link, *built[i][1:])

    built = [allocate(i) for i in range(len(m.layers))]
    with ThreadPoolExecutor(max_workers=threads or default_threads(len(m.layers))) as pool:
        list(pool.map(one, range(len(m.layers))))
    for entry, (layer, keys, values) in zip(m.layers, built):
        if entry.kind != "full":
            layer.restore(keys, values, entry.seq_length)
    return KVCache([layer for layer, _k, _v in built])


def _whole(shape: tuple[int, ...], m) -> tuple[int, ...]:
    """A full layer's shape over the whole chain: [1, kv_heads, base tokens + this link's, head_dim]."""
    return (*shape[:2], m.num_tokens, shape[3])


def default_threads(layers: int) -> int:
    """Restore threads: one per core this process may use (at least 2, so one decodes while another waits on a
    read or the GIL), never more than there are layers."""
    return max(1, min(layers, max(2, usable_cores())))


def load_states(cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None,
                room: int | None = None) -> list[layers.LayerState]:
    """The restored state of every layer (views into the buffers of load_cache's cache)."""
    return load_cache(cache, device=device, dtype=dtype, threads=threads, room=room).states()


def _decode_shard(cache: OpenedCache, i: int, stored: Any, out):
    """Decode layer i (into `out` if given), hashing the shard as it streams into the decompressor.

    One pass over the stored bytes: each piece is hashed, then decompressed while still in the CPU cache. The
    layer is handed back only after the whole shard's size and hash have matched the manifest; if decoding
    fails first, the hash is still finished, so damaged or swapped bytes are reported as such (checksum
    mismatch, naming the file) rather than as whatever the decoder tripped over.
    """
    entry = cache.manifest.layers[i]
    stream = cache.stream_shard(i)  # size checked against the manifest before anything is read
    try:
        result = decode_layer(
            stream,
            name=str(cache.path / entry.file),
            transform=cache.manifest.transform,
            dtype=stored,
            key_shape=entry.key_shape,
            value_shape=entry.value_shape,
            decoded_bytes=entry.decoded_bytes,
            out=out,
            quant=cache.manifest.quant,  # 8-/4-bit caches are dequantized straight into `out`
        )
    except CacheCorruptError:
        stream.verify()  # a damaged shard is reported by its checksum
        raise
    stream.verify()  # before the layer is used
    return result
