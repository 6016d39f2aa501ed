"""Restored caches kept warm in two tiers: device memory, then (pinned) host memory, each under its own limit.

A warm server keeps the caches it restored so that a second question on the same document pays no restore.
On a GPU the first tier is device memory; a cache pushed out of it (least recently used first) moves to the host
tier as a host copy (pinned, so that it goes back up at the copy engine's speed, layer by layer like a restore
from disk: engine/cache/transfer.py), and one pushed out of the host tier is dropped (the next question restores
it from disk). Without a device there is one tier, host memory. Nothing here reads files or knows about models:
the caller gives each entry a key and says when it is in use (`held`: a cache answering questions is never moved).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from . import layers as ly, transfer
from .kvcache import FullLayer, KVCache, SlidingLayer


@dataclass
class HostCopy:
    """A cache's document state in host memory: per layer (kind, keys, values, counted length, window)."""

    states: list[ly.LayerState]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.states for t in (s.keys, s.values))


def to_host(cache: KVCache, pinned: bool) -> HostCopy:
    """The document's keys/values copied to host memory (pinned where asked), the copies complete on return."""
    out = []
    for s in cache.states():
        k = torch.empty(s.keys.shape, dtype=s.keys.dtype, pin_memory=pinned)
        v = torch.empty(s.values.shape, dtype=s.values.dtype, pin_memory=pinned)
        k.copy_(s.keys)
        v.copy_(s.values)
        out.append(ly.LayerState(s.kind, k, v, s.seq_length, s.sliding_window))
    return HostCopy(out)


def from_host(copy: HostCopy, link: transfer.Link | None, room: int) -> KVCache:
    """A cache on link's device from a copy: every layer's copy queued on the link at once, each layer waiting for
    its own (as a restore from disk does); without a link, copied in place where the copy's tensors are. `room`
    spare tokens after full-attention layers' documents."""
    built = []
    device = link.device if link is not None else copy.states[0].keys.device
    for s in copy.states:
        if s.kind == "full":
            layer = FullLayer()
            k, v = layer.allocate(tuple(s.keys.shape), tuple(s.values.shape), s.keys.dtype, device, room)
        else:
            layer = SlidingLayer(s.sliding_window)
            k = torch.empty(s.keys.shape, dtype=s.keys.dtype, device=device)
            v = torch.empty(s.values.shape, dtype=s.values.dtype, device=device)
        if link is None:
            k.copy_(s.keys)
            v.copy_(s.values)
        else:
            link.copy(k, s.keys)
            link.copy(v, s.values)
            event = link.record()
            layer.arriving(lambda event=event: link.wait(event))
        if s.kind != "full":
            layer.restore(k, v, s.seq_length)
        built.append(layer)
    return KVCache(built)


@dataclass
class Entry:
    key: Any
    value: Any  # a KVCache (device tier) or a HostCopy (host tier)
    nbytes: int
    held: int = 0  # requests using it: never moved or dropped while > 0


