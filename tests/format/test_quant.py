"""8-/4-bit caches: the group quantization math, its shard layout and manifest schema, restore into
views with room, tiny-model end to end (full and sliding layers), the CLI showing the scheme, and an
older reader refusing the format by version."""

from __future__ import annotations

import json

import pytest
import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine import fidelity
from kvcli.engine.prefilling import QUANT_EXACT, QUANT_RECENT, prefill, quant_spec, run_chunks
from kvcli.errors import CacheCorruptError, CacheVersionError, ModelError
from kvcli.format import codec, manifest as mf, payload, quant, store
from kvcli.engine.cache import layers
from tests.conftest import sample_text
from tests.helpers import as_format_version, assert_clean_error, run

SHAPES = [(1, 3, 37, 16), (1, 2, 200, 64), (1, 1, 3, 5)]  # partial groups, several groups, fewer tokens than exact


def _spec(bits, group=32, exact=4, scale_dtype="float16", recent=None):
    """A compression.quant block; recent=None leaves recent_tokens out (a cache written before it existed)."""
    spec = {"bits": bits, "group_size": group, "exact_tokens": exact, "scale_dtype": scale_dtype, **mf.QUANT_AXES}
    return spec if recent is None else {**spec, "recent_tokens": recent}


def _kv(shape, seed=0):
    """Keys with channels of very different ranges (as real keys have), values of one scale."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=g) * torch.linspace(0.05, 20, shape[-1]) + torch.linspace(-3, 3, shape[-1])
    return keys, torch.randn(shape, generator=g)


def _round_trip(keys, values, spec, out=None):
    enc = codec.encode_layer(keys, values, transform="none", level=1, quant=spec)
    k, v = codec.decode_layer(enc.data, name="shard", transform="none", dtype=keys.dtype, key_shape=tuple(keys.shape),
                              value_shape=tuple(values.shape), decoded_bytes=enc.decoded_bytes, out=out, quant=spec)
    return enc, k, v


def _group_bound(x, axis, group, bits):
    """Largest error allowed per element: half a step of its group, plus float16 rounding of scale and min."""
    n = x.shape[axis]
    out = torch.empty_like(x)
    for start in range(0, n, group):
        part = x.narrow(axis, start, min(group, n - start))
        lo, hi = part.amin(axis, keepdim=True), part.amax(axis, keepdim=True)
        step = (hi - lo) / ((1 << bits) - 1)
        out.narrow(axis, start, part.shape[axis]).copy_((step / 2 + (hi.abs() + lo.abs()) * 2e-3).expand_as(part))
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("recent", [None, 0, 8, 40])  # 40: more than some layers' tokens after the sinks
def test_round_trip_error_is_within_half_a_step_of_each_group_and_exact_tokens_are_exact(bits, shape, recent):
    keys, values = _kv(shape)
    spec = _spec(bits, recent=recent)
    enc, k, v = _round_trip(keys, values, spec)
    n = shape[2]
    e = min(spec["exact_tokens"], n)
    r = min(recent or 0, n - e)  # the last r tokens: exact too
    assert payload.quant_split(n, spec) == (e, n - e - r, r)
    for got, want in ((k, keys), (v, values)):
        assert torch.equal(got[:, :, :e], want[:, :, :e]) and torch.equal(got[:, :, n - r:], want[:, :, n - r:])
    for got, want, axis in ((k, keys, 2), (v, values, 3)):
        rest = want[:, :, e:n - r]
        assert bool(((got[:, :, e:n - r] - rest).abs() <= _group_bound(rest, axis, 32, bits)).all())
    layout = payload.quant_layout("float32", shape, shape, spec)
    assert enc.decoded_bytes > payload.data_bytes(layout)  # header + the layout's bytes, nothing else
    parts = ("exact", "recent", "codes", "scale", "min") if recent else ("exact", "codes", "scale", "min")
    assert [e.name for e in layout] == [f"{t}.{p}" for t in ("keys", "values") for p in parts]


def test_a_layer_shorter_than_sinks_and_recent_window_is_stored_exact():
    """Sliding layers keep a short window: with no token left between the first and the last kept tokens
    everything comes back bit-exact, and the codes, scales and minimums are empty."""
    keys, values = _kv((1, 2, 30, 16))
    spec = _spec(4, exact=8, recent=32)
    enc, k, v = _round_trip(keys, values, spec)
    assert torch.equal(k, keys) and torch.equal(v, values)
    sizes = {e.name: e.nbytes for e in payload.quant_layout("float32", keys.shape, values.shape, spec)}
    assert sizes["keys.exact"] == 2 * 8 * 16 * 4 and sizes["keys.recent"] == 2 * 22 * 16 * 4
    assert sizes["keys.codes"] == sizes["keys.scale"] == sizes["values.min"] == 0


def test_recent_window_restores_into_views_with_room():
    keys, values = _kv((1, 3, 300, 16))
    bufs = [torch.full((1, 3, 307, 16), 7.0) for _ in range(2)]
    out = tuple(b[:, :, :300] for b in bufs)
    _, k, v = _round_trip(keys, values, _spec(4, exact=4, recent=64), out=out)
    assert torch.equal(k[:, :, 236:], keys[:, :, 236:]) and torch.equal(v[:, :, 236:], values[:, :, 236:])
    assert all(bool((b[:, :, 300:] == 7.0).all()) for b in bufs)  # the room after the document stays untouched
    assert not torch.equal(k[:, :, 4:236], keys[:, :, 4:236])  # the middle is quantized


def test_keys_per_channel_keep_small_channels_precise():
    """A channel 400x smaller than another keeps its own precision: groups run along tokens, not channels."""
    keys, values = _kv((1, 2, 256, 64))
    _, k, _ = _round_trip(keys, values, _spec(4, group=64, exact=0))
    small = (k[..., 0] - keys[..., 0]).abs().max()
    assert small < 0.05 * 0.5 / 15 * 8 + 1e-3  # channel 0 spans about 8 * 0.05: half a 4-bit step of that


def test_four_bit_codes_pack_two_per_byte_and_odd_counts_round_up():
    codes = torch.tensor([1, 2, 15, 0, 7], dtype=torch.uint8)
    packed = quant.pack(codes, 4)
    assert packed.tolist() == [1 | 2 << 4, 15, 7] and payload.code_bytes(5, 4) == 3
    assert torch.equal(quant.unpack(packed, 4, 5), codes)


def test_constant_groups_and_half_precision_caches_round_trip():
    keys = torch.full((1, 2, 40, 8), 3.25, dtype=torch.bfloat16)
    values = torch.zeros((1, 2, 40, 8), dtype=torch.bfloat16)
    _, k, v = _round_trip(keys, values, _spec(4, group=16))
    assert k.dtype == torch.bfloat16 and torch.equal(k, keys) and torch.equal(v, values)


def test_dequantizes_into_views_with_room_and_leaves_the_room_alone():
    keys, values = _kv((1, 3, 300, 16))
    bufs = [torch.full((1, 3, 307, 16), 7.0) for _ in range(2)]
    out = tuple(b[:, :, :300] for b in bufs)
    _, k, v = _round_trip(keys, values, _spec(8), out=out)
    assert k is out[0] and v is out[1]
    assert bool(((k - keys)[:, :, 4:].abs() <= _group_bound(keys[:, :, 4:], 2, 32, 8)).all())
    assert bool(((v - values)[:, :, 4:].abs() <= _group_bound(values[:, :, 4:], 3, 32, 8)).all())
    assert all(bool((b[:, :, 300:] == 7.0).all()) for b in bufs)


@pytest.mark.parametrize("written, others", [
    (_spec(8), [_spec(4), _spec(8, group=16), _spec(8, exact=5), _spec(8, scale_dtype="float32"), _spec(8, recent=4), None]),
    (_spec(8, recent=8), [_spec(8), _spec(8, recent=0), _spec(8, recent=9), _spec(8, exact=5, recent=7), _spec(4, recent=8)]),
], ids=["no recent window", "recent window"])
def test_a_shard_decoded_with_another_scheme_is_corruption(written, others):
    keys, values = _kv((1, 2, 64, 16))
    enc = codec.encode_layer(keys, values, transform="none", level=1, quant=written)
    for other in others:
        for check in ("codec", "store"):
            with pytest.raises(CacheCorruptError):
                kw = dict(transform="none", key_shape=tuple(keys.shape), value_shape=tuple(values.shape),
                          decoded_bytes=enc.decoded_bytes, quant=other)
                if check == "codec":
                    codec.decode_layer(enc.data, name="s", dtype=torch.float32, **kw)
                else:
                    store.check_payload(enc.data, where="s", dtype="float32", **kw)
    store.check_payload(enc.data, where="s", dtype="float32", transform="none", key_shape=tuple(keys.shape),
                        value_shape=tuple(values.shape), decoded_bytes=enc.decoded_bytes, quant=written)


def test_non_finite_caches_are_not_quantized():
    state = layers.LayerState("full", torch.tensor([[[[1.0, float("inf")]]]]), torch.zeros(1, 1, 1, 2), 1, None)
    with pytest.raises(ModelError, match="losslessly"):
        quant_spec([state], 8)
    big = layers.LayerState("full", torch.full((1, 1, 1, 2), 1e6), torch.zeros(1, 1, 1, 2), 1, None)
    assert quant_spec([big], 8)["scale_dtype"] == "float32"  # float16 scales would overflow


# ---------------------------------------------------------------- whole caches on tiny models


@pytest.fixture(scope="module")
def doc():
    return decode(sample_text()[:1500].encode(), "doc.txt")


@pytest.fixture(scope="module")
def caches(tiny_lm, doc, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for bits in (None, 8, 4):
        path = root / f"doc-{bits or 'lossless'}.kv"
        prefill(tiny_lm, doc, path, chunk_size=100, kv_bits=bits)
        out[bits] = path
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_cache_manifest_sizes_and_verify(caches, bits):
    m = store.verify(caches[bits])
    lossless = store.read_manifest(caches[None])
    assert m.format_version == lossless.format_version == mf.FORMAT_VERSION and m.shard_hash == "blake3"
    assert m.quant == {"bits": bits, "group_size": 64, "exact_tokens": QUANT_EXACT[bits], "recent_tokens": QUANT_RECENT[bits],
                       "scale_dtype": "float16", "keys": "per_channel", "values": "per_token"}
    assert m.storage == f"{bits}-bit" and m.transform == "none"
    assert m.bytes_raw == lossless.bytes_raw  # raw: the float32 tensors the cache restores to
    first, _mid, last = payload.quant_split(m.num_tokens, m.quant)
    kept = (first + last) / m.num_tokens  # the share stored exact, as raw; the rest: head_dim 16, one scale per 16 values
    assert m.bytes_stored < (kept + (1 - kept) * (0.45 if bits == 8 else 0.3)) * m.bytes_raw
    for layer in m.layers:
        lay = payload.quant_layout(m.dtype, layer.key_shape, layer.value_shape, m.quant)
        assert payload.data_bytes(lay) < layer.decoded_bytes <= payload.data_bytes(lay) + 8 + payload.MAX_HEADER


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_cache_restores_close_to_lossless_and_agrees(tiny_lm, caches, bits):
    ref, got = kvcli.Session(tiny_lm, caches[None]), kvcli.Session(tiny_lm, caches[bits])
    for a, b in zip(ref.states, got.states):
        assert b.keys.dtype == torch.float32 and torch.equal(a.keys[:, :, :4], b.keys[:, :, :4])  # sinks exact
        rel = (a.values - b.values).norm() / a.values.norm()
        assert rel < (0.01 if bits == 8 else 0.12), rel
        if b.kind == "full":  # dequantized into buffers with room for the question after the document
            assert b.keys.untyped_storage().nbytes() > b.keys.numel() * b.keys.element_size()
    qs = ["Who is the licensor?", "What does the license grant?"]
    answers = [ref.ask(q, kvcli.GenerationOptions(max_new_tokens=8)) for q in qs]
    tails = [a.prompt_token_ids[len(ref.token_ids):] for a in answers]
    cand = [got.ask(q, kvcli.GenerationOptions(max_new_tokens=8)).answer_token_ids for q in qs]
    agree = fidelity.compare(tiny_lm, ref.states, got.states, tails, [a.answer_token_ids for a in answers], cand)
    same = fidelity.compare(tiny_lm, ref.states, ref.states, tails, [a.answer_token_ids for a in answers])
    assert same.top1_vs_lossless == 1.0 and same.kl_mean < 1e-9 and same.answers_identical is None
    assert agree.answer_tokens == sum(len(a.answer_token_ids) for a in answers) and agree.questions == 2
    assert agree.top1_vs_lossless >= (0.9 if bits == 8 else 0.6) and 0 <= agree.kl_mean < (0.01 if bits == 8 else 0.5)
    assert 0 <= agree.answers_identical <= 1


def test_sliding_layers_are_quantized_too(tokenizer, doc, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=32,
                                             initializer_range=0.1)).eval()
    lm = kvcli.from_objects(model, tokenizer, name="tiny-mistral")
    path = tmp_path / "doc.kv"
    m = prefill(lm, doc, path, chunk_size=100, kv_bits=4, exact_tokens=4).manifest  # 27 of the 31 tokens quantized
    assert {layer.kind for layer in m.layers} == {"sliding"} and all(layer.cached_length == 31 for layer in m.layers)
    fresh = layers.read(run_chunks(lm, m.token_ids, 100))
    session = kvcli.Session(lm, path)
    for a, b in zip(fresh, session.states):
        assert b.seq_length == a.seq_length and torch.equal(a.keys[:, :, :4], b.keys[:, :, :4])
        assert (a.keys - b.keys).norm() / a.keys.norm() < 0.12
    assert session.ask("Who is the licensor?", kvcli.GenerationOptions(max_new_tokens=4)).answer_token_ids
    # a window shorter than the first and last tokens kept together: everything stored exact
    prefill(lm, doc, path, chunk_size=100, kv_bits=4, exact_tokens=4, recent_tokens=40, force=True)
    for a, b in zip(fresh, kvcli.Session(lm, path).states):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_prefill_refuses_other_bit_widths(tiny_lm, doc, tmp_path):
    from kvcli.errors import UsageError

    with pytest.raises(UsageError, match="8 or 4"):
        prefill(tiny_lm, doc, tmp_path / "x.kv", kv_bits=2)
    assert not (tmp_path / "x.kv").exists()


# ---------------------------------------------------------------- manifest schema and versions


def _body(path):
    return json.loads((path / mf.MANIFEST_NAME).read_bytes())


def _parse(body):
    body["manifest_sha256"] = mf.checksum(body)
    return mf.parse(json.dumps(body).encode(), "M")


@pytest.mark.parametrize("edit", [
    lambda b: b["compression"]["quant"].update(bits=3),
    lambda b: b["compression"]["quant"].update(bits=8.0),
    lambda b: b["compression"]["quant"].update(group_size=0),
    lambda b: b["compression"]["quant"].update(group_size=1 << 20),
    lambda b: b["compression"]["quant"].update(exact_tokens=-1),
    lambda b: b["compression"]["quant"].update(recent_tokens=-1),
    lambda b: b["compression"]["quant"].update(recent_tokens=None),
    lambda b: b["compression"]["quant"].update(recent_tokens="8"),
    lambda b: b["compression"]["quant"].update(recent_tokens=8.0),
    lambda b: b["compression"]["quant"].update(scale_dtype="bfloat16"),
    lambda b: b["compression"]["quant"].update(keys="per_token"),
    lambda b: b["compression"]["quant"].update(extra=1),
    lambda b: b["compression"]["quant"].pop("values"),
    lambda b: b["compression"].update(quant=[8]),
    lambda b: b["compression"].update(transform="byteplane"),
    lambda b: b.update(format_version=1),  # version 1 has none (and sha256 digests)
    lambda b: b["layers"][0].update(decoded_bytes=b["layers"][0]["decoded_bytes"] + (1 << 20)),  # past the layout's bound
], ids=lambda f: "")
def test_manifest_refuses_bad_quant_blocks(caches, edit):
    body = _body(caches[4])
    _parse(json.loads(json.dumps(body)))  # the pristine one parses
    edit(body)
    with pytest.raises(CacheCorruptError):
        _parse(body)


@pytest.mark.parametrize("change", [{"group_size": 32}, {"exact_tokens": 0}, {"bits": 8}, {"scale_dtype": "float32"},
                                    {"recent_tokens": QUANT_RECENT[4] + 16}, {"recent_tokens": 0 if QUANT_RECENT[4] else 8}])
def test_a_consistent_manifest_with_another_scheme_fails_verify_and_restore(tiny_lm, caches, tmp_path, change):
    """Within the header slack a manifest may name another scheme: each shard's layout check catches it."""
    import shutil

    path = tmp_path / "x.kv"
    shutil.copytree(caches[4], path)
    body = _body(path)
    body["compression"]["quant"].update(change)
    body["manifest_sha256"] = mf.checksum(body)
    (path / mf.MANIFEST_NAME).write_text(json.dumps(body))
    try:
        store.read_manifest(path)
    except CacheCorruptError:
        return  # sizes no longer fit: refused even earlier
    with pytest.raises(CacheCorruptError, match="layer_000"):
        store.verify(path)
    with pytest.raises(CacheCorruptError, match="layer_0"):
        kvcli.Session(tiny_lm, path)


