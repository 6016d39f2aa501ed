"""The shard codec and the restore path: exact round trips for every stored dtype and transform,
and old caches (no transform recorded) still load. (Questions appending into the restored cache:
tests/engine/test_kvcache.py.)"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import zstandard

import kvcli
from kvcli.format import codec, manifest as mf, store
from kvcli.engine.cache import restore
from kvcli.documents import decode
from kvcli.errors import CacheCorruptError
from kvcli.engine.prefilling import prefill
from tests.conftest import TokenCounter, reference_answer, sample_text
from tests.helpers import as_format_version

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TRANSFORMS = ["none", "byteplane"]


@pytest.fixture(params=["whole", "streamed"])
def held(request, monkeypatch):
    """Both ways a payload is read: decompressed whole (a small shard) and streamed in pieces (a large one)."""
    from kvcli.format import payload

    if request.param == "streamed":
        monkeypatch.setattr(payload, "WHOLE_BELOW", 0)
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (NaN payloads, -0.0 and subnormals compare as they are stored)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _kv(dtype, shape=(1, 3, 37, 16), seed=0):
    """Keys/values like a real cache (smooth magnitudes) plus every special value the dtype has."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(shape, generator=g) * torch.linspace(0.01, 30, shape[-1])).to(dtype)
    values = torch.randn(shape, generator=g).to(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 65504.0, 3.0e38]).to(dtype)
    flat = keys.view(-1)
    flat[: specials.numel()] = specials
    bits = _bits(values).view(-1)
    bits[0] = -1  # a NaN with every payload bit set: must come back bit for bit
    bits[1] = 1  # the smallest subnormal
    return keys, values


def _decode(enc, keys, values, transform, **kw):
    return codec.decode_layer(enc.data, name="shard", transform=transform, dtype=keys.dtype, key_shape=tuple(keys.shape),
                              value_shape=tuple(values.shape), decoded_bytes=enc.decoded_bytes, **kw)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bit_identical(dtype, transform, held):
    keys, values = _kv(dtype)
    enc = codec.encode_layer(keys, values, transform=transform, level=1)
    assert enc.raw_bytes == 2 * keys.numel() * keys.element_size()
    k, v = _decode(enc, keys, values, transform)
    assert k.dtype == dtype and k.shape == keys.shape and v.shape == values.shape
    assert torch.equal(_bits(k), _bits(keys)) and torch.equal(_bits(v), _bits(values))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_byteplane_payload_holds_byte_k_of_every_element_in_row_k(dtype):
    keys, values = _kv(dtype)
    enc = codec.encode_layer(keys, values, transform="byteplane", level=1)
    payload = zstandard.ZstdDecompressor().decompress(enc.data)
    (n,) = __import__("struct").unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + n])
    item, numel = keys.element_size(), keys.numel()
    assert header["__metadata__"] == {"transform": "byteplane", "dtype": str(dtype).removeprefix("torch.")}
    assert header["keys"] == {"dtype": "U8", "shape": [item, numel], "data_offsets": [0, item * numel]}
    start = 8 + n
    elem_bytes = keys.contiguous().view(torch.uint8).view(numel, item)
    planes = torch.frombuffer(bytearray(payload[start : start + item * numel]), dtype=torch.uint8).view(item, numel)
    assert torch.equal(planes, elem_bytes.t())


def test_byteplane_compresses_float_caches_better_than_plain_zstd():
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.rand((1, 3, 256, 64), generator=g) * 3 + 1 for _ in range(2))  # few distinct exponents
    sizes = {t: len(codec.encode_layer(keys, values, transform=t, level=1).data) for t in TRANSFORMS}
    assert sizes["byteplane"] < sizes["none"]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_decodes_into_views_with_room_and_leaves_the_room_alone(dtype, transform, held):
    keys, values = _kv(dtype, shape=(1, 3, 1000, 16))  # several decode steps per plane
    enc = codec.encode_layer(keys, values, transform=transform, level=1)
    bufs = [torch.full((1, 3, 1000 + 7, 16), 7.0, dtype=dtype) for _ in range(2)]
    out = tuple(b[:, :, :1000] for b in bufs)
    k, v = _decode(enc, keys, values, transform, out=out)
    assert k is out[0] and v is out[1]
    assert torch.equal(_bits(k), _bits(keys)) and torch.equal(_bits(v), _bits(values))
    for b in bufs:
        assert bool((b[:, :, 1000:] == 7.0).all())