class Tiers:
    """Least-recently-used caches in device memory, then host memory, each under `limits` bytes.

    put(key, cache) after a restore; get(key) for the next question (a host entry goes back up first);
    release(key) when a question is done with it. `link` is None without a device (one tier: host)."""

    def __init__(self, device_limit: int | None, host_limit: int, link: transfer.Link | None = None, room: int = 0):
        self.link, self.room = link, room
        self.limits = {"device": device_limit or 0, "host": host_limit} if link is not None else {"host": host_limit}
        self.tiers: dict[str, OrderedDict[Any, Entry]] = {name: OrderedDict() for name in self.limits}
        self._lock = threading.RLock()
        self.moves = {"down": 0, "up": 0, "dropped": 0}

    @property
    def top(self) -> str:
        return "device" if self.link is not None else "host"

    def put(self, key: Any, cache: KVCache, *, held: bool = True) -> None:
        with self._lock:
            self._remove(key)
            self.tiers[self.top][key] = Entry(key, cache, cache.nbytes(), int(held))
            self._fit()

    def get(self, key: Any) -> KVCache | None:
        """The cache for `key` in the top tier, marked in use (moved up from the host tier first), or None."""
        with self._lock:
            top = self.tiers[self.top]
            if key in top:
                top.move_to_end(key)
                top[key].held += 1
                return top[key].value
            host = self.tiers["host"]
            if self.link is None or key not in host:
                return None
            entry = host.pop(key)
            cache = from_host(entry.value, self.link, self.room)
            self.moves["up"] += 1
            top[key] = Entry(key, cache, cache.nbytes(), 1)
            self._fit()
            return cache

    def release(self, key: Any) -> None:
        with self._lock:
            for tier in self.tiers.values():
                if key in tier:
                    tier[key].held = max(0, tier[key].held - 1)
            self._fit()

    def drop(self, key: Any) -> None:
        with self._lock:
            self._remove(key)

    def _remove(self, key: Any) -> None:
        for tier in self.tiers.values():
            tier.pop(key, None)

    def _fit(self) -> None:
        """Move least recently used entries not in use down a tier (device -> host), or out, until each fits."""
        if self.link is not None:
            for entry in self._over("device"):
                del self.tiers["device"][entry.key]
                copy = to_host(entry.value, self.link.pinned)
                self.tiers["host"][entry.key] = Entry(entry.key, copy, copy.nbytes())
                self.moves["down"] += 1
        for entry in self._over("host"):
            del self.tiers["host"][entry.key]
            self.moves["dropped"] += 1

    def _over(self, name: str) -> list[Entry]:
        tier, limit = self.tiers[name], self.limits[name]
        total = sum(e.nbytes for e in tier.values())
        out = []
        for entry in list(tier.values()):  # least recently used first
            if total <= limit:
                break
            if entry.held == 0:
                out.append(entry)
                total -= entry.nbytes
        return out

    def report(self) -> list[dict[str, Any]]:
        """Per tier: its name, entries, bytes held and limit (what `kvcli ps` shows)."""
        with self._lock:
            return [{"tier": name, "caches": len(tier), "bytes": sum(e.nbytes for e in tier.values()),
                     "limit": self.limits[name]} for name, tier in self.tiers.items()]


class HostTier:
    """Caches pushed out of device memory, kept as host copies (pinned) under `limit` bytes, least recently used
    out first, keyed by what decides their bytes (host_key): a restore onto the device that finds its cache here
    copies it up layer by layer instead of reading and decoding its shards (restore.load_cache). limit 0: none kept."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self._copies: OrderedDict[Any, HostCopy] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.kept = self.dropped = 0

    def keep(self, key: Any, cache: KVCache, pinned: bool = True) -> bool:
        """Copy a device cache's document down (blocking until copied); False when it cannot fit the limit."""
        nbytes = sum(t.numel() * t.element_size() for s in cache.states() for t in (s.keys, s.values))
        if nbytes > self.limit:
            return False
        copy = to_host(cache, pinned)
        with self._lock:
            self._copies.pop(key, None)
            self._copies[key] = copy
            self.kept += 1
            while sum(c.nbytes() for c in self._copies.values()) > self.limit:
                self._copies.popitem(last=False)
                self.dropped += 1
        return True

    def get(self, key: Any) -> HostCopy | None:
        with self._lock:
            copy = self._copies.get(key)
            if copy is not None:
                self._copies.move_to_end(key)
                self.hits += 1
            return copy

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()

    def report(self) -> dict[str, Any]:
        """What `kvcli ps` shows for this tier."""
        with self._lock:
            return {"tier": "host", "caches": len(self._copies), "bytes": sum(c.nbytes() for c in self._copies.values()),
                    "limit": self.limit, "hits": self.hits, "kept": self.kept, "dropped": self.dropped}


HOST = HostTier()  # the process's host tier (a warm server sets its limit: --max-host-memory)


def host_key(manifest: Any, dtype: Any, room: int) -> tuple:
    """What decides a restored cache's bytes: the manifest's own digest (its shards' digests and any base's in it),
    the dtype restored to and the spare room."""
    return (manifest.digest, str(dtype), room)
