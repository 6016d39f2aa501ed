"""kvcli's grouped-query attention (engine/model/attention.py): registered through transformers'
AttentionInterface, selected per model (never through the environment), and giving the same logits
and tokens as transformers' sdpa on every architecture kvcli supports."""

from __future__ import annotations

import os

import pytest
import torch

import kvcli
from kvcli.engine.model import attention
from kvcli.engine.cache.kvcache import KVCache
from tests.conftest import sample_text
from tests.architectures import ARCHS, build


def _run(model, ids: list[int], split: int):
    """Chunked prefill of ids[:split] into a KVCache, then the rest as one masked forward; and greedy generate()."""
    with torch.inference_mode():
        cache = KVCache.for_model(model.config)
        for start in range(0, split, 56):
            model(input_ids=torch.tensor([ids[start : min(start + 56, split)]]), cache=cache, use_cache=True)
        logits = model(input_ids=torch.tensor([ids[split:]]), cache=cache, use_cache=True).logits
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=8, do_sample=False)
    return logits, out


@pytest.mark.parametrize("name", list(ARCHS))
def test_same_logits_and_tokens_as_sdpa(tokenizer, plain_tokenizer, monkeypatch, name):
    tok = plain_tokenizer if ARCHS[name][1] else tokenizer
    model = build(name, tok)
    ids = tok(sample_text()[:1500])["input_ids"][:300]
    before = model.config._attn_implementation
    want = _run(model, ids, 280)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("enable_gqa", False)))
        return real(*args, **kwargs)

    env = dict(os.environ)
    lm = kvcli.from_objects(model, tok)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = _run(lm.model, ids, 280)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert dict(os.environ) == env  # no process-wide switch
    if before == "sdpa":
        assert model.config._attn_implementation == attention.NAME
        groups = model.config.num_attention_heads // (getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
        if groups > 1:
            assert (True, True) in calls  # masked attention ran on grouped heads without repeating them
    else:  # softcapping (gemma2) is not sdpa's: the model keeps its own eager attention, through kvcli's function
        assert before == "eager" and model.config._attn_implementation == attention.EAGER_NAME


def test_selection_is_per_model(tokenizer):
    from tests.conftest import tiny_llama

    chosen, other = tiny_llama(len(tokenizer)), tiny_llama(len(tokenizer))
    kvcli.from_objects(chosen, tokenizer)
    assert chosen.config._attn_implementation == attention.NAME
    assert other.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("window", [None, 10**6, 30])
def test_document_part_of_batched_attention_is_the_softmax_over_the_document(window):
    """Both ways the cascade attends to the shared document (torch's flash kernel when no window or softcap
    applies, plain products otherwise) give softmax(q k^T) v as float64 computes it, and its log-sum-exp."""
    from kvcli.engine.cache.shared import SharedPrefixLayer, Step

    g = torch.Generator().manual_seed(5)
    kv_heads, cached, dim, rows, rep = 2, 50, 8, 3, 2
    keys = torch.randn(1, kv_heads, cached + 7, dim, generator=g)[:, :, :cached]  # a view with room after, as restored
    values = torch.randn(1, kv_heads, cached + 7, dim, generator=g)[:, :, :cached]
    layer = SharedPrefixLayer(keys, values, cached, window, rows, 4)
    layer.step = Step(torch.arange(rows), torch.tensor([0, 2, 1]), None, 1)
    slots = layer.step.offsets[:, None]  # [rows, q=1]
    qp = torch.randn(kv_heads, rows * rep, dim, generator=g)
    o, m, s = attention._document_part(layer, qp, torch.float32, None, slots)
    assert bool((s == 1).all()) == (window is None)  # the flash kernel's output comes normalized
    scores = qp.double() @ keys[0].double().transpose(-1, -2)  # [kv_heads, rows*rep, cached]
    if window is not None:  # a row's query sits at position cached + slot and sees keys less than `window` before it
        pos = (cached + slots.repeat_interleave(rep, 0))[None, :, :]  # [1, rows*rep, 1]
        scores = scores.masked_fill((pos - torch.arange(cached)) >= window, float("-inf"))
    want = torch.softmax(scores, -1) @ values[0].double()
    assert torch.allclose((o / s).double(), want, atol=1e-6)
    assert torch.allclose((m + s.log()).double(), torch.logsumexp(scores, -1, keepdim=True), atol=1e-5)