def test_a_version_2_cache_written_before_the_recent_window_still_reads(tiny_lm, doc, caches, tmp_path):
    """Caches written before recent_tokens existed have no such field: it means 0, and they verify and
    answer exactly like the same cache with the field."""
    path = tmp_path / "old.kv"
    prefill(tiny_lm, doc, path, chunk_size=100, kv_bits=8, recent_tokens=0)
    opts = kvcli.GenerationOptions(max_new_tokens=6)
    want = kvcli.Session(tiny_lm, path).ask("Who is the licensor?", opts).answer_token_ids
    as_format_version(path, mf.QUANT_SHA256_VERSION)  # as the kvcli of that time wrote it
    body = _body(path)
    assert body["compression"]["quant"].pop("recent_tokens") == 0
    body["manifest_sha256"] = mf.checksum(body)
    (path / mf.MANIFEST_NAME).write_text(json.dumps(body))
    m = store.verify(path)
    assert m.format_version == 2 and "recent_tokens" not in m.quant
    assert kvcli.Session(tiny_lm, path).ask("Who is the licensor?", opts).answer_token_ids == want
    assert "first 4 and last 0 tokens exact" in run("info", path).stdout


def test_an_older_kvcli_says_the_version_is_not_supported(caches, monkeypatch):
    monkeypatch.setattr(mf, "SUPPORTED_VERSIONS", (1, 2))  # kvcli 0.3, before BLAKE3 digests
    for bits in (8, None):
        with pytest.raises(CacheVersionError, match="version 3 is not supported"):
            store.read_manifest(caches[bits])


