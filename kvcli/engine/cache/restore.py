"""Cache directory -> kvcli's cache object: shards read, verified and decoded straight into its buffers."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import layers, tiers, transfer
from .kvcache import GROW_STEP, FullLayer, KVCache, SlidingLayer
from ...errors import CacheCorruptError
from ...format.codec import DTYPES, decode_layer
from ...format.store import OpenedCache, usable_cores

QUESTION_TOKENS = GROW_STEP  # room for a question (its framing included) ...
ANSWER_TOKENS = 256  # ... plus an answer of the default --max-new-tokens (engine/decoding/request.py)
ROOM_TOKENS = QUESTION_TOKENS + ANSWER_TOKENS  # spare tokens after each full-attention layer's document: a question
# and a default-length answer append in place; a longer one grows the buffer once, to what it needs (engine/decoding/solo.py)


@dataclass
class RestoreStats:
    """Where a restore's time went, stage by stage (kvcli bench and tests/bench report the rates).

    read_s, hash_s and decode_s are summed over the threads that ran them (decode_s: decompressing and undoing
    byte planes, without the reads and hashing it triggered); copy_s is the device's own time for the copies
    (CUDA events; 0 on the CPU). wall_s is the whole load_cache call; on a device, copies may still run after it
    returns (each layer's compute waits for its own)."""

    layers: int = 0
    threads: int = 0
    bytes_stored: int = 0
    bytes_raw: int = 0
    wall_s: float = 0.0
    read_s: float = 0.0
    hash_s: float = 0.0
    decode_s: float = 0.0
    staging_wait_s: float = 0.0
    copy_queue_s: float = 0.0
    copy_s: float = 0.0
    device: str = "cpu"
    _link: Any = field(default=None, repr=False)

    def rates(self) -> dict[str, float | None]:
        """GB/s of each stage on all threads at once (a stage's bytes / its seconds per thread), and the whole."""
        def rate(nbytes: int, seconds: float, threads: int = 1) -> float | None:
            return nbytes / (seconds / max(1, threads)) / 1e9 if seconds > 0 else None

        if self._link is not None and not self.copy_s and hasattr(self._link, "copy_seconds"):
            self.copy_s = self._link.copy_seconds()
        return {"read_gb_s_stored": rate(self.bytes_stored, self.read_s, self.threads),
                "hash_gb_s_stored": rate(self.bytes_stored, self.hash_s, self.threads),
                "decompress_gb_s_raw": rate(self.bytes_raw, self.decode_s, self.threads),
                "copy_gb_s_raw": rate(self.bytes_raw, self.copy_s),
                "restore_gb_s_raw": rate(self.bytes_raw, self.wall_s)}


def load_cache(cache: OpenedCache, device: Any = "cpu", dtype: Any = None, threads: int | None = None,
               room: int | None = None, link: transfer.Link | None = None) -> KVCache:
    """Read, verify and decompress every shard in parallel threads into a KVCache on `device` in `dtype`.

    Each shard is streamed once, hashed as it is decompressed (full-attention layers get `room` spare tokens,
    default ROOM_TOKENS, after the document): peak memory is the restored cache plus a few MiB per thread
    (a small shard is decompressed whole, a large one in 1 MiB pieces). Layer kinds come from the manifest
    (fit.check_fits compares them with the model first).

    On the CPU each shard decodes straight into its layer's buffer. On a device (or with `link`, any
    transfer.Link) each shard decodes into a host staging buffer (pinned on CUDA), is copied to the device
    asynchronously, and its layer waits for its own copy only when a computation first reads it
    (KVCache's layers hold the wait): decoding, copying and the question's first layers overlap. Every shard is
    decoded and verified before this returns, so a damaged one is refused here, never mid-question. The cache's
    `restore_stats` (RestoreStats) says where the time went.
    """
    import torch

    t0 = time.perf_counter()
    m = cache.manifest
    links = cache.chain()  # one cache, or the links of a chain (`prefill --after`), the first first
    target = dtype or DTYPES[m.dtype]
    link = link if link is not None else transfer.link_for(device)
    device = link.device if link is not None else torch.device(device)
    extra = max(0, ROOM_TOKENS if room is None else room)
    workers = threads or default_threads(len(m.layers))
    stats = RestoreStats(layers=len(m.layers), threads=min(workers, len(m.layers)), device=str(device),
                         bytes_stored=sum(c.manifest.bytes_stored for c in links), _link=link)
    held = tiers.HOST.get(tiers.host_key(m, target, extra)) if link is not None and tiers.HOST.limit else None
    if held is not None:  # pushed out of device memory earlier: copied up from host memory
        kv = tiers.from_host(held, link, extra)
        stats.bytes_stored, stats.bytes_raw, stats.wall_s = 0, held.nbytes(), time.perf_counter() - t0
        kv.restore_stats = stats
        return kv

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

    built = [allocate(i) for i in range(len(m.layers))]
    events = _decode_all(cache, [(k, v) for _layer, k, v in built], link, workers, stats)
    for entry, (layer, keys, values), event in zip(m.layers, built, events):
        if entry.kind != "full":
            layer.restore(keys, values, entry.seq_length)
        if event is not None:
            layer.arriving(lambda event=event: link.wait(event))  # the layer's first reader waits for its copy
    if link is not None:
        stats.copy_queue_s = getattr(link, "copy_s", 0.0)
    stats.bytes_raw = _raw(m, DTYPES[m.dtype])
    kv = KVCache([layer for layer, _k, _v in built])
    stats.wall_s = time.perf_counter() - t0
    kv.restore_stats = stats
    return kv


def restore_into(cache: OpenedCache, outs: list, threads: int | None = None) -> RestoreStats:
    """Decode every layer of a one-link cache into `outs` (per layer a (keys, values) pair of views [1, kv_heads,
    tokens, head_dim], e.g. the free room of another cache's layers: nothing allocated, nothing copied after),
    verified before this returns; on a device, the copies are ordered before whatever next reads the views."""
    m = cache.manifest
    if len(outs) != len(m.layers) or m.base_tokens:
        raise ValueError(f"{cache.path}: {len(m.layers)} layers of one link, {len(outs)} destinations given")
    t0 = time.perf_counter()
    link = transfer.link_for(outs[0][0].device) if outs else None
    stats = RestoreStats(layers=len(m.layers), threads=min(threads or default_threads(len(m.layers)), len(m.layers)),
                         device=str(outs[0][0].device) if outs else "cpu", bytes_stored=m.bytes_stored, _link=link)
    for event in _decode_all(cache, outs, link, stats.threads, stats):
        if event is not None:
            link.wait(event)
    stats.bytes_raw = _raw(m, DTYPES[m.dtype])
    stats.wall_s = time.perf_counter() - t0
    return stats


def _decode_all(cache: OpenedCache, outs: list, link: Any, workers: int, stats: RestoreStats) -> list:
    """Every layer's shards (each link's, a chain's in order) decoded in `workers` threads into outs[i] (keys,
    values views holding the chain's whole span): straight in on the CPU in the stored dtype, else through a
    staging buffer (copied to the device asynchronously: the layer's event is returned) or a conversion."""
    import torch

    m = cache.manifest
    links = cache.chain()
    stored = DTYPES[m.dtype]
    direct = link is None and all(k.device.type == "cpu" and k.dtype == stored for k, _v in outs)
    lock = threading.Lock()
    staging = None
    if link is not None:
        item = torch.empty((), dtype=stored).element_size()
        largest = max(item * (math.prod(e.key_shape) + math.prod(e.value_shape)) for c in links for e in c.manifest.layers)
        staging = transfer.Staging(largest, stats.threads + 1, link.pinned, link.synchronize)

    def fill(i: int, link_cache: OpenedCache, keys, values) -> None:
        entry = link_cache.manifest.layers[i]
        start = link_cache.manifest.base_tokens if m.layers[i].kind == "full" else 0
        span = entry.key_shape[2]
        out = (keys[:, :, start : start + span], values[:, :, start : start + span])  # [1, kv_heads, span, head_dim]
        if direct:
            _decode_shard(link_cache, i, stored, out, stats, lock)
        elif staging is not None:  # into a staging buffer, then an asynchronous copy to the device
            buf = staging.take()
            event = None
            try:
                k, v = transfer.views(buf, stored, entry.key_shape, entry.value_shape)
                _decode_shard(link_cache, i, stored, (k, v), stats, lock)
                link.copy(out[0], k)
                link.copy(out[1], v)
                event = link.record()
            finally:
                staging.give(buf, event)  # reused only once the copies reading it completed
            return event
        else:  # another dtype on the CPU: decode, then convert into place
            k, v = _decode_shard(link_cache, i, stored, None, stats, lock)
            out[0].copy_(k)
            out[1].copy_(v)
        return None

    def one(i: int):  # a layer's links in one task: as many tasks as a single cache has
        event = None
        for link_cache in links if m.layers[i].kind == "full" else [cache]:
            event = fill(i, link_cache, *outs[i])
        return event

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            events = list(pool.map(one, range(len(m.layers))))
    finally:
        if staging is not None:
            stats.staging_wait_s = staging.wait_s
            transfer.release(staging)
    return events


def _raw(m, dtype) -> int:
    """Raw bytes of a chain's restored keys/values (every full layer's whole span, sliding layers' windows)."""
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    return sum(item * (math.prod(_whole(e.key_shape, m) if e.kind == "full" else e.key_shape)
                       + math.prod(_whole(e.value_shape, m) if e.kind == "full" else e.value_shape)) for e in m.layers)


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


def _decode_shard(cache: OpenedCache, i: int, stored: Any, out, stats: RestoreStats | None = None,
                  lock: threading.Lock | None = None):
    """Decode layer i (into `out` if given), hashing the shard as it streams into the decompressor.

    One pass over the stored bytes: each piece is hashed, then decompressed while still in the CPU cache. The
    layer is handed back only after the whole shard's size and hash have matched the manifest; if decoding
    fails first, the hash is still finished, so damaged or swapped bytes are reported as such (checksum
    mismatch, naming the file) rather than as whatever the decoder tripped over.
    """
    entry = cache.manifest.layers[i]
    stream = cache.stream_shard(i)  # size checked against the manifest before anything is read
    t0 = time.perf_counter()
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
    if stats is not None:
        with lock:
            stats.read_s += stream.read_s
            stats.hash_s += stream.hash_s
            stats.decode_s += time.perf_counter() - t0 - stream.read_s - stream.hash_s
    return result


def keep_on_host(session: Any) -> bool:
    """A warm Session leaving device memory: its restored document kept in the process's host tier (tiers.HOST,
    when it has a limit), so that the next restore of the same cache onto the device copies it back up instead of
    decoding its shards. False (nothing kept) on the CPU, for a blend, or when it does not fit the limit."""
    if getattr(session, "cache", None) is None:  # a sectioned cache: its sections restore on their own
        return False
    states = session.cache.states(wait=False)
    if not tiers.HOST.limit or session.blended is not None or not states or states[0].keys.device.type == "cpu":
        return False
    link = transfer.link_for(states[0].keys.device)
    pinned = link.pinned if link is not None else False
    return tiers.HOST.keep(tiers.host_key(session.manifest, session.lm.dtype, ROOM_TOKENS), session.cache, pinned)


def leaving(session: Any) -> None:
    """A warm server's cache leaving its LRU: keep_on_host, best effort."""
    try:
        keep_on_host(session)
    except RuntimeError:  # no pinned or device memory to be had: the cache is restored from disk next time
        pass