def test_decode_refuses_a_destination_of_another_shape():
    keys, values = _kv(torch.float32)
    enc = codec.encode_layer(keys, values, transform="byteplane", level=1)
    with pytest.raises(ValueError):
        _decode(enc, keys, values, "byteplane", out=(torch.empty(1, 3, 36, 16), torch.empty(values.shape)))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_wrong_sizes_and_wrong_transform_are_corruption(transform, held):
    keys, values = _kv(torch.float16)
    enc = codec.encode_layer(keys, values, transform=transform, level=1)
    other = "none" if transform == "byteplane" else "byteplane"
    with pytest.raises(CacheCorruptError, match="transform"):
        _decode(enc, keys, values, other)
    for size in (enc.decoded_bytes - 1, enc.decoded_bytes + 1):
        with pytest.raises(CacheCorruptError):
            codec.decode_layer(enc.data, name="shard", transform=transform, dtype=keys.dtype, key_shape=tuple(keys.shape),
                               value_shape=tuple(values.shape), decoded_bytes=size)
    no_size = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(
        zstandard.ZstdDecompressor().decompress(enc.data) + b"\0" * 8)  # frame hides its size; payload too long
    with pytest.raises(CacheCorruptError, match="more bytes"):
        codec.decode_layer(no_size, name="shard", transform=transform, dtype=keys.dtype, key_shape=tuple(keys.shape),
                           value_shape=tuple(values.shape), decoded_bytes=enc.decoded_bytes)
    with pytest.raises(CacheCorruptError, match="decompresses to"):
        codec.decode_layer(no_size[: len(no_size) // 2], name="shard", transform=transform, dtype=keys.dtype,
                           key_shape=tuple(keys.shape), value_shape=tuple(values.shape), decoded_bytes=enc.decoded_bytes)


def test_a_shard_written_by_the_safetensors_library_without_a_transform_decodes():
    """Shards from before the transform existed: plain safetensors (metadata without 'transform')."""
    from safetensors.torch import save

    keys, values = _kv(torch.float32)
    payload = save({"keys": keys.contiguous(), "values": values.contiguous()}, metadata={"format": "pt"})
    data = zstandard.ZstdCompressor(level=3).compress(payload)
    k, v = codec.decode_layer(data, name="old", transform="none", dtype=torch.float32, key_shape=tuple(keys.shape),
                              value_shape=tuple(values.shape), decoded_bytes=len(payload))
    assert torch.equal(_bits(k), _bits(keys)) and torch.equal(_bits(v), _bits(values))


# ---------------------------------------------------------------- whole caches on a tiny model

QUESTIONS = ("Who is the licensor?", "What does the license grant?")
MAX_NEW = 8


@pytest.fixture(scope="module")
def doc():
    return decode(sample_text()[:1500].encode(), "doc.txt")


def _as_old_format(path):
    """Rewrite a transform-'none' cache as a kvcli from before transforms wrote it: shards saved by the
    safetensors library with no transform in their metadata, and no 'transform' key in the manifest."""
    from safetensors.torch import save

    body = json.loads((path / mf.MANIFEST_NAME).read_text())
    assert body["compression"].pop("transform") == "none"
    dtype = codec.DTYPES[body["model"]["dtype"]]
    for layer in body["layers"]:
        shard = path / layer["file"]
        k, v = codec.decode_layer(shard.read_bytes(), name=layer["file"], transform="none", dtype=dtype,
                                  key_shape=tuple(layer["key_shape"]), value_shape=tuple(layer["value_shape"]),
                                  decoded_bytes=layer["decoded_bytes"])
        payload = save({"keys": k, "values": v})
        data = zstandard.ZstdCompressor(level=3).compress(payload)
        shard.write_bytes(data)
        layer.update(decoded_bytes=len(payload), stored_bytes=len(data))
        layer.pop(mf.SHARD_HASHES[body["format_version"]])
        layer["sha256"] = hashlib.sha256(data).hexdigest()  # that kvcli wrote format 1: sha256 digests
    body["format_version"] = mf.LOSSLESS_SHA256_VERSION
    body["manifest_sha256"] = mf.checksum(body)
    (path / mf.MANIFEST_NAME).write_text(json.dumps(body))


@pytest.mark.parametrize("transform", ["none", "byteplane", "old"])
def test_cache_restores_bit_identically_and_answers_like_recompute(tiny_lm, doc, tmp_path, transform):
    path = tmp_path / "doc.kv"
    result = prefill(tiny_lm, doc, path, transform="none" if transform == "old" else transform, chunk_size=100)
    with torch.inference_mode():
        from kvcli.engine.prefilling import run_chunks

        fresh = run_chunks(tiny_lm, result.manifest.token_ids, 100)
    if transform == "old":
        _as_old_format(path)
    m = store.read_manifest(path)
    assert m.compression.get("transform", "absent") == ("absent" if transform == "old" else transform)
    session = kvcli.Session(tiny_lm, path)
    for state, layer in zip(session.states, fresh.layers):
        assert torch.equal(_bits(state.keys), _bits(layer.keys)) and torch.equal(_bits(state.values), _bits(layer.values))
    counter = TokenCounter(tiny_lm.model)
    try:
        for q in QUESTIONS:
            counter.reset()
            a = session.ask(q, kvcli.GenerationOptions(max_new_tokens=MAX_NEW))
            assert a.answer_token_ids == reference_answer(tiny_lm.model, a.prompt_token_ids, MAX_NEW)
            assert counter.calls[0] == a.new_tokens  # the document was not run again
    finally:
        counter.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_caches_restore_bit_identically(tokenizer, doc, tmp_path, dtype):
    from tests.conftest import tiny_llama

    lm = kvcli.from_objects(tiny_llama(len(tokenizer)).to(getattr(torch, dtype)), tokenizer, name=f"tiny-{dtype}")
    path = tmp_path / "doc.kv"
    result = prefill(lm, doc, path, chunk_size=128)
    assert result.manifest.dtype == dtype and result.manifest.transform == "byteplane"
    from kvcli.engine.prefilling import run_chunks

    fresh = run_chunks(lm, result.manifest.token_ids, 128)
    with store.open_cache(path) as opened:
        states = restore.load_states(opened)
    for state, layer in zip(states, fresh.layers):
        assert state.keys.dtype == getattr(torch, dtype)
        assert torch.equal(_bits(state.keys), _bits(layer.keys)) and torch.equal(_bits(state.values), _bits(layer.values))


def test_new_caches_hash_shards_with_blake3_and_sha256_caches_still_read(tiny_lm, doc, tmp_path):
    """Format 3 records a BLAKE3 digest per shard; caches of formats 1 and 2 (sha256) restore, verify and
    answer as before, and each version's digest is checked under its own hash."""
    from blake3 import blake3

    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, chunk_size=100)
    body = json.loads((path / mf.MANIFEST_NAME).read_text())
    assert body["format_version"] == mf.FORMAT_VERSION == 3 and all("sha256" not in layer for layer in body["layers"])
    assert [layer["blake3"] for layer in body["layers"]] == [
        blake3((path / layer["file"]).read_bytes()).hexdigest() for layer in body["layers"]]
    opts = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
    want = kvcli.Session(tiny_lm, path).ask(QUESTIONS[0], opts).answer_token_ids
    old = as_format_version(path, mf.LOSSLESS_SHA256_VERSION)
    assert [layer["sha256"] for layer in old["layers"]] == [
        hashlib.sha256((path / layer["file"]).read_bytes()).hexdigest() for layer in old["layers"]]
    m = store.verify(path)
    assert (m.format_version, m.shard_hash) == (1, "sha256")
    assert kvcli.Session(tiny_lm, path).ask(QUESTIONS[0], opts).answer_token_ids == want
    shard = path / "layer_000.safetensors.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match="layer_000.*checksum"):
        store.verify(path)