# ---------------------------------------------------------------- the CLI


def test_cli_prefill_kv_bits_and_info_ls_verify_show_the_scheme(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(sample_text()[:1000], encoding="utf-8")
    r = run("prefill", doc, "--model", tiny_model_dir, "--kv-bits", "4", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["storage"] == "4-bit" and "4-bit" in r.stderr
    cache = tmp_path / "doc.kv"
    r = run("info", cache)
    assert r.exit_code == 0 and "4-bit" in r.stdout and "per channel" in r.stdout and "groups of 64" in r.stdout
    assert f"first {QUANT_EXACT[4]} and last {QUANT_RECENT[4]} tokens exact" in r.stdout
    info = json.loads(run("info", cache, "--json").stdout)
    assert info["storage"] == "4-bit" and info["compression"]["quant"]["bits"] == 4 and info["format_version"] == 3
    assert info["compression"]["quant"]["recent_tokens"] == QUANT_RECENT[4]
    r = run("verify", cache)
    assert r.exit_code == 0 and "4-bit" in r.stdout
    assert json.loads(run("verify", cache, "--json").stdout)["storage"] == "4-bit"
    r = run("ls", tmp_path)
    assert r.exit_code == 0 and "4-bit" in r.stdout
    assert json.loads(run("ls", tmp_path, "--json").stdout)[0]["storage"] == "4-bit"
    r = run("ask", "--cache", cache, "Who is the licensor?", "--max-new-tokens", "3")
    assert r.exit_code == 0 and r.stdout.strip()
    assert_clean_error(run("prefill", doc, "--model", tiny_model_dir, "--kv-bits", "3", "-o", tmp_path / "y.kv"), 2, "--kv-bits")
