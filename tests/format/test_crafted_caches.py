"""Crafted caches on the reader's own functions: the shard decoders refuse every crafted payload in bounded memory,
the manifest parser raises cache errors only, verify streams whatever a manifest claims, and a cache longer than
the model is refused before it is decoded."""

from __future__ import annotations

import copy
import json
import random
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcli.format import manifest as mf, store
from tests.fuzz_cases import (DIGEST, FIELDS, QUANT_FIELDS, SEED, crafted_shards, load_body, random_junk, resize_tokens, set_at,
                              sha)
@pytest.fixture(scope="module", params=["lossless", "4-bit"])
def shard0(request, pristine, pristine_q):

    cache = pristine if request.param == "lossless" else pristine_q
    m = store.read_manifest(cache)
    return m, (cache / m.layers[0].file).read_bytes()


@pytest.mark.parametrize("held", ["whole", "streamed"])
@pytest.mark.parametrize("checker", ["codec.decode_layer", "store.check_payload"])
def test_decoders_refuse_every_crafted_payload(shard0, checker, held, monkeypatch):
    """The restore decoder and verify's streaming check, on their own, with the payload decompressed whole (a small
    shard) and streamed in pieces (a large one): each crafted payload raises CacheCorruptError with a one-line
    message, and memory stays bounded."""
    from kvcli.format import codec, payload
    from kvcli.errors import CacheCorruptError

    if held == "streamed":
        monkeypatch.setattr(payload, "WHOLE_BELOW", 0)

    m, stored = shard0
    entry = m.layers[0]

    def check(data, decoded):
        kwargs = dict(transform=m.transform, key_shape=entry.key_shape, value_shape=entry.value_shape, decoded_bytes=decoded,
                      quant=m.quant)
        if checker == "codec.decode_layer":
            return codec.decode_layer(data, name="SHARD", dtype=codec.DTYPES[m.dtype], **kwargs)
        return store.check_payload(data, where="SHARD", dtype=m.dtype, **kwargs)

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    crafted = crafted_shards(stored, entry.raw_bytes)
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # building two 64 MiB bombs costs the test itself
    for label, data, decoded in crafted:
        with pytest.raises(CacheCorruptError) as info:
            check(data, decoded if decoded is not None else entry.decoded_bytes)
        assert str(info.value).startswith("SHARD: ") and "\n" not in str(info.value), (label, str(info.value))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(rss0, rss_built)
    assert grown < 64 << 20, f"checking crafted shards grew the peak RSS by {grown >> 20} MiB"
    check(stored, entry.decoded_bytes)  # and the pristine shard passes


@pytest.mark.parametrize("quantized", [False, True], ids=["lossless", "4-bit"])
def test_manifest_parse_never_raises_anything_but_cache_errors(pristine, pristine_q, quantized):
    """manifest.parse alone on thousands of seeded random edits (fast, in process)."""
    from kvcli.errors import CacheError

    raw = ((pristine_q if quantized else pristine) / "manifest.json").read_bytes()
    body = json.loads(raw)
    fields = FIELDS + (QUANT_FIELDS if quantized else [])
    rng = random.Random(SEED + 2)
    deadline = time.monotonic() + (2.5 if quantized else 5)
    count = 0
    while time.monotonic() < deadline and count < 3000:
        b = copy.deepcopy(body)
        path, kinds = rng.choice(fields)
        try:
            set_at(b, path, random_junk(rng))
        except (IndexError, KeyError, TypeError):
            continue
        b["manifest_sha256"] = mf.checksum(b)
        data = json.dumps(b).encode()
        if rng.random() < 0.3:
            at = rng.randrange(len(data))
            data = data[:at] + rng.randbytes(rng.randrange(1, 8)) + data[at:]
        try:
            mf.parse(data, "M")
        except CacheError as exc:
            assert str(exc).startswith("M") and "\n" not in str(exc)
        count += 1
    assert count > 200


def make_long_cache(pristine: Path, dst: Path, tokens: int, max_positions: int) -> None:
    """A self-consistent cache claiming `tokens` tokens: valid headers, all-zero tensors, a tiny zstd bomb per layer.

    A quantized pristine becomes an 8-bit cache with groups of one (a scale and a minimum per value:
    payloads larger than raw, every scale streamed through verify's finiteness check)."""
    import io

    import zstandard

    from kvcli.format import payload

    shutil.copytree(pristine, dst)
    body = load_body(dst)
    resize_tokens(body, tokens, max_positions=max_positions)
    quant = body["compression"].get("quant")
    if quant:
        quant.update(bits=8, group_size=1)
    for layer in body["layers"]:
        meta = {"transform": body["compression"]["transform"], "dtype": body["model"]["dtype"]}
        if quant:
            meta["kv_bits"] = "8"
        entries = payload.layout(body["model"]["dtype"], layer["key_shape"], layer["value_shape"],
                                 transform=body["compression"]["transform"], quant=quant)
        header, offset = {"__metadata__": meta}, 0
        for e in entries:
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        total = 8 + len(head) + offset
        out = io.BytesIO()
        with zstandard.ZstdCompressor(level=1).stream_writer(out, size=total, closefd=False) as w:
            w.write(struct.pack("<Q", len(head)) + head)
            zeros, left = bytes(1 << 22), offset
            while left:
                w.write(zeros[: min(left, len(zeros))])
                left -= min(left, len(zeros))
        data = out.getvalue()
        (dst / layer["file"]).unlink()
        (dst / layer["file"]).write_bytes(data)
        layer.update(stored_bytes=len(data), decoded_bytes=total, **{DIGEST: sha(data)})
    body["manifest_sha256"] = mf.checksum(body)
    (dst / "manifest.json").write_text(json.dumps(body, separators=(",", ":")))


@pytest.mark.parametrize("quantized", [False, True], ids=["lossless", "8-bit"])
def test_verify_streams_whatever_the_manifest_claims(pristine, pristine_q, tmp_path, quantized):
    """verify decompresses a 100 MB-per-layer bomb from a few KB on disk without holding it in memory."""
    source = pristine_q if quantized else pristine
    long = tmp_path / "long.kv"
    make_long_cache(source, long, tokens=400_000, max_positions=1 << 20)
    assert sum(p.stat().st_size for p in long.iterdir()) < 2 << 20
    code = ("import resource, sys; from kvcli.format import store; store.verify(sys.argv[1]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    rss = {}
    for name, path in (("pristine", source), ("long", long)):
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        rss[name] = int(proc.stdout) * 1024
    assert store_decoded(long) > 150 << 20
    assert rss["long"] - rss["pristine"] < 48 << 20, rss  # the manifest's 400k token ids, not the tensors


def store_decoded(cache: Path) -> int:
    return sum(layer["decoded_bytes"] for layer in load_body(cache)["layers"])


def test_ask_refuses_a_cache_longer_than_the_model_before_loading_it(pristine, tiny_model_dir, tmp_path, monkeypatch):
    import kvcli
    from kvcli.engine.cache import restore
    from kvcli.errors import CacheError

    long = tmp_path / "long.kv"
    make_long_cache(pristine, long, tokens=20_000, max_positions=1 << 20)  # the tiny model takes 8192 positions
    lm = kvcli.load(str(tiny_model_dir))
    loaded = []
    real = restore.load_cache
    monkeypatch.setattr(restore, "load_cache", lambda *a, **k: loaded.append(1) or real(*a, **k))
    with pytest.raises(CacheError):
        kvcli.Session(lm, long)
    assert not loaded, "the cache was decoded before being refused"
