"""Warm caches in two tiers (engine/cache/tiers.py), device then host memory, each under its own limit: least
recently used moved down first, a cache in use never moved, a host entry brought back up layer by layer equal
bit for bit to the cache that went down. On the CPU through the fake copy link of test_restore_pipeline."""

from __future__ import annotations

import pytest

from kvcli.documents import decode
from kvcli.engine.cache import restore, tiers
from kvcli.engine.prefilling import prefill
from kvcli.format import store
from tests.conftest import sample_text
from tests.fake_link import FakeLink, same_layers


@pytest.fixture(scope="module")
def caches(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiers")
    paths = []
    for i, cut in enumerate((700, 900, 1100)):
        path = folder / f"doc{i}.kv"
        prefill(tiny_lm, decode(sample_text()[:cut].encode(), f"doc{i}.txt"), path, chunk_size=64)
        paths.append(path)
    return paths


@pytest.fixture
def link():
    made = FakeLink(delay=0.001)
    yield made
    made.close()


def _restored(path, link):
    with store.open_cache(path) as opened:
        return restore.load_cache(opened, link=link, room=0)


def _reference(path):
    with store.open_cache(path) as opened:
        return restore.load_cache(opened, room=0).states()


def test_least_recently_used_moves_down_then_out(caches, link):
    kvs = [_restored(p, link) for p in caches]
    size = max(kv.nbytes() for kv in kvs)
    t = tiers.Tiers(device_limit=2 * size, host_limit=size, link=link)
    for i, kv in enumerate(kvs[:2]):
        t.put(i, kv, held=False)
    assert [r["caches"] for r in t.report()] == [2, 0]
    assert t.get(0) is kvs[0]  # 0 is now the most recently used
    t.release(0)
    t.put(2, kvs[2], held=False)  # over the device limit: 1, the least recently used, moves to the host
    assert list(t.tiers["device"]) == [0, 2] and list(t.tiers["host"]) == [1]
    assert t.moves == {"down": 1, "up": 0, "dropped": 0}
    assert same_layers(t.tiers["host"][1].value.states, _reference(caches[1]))
    back = t.get(1)  # up again, layer by layer; 0, now the least recently used, goes down
    assert same_layers(back.states(), _reference(caches[1]))
    assert t.moves["up"] == 1 and 1 in t.tiers["device"] and 0 in t.tiers["host"]
    report = {r["tier"]: r for r in t.report()}
    assert report["device"]["bytes"] <= report["device"]["limit"] and report["host"]["bytes"] <= report["host"]["limit"]


def test_a_cache_in_use_is_never_moved(caches, link):
    kvs = [_restored(p, link) for p in caches[:2]]
    t = tiers.Tiers(device_limit=1, host_limit=1 << 30, link=link)
    t.put("a", kvs[0])  # held: in use by the request that restored it
    t.put("b", kvs[1])
    assert set(t.tiers["device"]) == {"a", "b"}  # over the limit, but both in use
    t.release("a")
    assert list(t.tiers["device"]) == ["b"] and list(t.tiers["host"]) == ["a"]


def test_a_host_tier_too_small_drops_the_least_recently_used(caches, link):
    kvs = [_restored(p, link) for p in caches]
    t = tiers.Tiers(device_limit=1, host_limit=max(kv.nbytes() for kv in kvs), link=link)
    for i, kv in enumerate(kvs):
        t.put(i, kv, held=False)
    assert t.tiers["device"] == {} and list(t.tiers["host"]) == [2]
    assert t.moves == {"down": 3, "up": 0, "dropped": 2}
    assert t.get(0) is None


def test_without_a_device_one_host_tier(caches):
    with store.open_cache(caches[0]) as opened:
        kv = restore.load_cache(opened)
    t = tiers.Tiers(device_limit=None, host_limit=1 << 30)
    t.put("x", kv)
    assert t.get("x") is kv and [r["tier"] for r in t.report()] == ["host"]


def test_a_cache_kept_in_host_memory_is_restored_from_there(caches, link, monkeypatch):
    """A warm server keeps a cache pushed out of device memory in the host tier: the next restore of the same cache
    (same manifest, dtype and room) copies it up layer by layer, reading no shard; another cache misses."""
    host = tiers.HostTier(limit=1 << 30)
    monkeypatch.setattr(tiers, "HOST", host)
    first = _restored(caches[0], link)
    with store.open_cache(caches[0]) as opened:
        key = tiers.host_key(opened.manifest, first.layers[0].keys.dtype, 0)
    assert host.keep(key, first, pinned=False)
    again = _restored(caches[0], link)
    assert again.restore_stats.bytes_stored == 0 and host.hits == 1  # no shard read
    assert same_layers(again.states(), _reference(caches[0]))
    other = _restored(caches[1], link)
    assert other.restore_stats.bytes_stored > 0 and host.hits == 1
    assert host.report()["caches"] == 1
    small = tiers.HostTier(limit=1)
    assert not small.keep(key, first, pinned=False) and small.report()["caches"] == 0


def test_keep_on_host_keeps_nothing_from_the_cpu(caches, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(tiers, "HOST", tiers.HostTier(limit=1 << 30))
    with store.open_cache(caches[0]) as opened:
        kv = restore.load_cache(opened)
        session = SimpleNamespace(cache=kv, blended=None, manifest=opened.manifest, lm=SimpleNamespace(dtype=None))
    assert restore.keep_on_host(session) is False and tiers.HOST.report()["caches"] == 0


def test_the_warm_server_keeps_dropped_caches_in_the_host_tier_and_shows_it(monkeypatch):
    from kvcli.serve import warm as wm

    monkeypatch.setattr(tiers, "HOST", tiers.HostTier())
    kept = []
    monkeypatch.setattr(restore, "keep_on_host", lambda session: kept.append(session) or True)  # no GPU here
    w = wm.Warm(max_memory=1 << 30, host_memory=1 << 20)
    assert tiers.HOST.limit == 1 << 20
    assert w.status()["host_tier"] == {"tier": "host", "caches": 0, "bytes": 0, "limit": 1 << 20, "hits": 0,
                                       "kept": 0, "dropped": 0}
    session = object()
    w._entries["c"] = wm._Entry("c", "cache", session, 10, {})
    w._entries["m"] = wm._Entry("m", "model", object(), 10, {})
    assert w._drop("c") == 10 and kept == [session]  # a cache leaving the LRU goes to the host tier
    assert w._drop("m") == 10 and kept == [session]  # a model does not
    monkeypatch.setattr(tiers, "HOST", tiers.HostTier())  # no limit: no host tier, none shown
    assert "host_tier" not in wm.Warm(max_memory=1 << 30).status()
