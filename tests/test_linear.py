"""Batched steps multiply float32 linear layers weight-first (engine/model/linear.py): the same products,
within float32 rounding, through the kernel that is faster for a few rows; one row and other dtypes untouched."""

from __future__ import annotations

import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine.decoding import batch
from kvcli.engine.model import linear, stored
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