needs_native = pytest.mark.skipif(__import__("kvcli.engine.model.kernels.native", fromlist=["level"]).level() == 0,
                                  reason="native kernels not built or CPU without AVX2/FMA/F16C")


def _one_row(dtype, heads, kv_heads, n, d, seed=0):
    """A decoding step's query [1, heads, 1, d] and keys/values [1, kv_heads, n, d]: views into longer buffers, as a
    KVCache's layers hand them over."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 1, d, generator=g).to(dtype)
    k = (torch.randn(1, kv_heads, n + 40, d, generator=g) * 3).to(dtype)[:, :, :n]
    v = torch.randn(1, kv_heads, n + 40, d, generator=g).to(dtype)[:, :, :n]
    return q, k, v


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,n,d", [(14, 2, 1, 64), (9, 3, 7, 64), (14, 2, 300, 64), (28, 4, 700, 128),
                                                (8, 8, 513, 80), (6, 1, 2100, 32)])
def test_native_one_row_attention_rounds_as_the_torch_path(dtype, heads, kv_heads, n, d):
    """The native kernel (kernels/_native.c) rounds where transformers' eager attention does (scores, scaled scores
    and probabilities in the dtype; softmax and sums in float32): its outputs are the torch path's but for a rare
    last bit from another order of the float32 sums, and the same on one thread and on two."""
    from kvcli.engine.model.kernels import native, torch_only

    q, k, v = _one_row(dtype, heads, kv_heads, n, d)
    with torch_only():
        want, _ = attention._one_row_attention(q, k, v, d**-0.5)
    got, _ = attention._one_row_attention(q, k, v, d**-0.5)
    assert got.shape == want.shape == (1, 1, heads, d) and got.dtype == dtype
    assert (got == want).float().mean().item() >= 0.99
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=ulp * 1e-2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.attend(q, k, v, d**-0.5)
        torch.set_num_threads(2)
        two = native.attend(q, k, v, d**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, got)


@needs_native
def test_native_one_row_attention_runs_only_what_it_was_written_for(monkeypatch):
    """float32 (the exact path), a batch of two, several query rows or a head size it does not take go to torch's
    products; called anyway, it refuses with a ValueError instead of reading out of bounds."""
    from kvcli.engine.model.kernels import native

    q, k, v = _one_row(torch.bfloat16, 4, 2, 50, 64)
    assert native.attends(q, k, v)
    others = [(q.float(), k.float(), v.float()), (q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)),
              (q.expand(-1, -1, 3, -1), k, v), (q[..., :60], k[..., :60], v[..., :60]), (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v),
              (q[:, :3], k, v)]
    for args in others:
        assert not native.attends(*args)
        with pytest.raises(ValueError, match="attend"):
            native.attend(*args, 0.125)
    calls = []
    monkeypatch.setattr(native, "attend", lambda *a: calls.append(a))
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert not attention._one_row_eager(q32, None, 0.0, {})  # float32 one-row steps keep the model's own attention
    out, _ = attention._one_row_attention(q32, k32, v32, 0.125)
    assert calls == [] and out.dtype == torch.float32


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_native_one_row_attention_spreads_a_bad_key_as_torch_does(bad):
    """A NaN key makes the rows of every query head that reads it NaN, and an infinite one those whose score it makes
    +inf, as torch's softmax does: never a plausible output from a broken state; heads reading other keys unharmed."""
    from kvcli.engine.model.kernels import torch_only

    q, k, v = _one_row(torch.bfloat16, 8, 2, 300, 64)
    k = k.clone()
    k[0, 1, 123, 5] = bad
    with torch_only():
        want, _ = attention._one_row_attention(q, k, v, 0.125)
    got, _ = attention._one_row_attention(q, k, v, 0.125)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert bool(torch.isnan(got[0, 0, 4:]).any()) and not bool(torch.isnan(got[0, 0, :4]).any())
    if bad != bad:
        assert bool(torch.isnan(got[0, 0, 4:]).all())
