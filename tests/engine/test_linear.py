"""engine/model/linear.py: batched steps multiply float32 linear layers weight-first (the same products, within
float32 rounding, through the kernel that is faster for a few rows); one row's products split into parts across
the threads give torch's own bits; other dtypes are untouched."""

from __future__ import annotations

import threading

import pytest
import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine.decoding import batch
from kvcli.engine.model import linear, openmp, stored
from kvcli.engine.model.cpu import CpuTuning
from tests.conftest import sample_text, tiny_llama


class _Calls(torch.overrides.TorchFunctionMode):
    """Records the names of the torch functions called under it (entered outside weight_first, it sees what
    the mode turned a linear into)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_rows_run_weight_first_and_give_the_linear_products():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    x = torch.randn(2, 5, 48, generator=g)
    with torch.inference_mode(), _Calls() as calls, linear.weight_first():
        y = layer(x)
    assert "mm" in calls.names and "linear" not in calls.names
    assert y.shape == (2, 5, 80) and y.is_contiguous()
    assert torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
    no_bias = torch.nn.Linear(48, 80, bias=False)
    with torch.inference_mode(), linear.weight_first():
        assert torch.allclose(no_bias(x), x @ no_bias.weight.T, rtol=1e-5, atol=1e-6)


def test_one_row_other_dtypes_and_a_disabled_mode_keep_torchs_linear():
    cases = [(torch.nn.Linear(48, 80), torch.randn(1, 1, 48), True),
             (torch.nn.Linear(48, 80).to(torch.bfloat16), torch.randn(3, 48).bfloat16(), True),
             (torch.nn.Linear(48, 80), torch.randn(3, 48), False)]
    for module, x, enabled in cases:
        with torch.inference_mode(), _Calls() as calls, linear.weight_first(enabled):
            y = module(x)
        assert calls.names.count("linear") == 1 and "mm" not in calls.names
        assert torch.equal(y, torch.nn.functional.linear(x, module.weight, module.bias))
    layer, x = torch.nn.Linear(48, 80), torch.randn(3, 48)  # input and weight given by keyword: passed on as they are
    with torch.inference_mode(), linear.weight_first():
        y = torch.nn.functional.linear(input=x, weight=layer.weight, bias=layer.bias)
    assert torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_only_models_with_float32_linear_layers_use_it(tokenizer):
    model = tiny_llama(len(tokenizer))
    assert linear.weight_first_helps(model)
    assert not linear.weight_first_helps(model.to(torch.bfloat16))
    q4_like = torch.nn.Sequential(stored.Bf16Linear(torch.randn(8, 4), None))  # a q4 model keeps no torch Linear
    assert not linear.weight_first_helps(q4_like)


def test_batched_forwards_run_in_the_mode(tokenizer, tmp_path, monkeypatch):
    lm = kvcli.from_objects(tiny_llama(len(tokenizer)), tokenizer)
    kvcli.prefill(lm, decode(sample_text()[:2000].encode(), "licence.txt"), tmp_path / "doc.kv")
    session = kvcli.Session(lm, tmp_path / "doc.kv")
    seen = []
    real = batch.weight_first
    monkeypatch.setattr(batch, "weight_first", lambda enabled=True: seen.append(enabled) or real(enabled))
    opts = kvcli.GenerationOptions(max_new_tokens=4)
    questions = ["Who?", "What is a Licensor?"]
    many = session.ask_many(questions, opts, batch_size=2)
    assert seen and all(seen)
    assert [a.answer_token_ids for a in many] == [session.ask(q, opts).answer_token_ids for q in questions]


def _split(monkeypatch) -> dict:
    """Every one-row product whose rows cut into parts splits; the record of shapes checked, empty."""
    monkeypatch.setattr(linear, "SPLIT_MIN", 1)
    return {}


@pytest.fixture
def two_threads():
    """Two torch threads (the suite's workers run one: conftest), for the parts to spread over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_rows_are_cut_into_the_evenest_parts_of_whole_blocks():
    assert [linear.parts(n, 2) for n in (576, 192, 1536, 49152, 128)] == [2, 2, 2, 2, 2]  # the default model's
    assert [linear.parts(n, 2, rows=64) for n in (576, 192, 1536, 49152, 128)] == [9, 3, 2, 2, 2]
    assert linear.parts(576, 4, rows=64) == 3 and linear.parts(1536, 4) == 4 and linear.parts(1536, 3) == 3
    assert [linear.parts(n, 2, rows=64) for n in (64, 100, 577)] == [1, 1, 1]  # one block, or rows off the blocks
    assert [linear.parts(n, 2) for n in (32, 100, 577)] == [1, 1, 1]
    assert linear.parts(1536, 1) == 1
    assert linear.parts(96, 2, rows=32) == 3


def _layer(weight: torch.Tensor, bias: torch.Tensor | None = None) -> linear.SplitLinear:
    plain = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    plain.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        plain.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear.SplitLinear(plain)


def test_one_row_split_across_threads_gives_the_linear_bits(monkeypatch, two_threads):
    bits = _split(monkeypatch)
    g = torch.Generator().manual_seed(1)
    for out_features, in_features, bias, lead in [(576, 96, False, (1,)), (1024, 64, True, (1, 1)), (192, 300, True, ()),
                                                  (128, 40, False, (1, 1, 1))]:
        w = torch.randn(out_features, in_features, generator=g)
        b = torch.randn(out_features, generator=g) if bias else None
        x = torch.randn(*lead, in_features, generator=g)
        layer = _layer(w, b)
        want = torch.nn.functional.linear(x, w, b)
        with torch.inference_mode(), linear.split_rows(bits):
            first = layer(x)  # split, and checked against the whole product once
        with torch.inference_mode(), _Calls() as calls, linear.split_rows(bits):
            got = layer(x)
        assert ("baddbmm" if bias else "bmm") in calls.names and "linear" not in calls.names
        assert got.shape == want.shape and torch.equal(got, want) and torch.equal(first, want)
    assert len(bits) == 4 and all(bits.values())


def test_a_shape_whose_split_gives_other_bits_stays_unsplit(monkeypatch, two_threads):
    bits = _split(monkeypatch)
    w, x = torch.randn(128, 48), torch.randn(1, 48)
    monkeypatch.setattr(linear, "split_product", lambda x, w, b, cut: torch.nn.functional.linear(x, w, b) + 1e-6)
    want = torch.nn.functional.linear(x, w)
    for _ in range(2):
        with torch.inference_mode(), linear.split_rows(bits):
            assert torch.equal(_layer(w)(x), want)
    assert bits == {((128, 48), False): False}


def test_split_rows_leaves_other_products_to_torch(monkeypatch, two_threads):
    bits = _split(monkeypatch)
    w = torch.randn(128, 48)
    cases = [(torch.randn(2, 48), w, True, True), (torch.randn(1, 48).bfloat16(), w.bfloat16(), True, True),
             (torch.randn(1, 48), w, False, True), (torch.randn(1, 48), w.T.contiguous().T, True, True),
             (torch.randn(1, 48), torch.randn(100, 48), True, True),  # rows that cut into no whole blocks
             (torch.randn(1, 48), w, True, False)]  # outside split_rows
    for x, weight, inference, inside in cases:
        with torch.inference_mode(inference), _Calls() as calls, linear.split_rows(bits if inside else None):
            y = _layer(weight)(x)
        assert calls.names.count("linear") == 1 and "bmm" not in calls.names
        assert torch.equal(y, torch.nn.functional.linear(x, weight))
    monkeypatch.setattr(linear, "SPLIT_MIN", 128 * 48 + 1)  # a weight below SPLIT_MIN
    with torch.inference_mode(), _Calls() as calls, linear.split_rows(bits):
        _layer(w)(torch.randn(1, 48))
    assert calls.names.count("linear") == 1 and "bmm" not in calls.names
    torch.set_num_threads(1)  # one thread: nothing to spread the parts over
    with torch.inference_mode(), _Calls() as calls, linear.split_rows(bits):
        _layer(w)(torch.randn(1, 48))
    assert calls.names.count("linear") == 1 and "bmm" not in calls.names


def test_split_linears_share_the_parameters_and_apply_to_float32_models_on_several_threads(tokenizer, monkeypatch):
    model = tiny_llama(len(tokenizer)).eval()
    before = dict(model.named_parameters())
    x = torch.randint(0, len(tokenizer), (1, 12))
    with torch.inference_mode():
        want = model(x).logits
    linear.use_split_linears(model)
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {linear.SplitLinear} and not any(m.training for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == {n: p.data_ptr() for n, p in before.items()}
    with torch.inference_mode():
        assert torch.equal(model(x).logits, want)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert linear.split_rows_helps(model) and linear.pool_beside_helps(model)
    assert not linear.split_rows_helps(tiny_llama(len(tokenizer))) and linear.pool_beside_helps(model)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not linear.split_rows_helps(model) and not linear.pool_beside_helps(model)
    bf16 = tiny_llama(len(tokenizer)).to(torch.bfloat16)
    linear.use_split_linears(bf16)
    assert not any(isinstance(m, linear.SplitLinear) for m in bf16.modules())


def test_the_pool_beside_is_made_once_and_given_back_once_and_its_thread_ends_with_its_owner(monkeypatch):
    released = []
    real = openmp.release
    monkeypatch.setattr(openmp, "release", lambda: released.append(threading.current_thread().name) or real())
    before = {t.ident for t in threading.enumerate()}
    cpu = CpuTuning()
    for on in (True, True, False, False):
        cpu.pool_beside(on)
    assert released == ["kvcli-rows"]
    helpers = [t for t in threading.enumerate() if t.ident not in before and t.name == "kvcli-rows"]
    assert len(helpers) == 1
    cpu.close()
    helpers[0].join(30)
    assert not helpers[0].is_alive() and released == ["kvcli-rows", "kvcli-rows"]


def test_two_owners_keep_their_own_records(monkeypatch, two_threads):
    """Nothing process-wide: what one engine's tuning learned about a shape is not another's."""
    _split(monkeypatch)
    a, b = CpuTuning(), CpuTuning()
    layer, x = _layer(torch.randn(128, 48)), torch.randn(1, 48)
    with torch.inference_mode(), a.split_rows():
        layer(x)
    with torch.inference_mode(), b.split_rows(False):
        layer(x)
    assert a.same_bits == {((128, 48), False): True} and b.same_bits == {}


def test_a_callers_model_is_not_rewritten(tokenizer):
    model = tiny_llama(len(tokenizer))
    kinds = {name: type(m) for name, m in model.named_modules()}
    kvcli.from_objects(model, tokenizer)
    assert {name: type(m) for name, m in model.named_modules()} == kinds
    assert not any(isinstance(m, linear.SplitLinear) for m in model.modules())
