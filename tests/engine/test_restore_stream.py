"""The streamed restore (issue 25): each shard hashed as it is decompressed into its layer's buffer. The layers
are bit-identical to decoding the verified bytes, and damage is still refused by the checksum, naming the file,
whichever check trips first."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvcli.documents import decode
from kvcli.engine.cache import restore
from kvcli.engine.prefilling import prefill
from kvcli.errors import CacheCorruptError
from kvcli.format import codec, payload, store
from tests.conftest import sample_text


@pytest.fixture
def doc():
    return decode(sample_text()[:900].encode(), "doc.txt")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks far smaller than a shard, so that reads, hashing and byte planes cross pieces and head blocks."""
    monkeypatch.setattr(store, "STREAM_CHUNK", 4093)
    monkeypatch.setattr(payload, "SOURCE_READ", 4093)
    monkeypatch.setattr(codec, "PLANE_CHUNK", 1000)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _from_bytes(opened: store.OpenedCache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i decoded from its verified bytes (the path verify and the vLLM connector take)."""
    m, e = opened.manifest, opened.manifest.layers[i]
    return codec.decode_layer(opened.read_shard(i), name=e.file, transform=m.transform, dtype=codec.DTYPES[m.dtype],
                              key_shape=e.key_shape, value_shape=e.value_shape, decoded_bytes=e.decoded_bytes,
                              quant=m.quant)


@pytest.mark.parametrize("chunks", ["default", "small"])
@pytest.mark.parametrize("storage", ["byteplane", "none", "8-bit"])
def test_streamed_restore_equals_decoding_the_verified_bytes(tiny_lm, doc, tmp_path, request, chunks, storage):
    if chunks == "small":
        request.getfixturevalue("small_chunks")
    path = tmp_path / "doc.kv"
    kw = {"kv_bits": 8} if storage == "8-bit" else {"transform": storage}
    prefill(tiny_lm, doc, path, chunk_size=64, **kw)
    with store.open_cache(path) as opened:
        states = restore.load_states(opened)
        assert len(states) == len(opened.manifest.layers) > 1
        for i, state in enumerate(states):
            k, v = _from_bytes(opened, i)
            assert state.keys.shape == k.shape and state.values.shape == v.shape
            assert torch.equal(_bits(state.keys), _bits(k)) and torch.equal(_bits(state.values), _bits(v))


@pytest.mark.parametrize("where", ["frame magic", "frame header", "safetensors header", "middle", "last byte"])
def test_damage_is_reported_by_the_checksum_whatever_trips_first(tiny_lm, doc, tmp_path, small_chunks, where):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, chunk_size=64)
    shard = path / "layer_001.safetensors.zst"
    data = bytearray(shard.read_bytes())
    at = {"frame magic": 0, "frame header": 5, "safetensors header": 14, "middle": len(data) // 2,
          "last byte": len(data) - 1}[where]
    data[at] ^= 0x5A
    shard.write_bytes(bytes(data))
    with store.open_cache(path) as opened, pytest.raises(CacheCorruptError, match=r"layer_001\.safetensors\.zst: checksum mismatch"):
        restore.load_cache(opened)


def test_a_swapped_shard_is_refused_by_name(tiny_lm, doc, tmp_path):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, chunk_size=64)
    shutil.copyfile(path / "layer_000.safetensors.zst", path / "layer_001.safetensors.zst")
    with store.open_cache(path) as opened, pytest.raises(CacheCorruptError, match=r"layer_001\.safetensors\.zst: "):
        restore.load_cache(opened)


def test_a_shard_truncated_while_it_streams_is_refused(tiny_lm, doc, tmp_path, small_chunks):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, chunk_size=64)
    shard = path / "layer_001.safetensors.zst"
    size = shard.stat().st_size
    with store.open_cache(path) as opened:
        stream = opened.stream_shard(1)  # size checked here, before the file shrinks
        assert len(stream.peek()) == 4093
        os.truncate(shard, size - 7)
        while stream.read(4093):
            pass
        with pytest.raises(CacheCorruptError, match=rf"layer_001\.safetensors\.zst: {size - 7} bytes read, manifest says {size}"):
            stream.verify()


def test_a_stream_read_whole_verifies_and_hands_out_every_byte_once(tiny_lm, doc, tmp_path, small_chunks):
    path = tmp_path / "doc.kv"
    prefill(tiny_lm, doc, path, chunk_size=64)
    with store.open_cache(path) as opened:
        stream = opened.stream_shard(0)
        head = stream.peek()
        got = b"".join(iter(lambda: stream.read(5000), b""))
        stream.verify()
        assert got.startswith(head) and got == opened.read_shard(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_byte_planes_decode_into_buffers_whose_rows_sit_apart(dtype, monkeypatch):
    """Destinations may be views with room between rows (only the last dimension contiguous)."""
    monkeypatch.setattr(codec, "PLANE_CHUNK", 300)
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn((1, 3, 37, 16), generator=g).to(dtype) for _ in range(2))
    enc = codec.encode_layer(keys, values, transform="byteplane", level=1)
    out = tuple(torch.full((1, 3, 37, 21), 7.0, dtype=dtype)[..., :16] for _ in range(2))  # rows 21 apart
    k, v = codec.decode_layer(enc.data, name="shard", transform="byteplane", dtype=dtype, key_shape=tuple(keys.shape),
                              value_shape=tuple(values.shape), decoded_bytes=enc.decoded_bytes, out=out)
    assert torch.equal(_bits(k), _bits(keys)) and torch.equal(_bits(v), _bits(values))
    assert k.data_ptr() == out[0].data_ptr() and (out[0]._base[..., 16:] == 7.0).all()