@pytest.mark.parametrize("threads", [1, 3])
def test_verify_reports_the_first_bad_shard_in_layer_order_with_any_thread_count(tiny_lm, doc, tmp_path, threads):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path)
    assert store.verify(path, threads=threads).num_tokens > 0
    for name in ("layer_001.safetensors.zst", "layer_000.safetensors.zst"):  # the later layer's first: order decides
        shard = path / name
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0x10
        shard.write_bytes(bytes(data))
        with pytest.raises(CacheCorruptError, match=f"{name}: checksum mismatch"):
            store.verify(path, threads=threads)


def test_damaged_shard_is_reported_by_its_checksum(tiny_lm, doc, tmp_path):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path)
    shard = path / "layer_001.safetensors.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with store.open_cache(path) as opened, pytest.raises(CacheCorruptError, match="layer_001.*checksum"):
        restore.load_states(opened)
    shard.write_bytes(bytes(data[:-10]))
    with store.open_cache(path) as opened, pytest.raises(CacheCorruptError, match="layer_001.*truncated"):
        restore.load_states(opened)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_every_shard_payload_opens_with_the_safetensors_library(tiny_lm, doc, tmp_path, transform):
    """The container inside each zstd frame is plain safetensors: its own loader reads every shard, and the
    tensors it returns (byte planes undone) are the restored keys and values, bit for bit."""
    from safetensors import safe_open

    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, transform=transform, chunk_size=100)
    m = store.read_manifest(path)
    with store.open_cache(path) as opened:
        states = restore.load_states(opened)
    for entry, state in zip(m.layers, states):
        payload = zstandard.ZstdDecompressor().decompress((path / entry.file).read_bytes())
        assert len(payload) == entry.decoded_bytes
        plain = tmp_path / f"{entry.index}.safetensors"
        plain.write_bytes(payload)
        with safe_open(str(plain), framework="pt") as f:
            assert f.metadata() == {"transform": transform, "dtype": m.dtype}
            assert sorted(f.keys()) == ["keys", "values"]
            for name, want in (("keys", state.keys), ("values", state.values)):
                got = f.get_tensor(name)
                if transform == "byteplane":  # U8 [itemsize, numel] -> the elements' bytes -> the tensor
                    assert got.dtype == torch.uint8 and tuple(got.shape) == (want.element_size(), want.numel())
                    got = got.t().contiguous().view(want.dtype).reshape(want.shape)
                assert tuple(got.shape) == tuple(entry.key_shape if name == "keys" else entry.value_shape)
                assert torch.equal(_bits(got), _bits(want))
