"""The vLLM connector's engine-free half (kvcli/integrations/caches.py): runs in kvcli's own venv, without vLLM.
Indexing caches by their prompt ids, prefix matching in whole blocks, refusal reasons. The paged layout is vLLM's
(the connector writes through each attention layer's own kv-cache update): tests/integrations/test_vllm.py checks it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from kvcli.format import manifest as mf
from kvcli.integrations import caches

H = hashlib.sha256(b"x").hexdigest()
BLOCK = 4


def _hash(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


def make_manifest(ids, *, layers=("full", "full"), windows=(None, None), dtype="float32", model_type="llama",
                  heads=1, head_dim=4, weights="w", kind="chat", template="t", quant=None, value_dim=None,
                  arithmetic=None) -> mf.Manifest:
    entries = []
    n = len(ids)
    for i, (k, w) in enumerate(zip(layers, windows)):
        cached = n if k == "full" else min(n, w - 1)
        ks, vs = (1, heads, cached, head_dim), (1, heads, cached, value_dim or head_dim)
        raw = mf.DTYPE_SIZES[dtype] * (ks[0] * ks[1] * ks[2] * ks[3] + vs[0] * vs[1] * vs[2] * vs[3])
        entries.append(mf.LayerEntry(index=i, kind=k, cached_length=cached, seq_length=n, sliding_window=w,
                                     file=mf.shard_name(i), key_shape=ks, value_shape=vs, raw_bytes=raw,
                                     decoded_bytes=raw + 200, stored_bytes=100, digest=H))
    compression = {"codec": "zstd", "level": 3, "transform": "none" if quant else "byteplane"}
    if quant:
        compression["quant"] = quant
    m = mf.Manifest(
        format_version=2 if quant else 1, kvcli_version="0.1.0", transformers_version="5.24.0",
        created="2026-12-01T00:00:00+00:00",
        model={"source": {"kind": "hub", "id": "tiny", "name": "tiny"}, "name": "tiny", "model_type": model_type,
               "config_sha256": _hash("c"), "weights_sha256": _hash(weights), "tokenizer_sha256": _hash("tok"),
               "chat_template_sha256": _hash(template), "dtype": dtype, "num_layers": len(layers), "num_kv_heads": heads,
               "head_dim": head_dim, "max_positions": 1024, **({"weights": arithmetic} if arithmetic else {})},
        framing={"kind": kind, "system": None, "version": 1, "template_sha256": _hash(template) if kind == "chat" else None},
        document={"name": "d", "sha256": H, "chars": 10}, token_ids=list(ids), compression=compression, layers=entries)
    if quant is None:  # round trip: everything the index sees went through kvcli's own validation
        return mf.parse(m.dumps(), "test")
    return m


def engine(**over) -> caches.EngineModel:
    base = dict(model_type="llama", num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", block_size=BLOCK,
                layers=(("full", None), ("full", None)), max_positions=1024, vocab_size=1000,
                hashes={"config_sha256": _hash("c"), "weights_sha256": _hash("w"), "tokenizer_sha256": _hash("tok"),
                        "chat_template_sha256": _hash("t")})
    base.update(over)
    return caches.EngineModel(**base)


def test_a_fitting_cache_has_no_refusal():
    assert caches.refusal(make_manifest(range(10)), engine()) is None


@pytest.mark.parametrize("manifest_kw, engine_kw, needle", [
    ({"weights": "other"}, {}, "differs in weights"),
    ({"model_type": "qwen2"}, {}, "model type"),
    ({"heads": 2}, {}, "key/value heads"),
    ({"dtype": "bfloat16"}, {}, "dtype (cache bfloat16, engine float32)"),
    ({"template": "other"}, {}, "chat template"),
    ({"arithmetic": "q4"}, {}, "computed on kvcli's q4 weights"),
    ({}, {"hashes": {"config_sha256": _hash("c"), "weights_sha256": None, "tokenizer_sha256": _hash("tok"),
                     "chat_template_sha256": _hash("t")}}, "weights (the engine's could not be computed)"),
    ({}, {"hashes": {"config_sha256": _hash("c"), "weights_sha256": _hash("w"), "tokenizer_sha256": _hash("other"),
                     "chat_template_sha256": _hash("t")}}, "tokenizer"),
    ({}, {"max_positions": 8}, "do not fit the engine's 8 positions"),
    ({}, {"vocab_size": 5}, "outside the engine's vocabulary"),
    ({}, {"block_size": 16}, "less than one block of 16"),
    ({"value_dim": 8}, {}, "value head dim 8"),
    ({"layers": ("full", "sliding"), "windows": (None, 4)}, {"layers": (("full", None), ("sliding", 4))},
     "keeps only the last 3 of 10 tokens"),
    ({"layers": ("full", "sliding"), "windows": (None, 64)}, {}, "layer 1 is sliding (window 64) in the cache, full"),
    ({}, {"layers": (("full", None), ("sliding", 64))}, "layer 1 is full in the cache, sliding (window 64) in the engine"),
])
def test_refusal_reasons(manifest_kw, engine_kw, needle):
    reason = caches.refusal(make_manifest(range(10), **manifest_kw), engine(**engine_kw))
    assert reason is not None and needle in reason, reason


def test_a_sliding_layer_holding_every_token_fits_a_sliding_engine_layer():
    m = make_manifest(range(10), layers=("full", "sliding"), windows=(None, 64))
    assert caches.refusal(m, engine(layers=(("full", None), ("sliding", 64)))) is None


def test_unchecked_fields_are_an_explicit_choice():
    e = engine(hashes={"config_sha256": _hash("c"), "weights_sha256": None, "tokenizer_sha256": _hash("tok"),
                       "chat_template_sha256": _hash("t")}, unchecked=frozenset({"weights_sha256"}))
    assert caches.refusal(make_manifest(range(10)), e) is None


def test_lossy_caches_are_refused_unless_allowed():
    quant = {"bits": 8, "group_size": 32, "exact_tokens": 4, "scale_dtype": "float16", "keys": "per_channel",
             "values": "per_token"}
    m = make_manifest(range(10), quant=quant)
    assert "8-bit cache (lossy" in caches.refusal(m, engine())
    assert caches.refusal(m, engine(allow_lossy=True)) is None


def _entry(name, ids):
    m = make_manifest(ids)
    return caches.Entry(name, m, m.to_json()["manifest_sha256"])


def test_match_whole_blocks_never_the_whole_prompt():
    doc = list(range(100, 110))  # 10 ids: 2 whole blocks of 4
    index = caches.CacheIndex(BLOCK)
    index.add(_entry("a", doc))
    assert index.match(doc + [1, 2, 3])[1] == 8  # 10 shared -> 8 (whole blocks)
    assert index.match(doc[:8] + [1])[1] == 8  # the cache longer than the prompt: its first 8 still serve
    assert index.match(doc[:8])[1] == 4  # never the entire prompt: at least one token left to compute
    assert index.match(doc[:4]) is None  # only one block, which is the whole prompt
    assert index.match(doc[:3] + [0] + doc[4:]) is None  # differs inside the first block
    assert index.match(doc[:6] + [0, 0, 0, 0])[1] == 4  # diverges inside block 2: block 1 only
    assert index.match([7] + doc) is None


def test_match_picks_the_longest_prefix_among_caches_sharing_a_head():
    head = [1, 2, 3, 4]
    index = caches.CacheIndex(BLOCK)
    index.add(_entry("short", head + [5, 6, 7, 8]))
    index.add(_entry("long", head + [5, 6, 7, 8, 9, 10, 11, 12, 13]))
    index.add(_entry("other", head + [0, 0, 0, 0, 0]))
    entry, n = index.match(head + [5, 6, 7, 8, 9, 10, 11, 12, 99])
    assert (entry.location, n) == ("long", 12)
    entry, n = index.match(head + [0, 0, 0, 0, 1])
    assert (entry.location, n) == ("other", 8)
    entry, n = index.match(head + [5, 6, 7, 8, 1])
    assert (entry.location, n) == ("short", 8)  # tie on 8 tokens: the first added


def test_common_prefix_matches_a_plain_loop():
    a = list(range(1000))
    for cut in (0, 1, 255, 256, 257, 999):
        b = a[:cut] + [-1] + a[cut + 1:]
        assert caches.common_prefix(a, b) == cut
    assert caches.common_prefix(a, a[:600]) == 600


def _write_cache(folder: Path, m: mf.Manifest) -> None:
    folder.mkdir(parents=True)
    (folder / mf.MANIFEST_NAME).write_bytes(m.dumps())
    for layer in m.layers:
        (folder / layer.file).write_bytes(b"\0" * layer.stored_bytes)


def test_build_index_reads_manifests_and_names_each_refusal(tmp_path):
    _write_cache(tmp_path / "a.kv", make_manifest(range(100, 120)))
    _write_cache(tmp_path / "b.kv", make_manifest(range(200, 220), weights="finetune"))
    _write_cache(tmp_path / "c.kv", make_manifest(range(300, 320)))
    raw = (tmp_path / "c.kv" / mf.MANIFEST_NAME).read_bytes().replace(b"300", b"301", 1)  # stale/edited manifest
    (tmp_path / "c.kv" / mf.MANIFEST_NAME).write_bytes(raw)
    _write_cache(tmp_path / "d.kv", make_manifest(range(400, 420)))
    (tmp_path / "d.kv" / "layer_001.safetensors.zst").unlink()
    (tmp_path / "notes").mkdir()  # not a cache: ignored
    logged = []
    index, refused = caches.build_index(str(tmp_path), engine(), log=lambda where, why: logged.append((where, why)))
    assert [e.location for e in index.entries] == [str(tmp_path / "a.kv")]
    assert "differs in weights" in refused[str(tmp_path / "b.kv")]
    assert "checksum does not match" in refused[str(tmp_path / "c.kv")]
    assert "shard is missing" in refused[str(tmp_path / "d.kv")]
    assert len(logged) == 3
    assert index.match(list(range(100, 120)) + [1])[1] == 20
    # one cache folder given directly
    index, refused = caches.build_index(str(tmp_path / "a.kv"), engine())
    assert len(index) == 1 and not refused


def test_build_index_reads_urls_through_fsspec(tmp_path):
    pytest.importorskip("fsspec")
    _write_cache(tmp_path / "a.kv", make_manifest(range(100, 120)))
    _write_cache(tmp_path / "b.kv", make_manifest(range(100, 120), dtype="bfloat16"))
    index, refused = caches.build_index(f"file://{tmp_path}", engine())
    assert [e.location for e in index.entries] == [f"file://{tmp_path}/a.kv"]
    assert "dtype" in refused[f"file://{tmp_path}/b.kv"]


def test_the_connector_imports_no_engine_and_no_transformers():
    code = ("import sys, kvcli.integrations.caches, kvcli.integrations.fingerprint, kvcli.remote.local_store\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('kvcli.engine', 'transformers')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_remote_store_finds_kvcli_home_as_the_engine_does(monkeypatch, tmp_path):
    from kvcli.engine.model import models
    from kvcli.remote import local_store

    for env in ({"KVCLI_HOME": str(tmp_path / "h")}, {"KVCLI_HOME": "", "XDG_CACHE_HOME": str(tmp_path / "x")}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert local_store.root() == models.kvcli_home() / "remote"


def test_the_connector_fingerprints_a_model_folder_as_the_engine_does(tiny_model_dir):
    """The four hashes vLLM's side recomputes from the served folder equal the ones kvcli's engine records."""
    import kvcli
    from kvcli.integrations import fingerprint

    lm = kvcli.load(str(tiny_model_dir))
    got = fingerprint.of_folder(str(tiny_model_dir))
    for key in ("config_sha256", "tokenizer_sha256", "chat_template_sha256", "weights_sha256"):
        assert got[key] == lm.fingerprint[key], key
    assert got["weights_sha256"] is not None
