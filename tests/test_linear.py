"""Batched steps multiply float32 linear layers weight-first (engine/model/linear.py): the same products,
within float32 rounding, through the kernel that is faster for a few rows; one row and other dtypes untouched."""

from __future__ import annotations

import threading

import pytest
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


def _split(monkeypatch, block: int = 1000):
    monkeypatch.setattr(linear, "SPLIT_MIN", 1)  # every one-row product splits, in blocks of `block` weight elements
    monkeypatch.setattr(linear, "BLOCK", block)
    monkeypatch.setattr(linear, "_same_bits", {})  # no shape checked yet


@pytest.fixture
def one_thread():
    """One torch thread, as split_rows_helps requires of the kernel (a one-row product on one core): then the
    ROWS-aligned blocks give linear's bits. Where the kernel threads a one-row product they may not, and the
    per-shape check leaves the shape unsplit (test_a_shape_whose_split_gives_other_bits_stays_unsplit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_row_split_across_two_threads_gives_the_linear_bits(monkeypatch, one_thread):
    _split(monkeypatch)
    g = torch.Generator().manual_seed(1)
    for out_features, in_features, bias, lead in [(577, 96, False, (1,)), (1000, 64, True, (1, 1)), (49, 300, True, ()),
                                                  (3, 40, False, (1, 1, 1))]:
        w = torch.randn(out_features, in_features, generator=g)
        b = torch.randn(out_features, generator=g) if bias else None
        x = torch.randn(*lead, in_features, generator=g)
        want = torch.nn.functional.linear(x, w, b)
        with torch.inference_mode(), linear.split_rows():
            first = torch.nn.functional.linear(x, w, b)  # split, and checked against the whole product once
        with torch.inference_mode(), _Calls() as calls, linear.split_rows():
            got = torch.nn.functional.linear(x, w, b)
        assert ("addmm" if bias else "mm") in calls.names and "linear" not in calls.names
        assert got.shape == want.shape and torch.equal(got, want) and torch.equal(first, want)
    assert all(linear._same_bits.values())


def test_a_shape_whose_split_gives_other_bits_stays_unsplit(monkeypatch):
    _split(monkeypatch)
    w, x = torch.randn(80, 48), torch.randn(1, 48)
    monkeypatch.setattr(linear, "split_product", lambda x, w, b: torch.nn.functional.linear(x, w, b) + 1e-6)
    want = torch.nn.functional.linear(x, w)
    for _ in range(2):
        with torch.inference_mode(), linear.split_rows():
            assert torch.equal(torch.nn.functional.linear(x, w), want)
    assert linear._same_bits == {((80, 48), False): False}


def test_split_rows_leaves_other_products_to_torch(monkeypatch):
    _split(monkeypatch)
    w = torch.randn(80, 48)
    cases = [(torch.randn(2, 48), w, True), (torch.randn(1, 48).bfloat16(), w.bfloat16(), True),
             (torch.randn(1, 48), w, False), (torch.randn(1, 48), w.T.contiguous().T, True)]
    for x, weight, inference in cases:
        with torch.inference_mode(inference), _Calls() as calls, linear.split_rows():
            y = torch.nn.functional.linear(x, weight)
        assert calls.names.count("linear") == 1 and "mm" not in calls.names
        assert torch.equal(y, torch.nn.functional.linear(x, weight))
    monkeypatch.setattr(linear, "SPLIT_MIN", 80 * 48 + 1)  # a weight below SPLIT_MIN
    with torch.inference_mode(), _Calls() as calls, linear.split_rows():
        torch.nn.functional.linear(torch.randn(1, 48), w)
    assert calls.names.count("linear") == 1 and "mm" not in calls.names


class _Helper:
    """A stand-in for the helper thread: runs each job in a thread of its own after `start` (None: never)."""

    def __init__(self, start):
        self.start, self.threads = start, []
        self.jobs = self

    def put(self, job):
        if self.start is not None:
            self.threads.append(threading.Thread(target=lambda: (self.start.wait(), job())))
            self.threads[-1].start()


class _SlowInHelper:
    """linear's torch, whose mm stalls in the helper's thread until `release` (a helper preempted inside a
    block); the caller's first mm waits until the helper is inside its block."""

    def __init__(self, release):
        self.release, self.inside, self.helper_calls = release, threading.Event(), 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def mm(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            self.helper_calls += 1
            self.inside.set()
            self.release.wait(30)
        else:
            self.inside.wait(30)
        return torch.mm(*args, **kwargs)


def test_a_helper_that_never_runs_starts_late_or_stalls_leaves_its_blocks_to_the_caller(monkeypatch, one_thread):
    _split(monkeypatch)
    w, x = torch.randn(700, 50), torch.randn(1, 50)
    want = torch.nn.functional.linear(x, w)
    with torch.inference_mode():
        monkeypatch.setattr(linear, "_the_helper", lambda: _Helper(None))
        assert torch.equal(linear.split_product(x, w, None), want)

        late = _Helper(threading.Event())  # starts once the caller has returned: finds no block left
        monkeypatch.setattr(linear, "_the_helper", lambda: late)
        got = linear.split_product(x, w, None)
        late.start.set()
        late.threads[0].join()
        assert torch.equal(got, want)

        started, release = threading.Event(), threading.Event()
        stalled = _Helper(started)
        slow = _SlowInHelper(release)
        monkeypatch.setattr(linear, "_the_helper", lambda: stalled)
        monkeypatch.setattr(linear, "torch", slow)
        started.set()  # the helper claims a block and stalls in it until the caller has returned
        got = linear.split_product(x, w, None)
        release.set()
        stalled.threads[0].join()
    assert slow.helper_calls == 1 and torch.equal(got, want)  # its late block was computed by the caller, not copied over


def test_no_product_is_split_where_the_kernel_threads_a_one_row_product(monkeypatch):
    """A new thread after the helper's first product is an OpenMP pool of its own: one too many beside the
    engine's, so split_rows is not used, and found once per process."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for threads_after, helps in ((1, True), (2, False)):
        counts = iter([10, 10 + threads_after - 1])  # before the probe, after it
        monkeypatch.setattr(linear, "_one_core", None)
        monkeypatch.setattr(linear, "_threads", lambda: next(counts))
        released = []
        monkeypatch.setattr(linear.openmp, "release", lambda: released.append(True))
        assert linear.split_rows_helps(model) is helps
        assert linear.split_rows_helps(model) is helps  # found once: _threads is not read again
        assert released == ([] if helps else [True])


def test_the_pool_beside_is_made_once_and_given_back_once(monkeypatch):
    released = []
    real = linear.openmp.release
    monkeypatch.setattr(linear.openmp, "release", lambda: released.append(1) or real())
    monkeypatch.setattr(linear, "_pool_on", False)
    for on in (True, True, False, False):
        linear.pool_beside(on)
    assert released == [1] and linear._pool_on is False
