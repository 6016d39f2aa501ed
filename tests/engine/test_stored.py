"""A GGUF model's 4-bit weights run as stored (--weights q4, engine/model/stored.py): the blocks read as gguf
reads them, the kernel's rows independent of each other, and on the real default model: every linear run from
its codes, --check reporting the (approximate) agreement, caches of one arithmetic refused by the other, `info`
saying which. Any model's weights quantized at load (--weights q8, and q4 without a GGUF), on tiny models."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import kvcli
from kvcli.engine.model import stored
from kvcli.errors import CacheMismatchError, ModelError
from tests.conftest import SAMPLES, reference_answer
from tests.helpers import json_lines, run

QUESTION = "Who may grant a patent license under this license?"


def q4_1_bytes(weights: np.ndarray) -> torch.Tensor:
    """gguf's own Q4_1 quantizer: [rows, cols] float32 -> bytes [rows, cols/32*20]."""
    import gguf

    return torch.from_numpy(gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1).copy())


def test_blocks_read_as_gguf_dequantizes_them():
    import gguf

    w = np.random.default_rng(0).standard_normal((96, 128)).astype(np.float32)
    raw = q4_1_bytes(w)
    codes, d, m = stored.q4_blocks(raw, 96, 128)
    assert codes.shape == (96, 128) and int(codes.max()) <= 15 and d.dtype == torch.float16
    expected = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(stored.dequantize(codes, d, m), torch.from_numpy(expected))


def _q4_linear(rows: int = 64, cols: int = 96, seed: int = 1) -> tuple[stored.Q4Linear, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    codes, d, m = stored.q4_blocks(q4_1_bytes(w), rows, cols)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    sz = torch.stack([d.float().t(), (m.float() + 8 * d.float()).t()], dim=-1).to(torch.bfloat16).contiguous()
    # the weights the kernel runs: the codes with bfloat16 scale and zero
    ref = ((codes.reshape(rows, -1, 32).float() - 8) * sz[..., 0].t().float()[..., None] + sz[..., 1].t().float()[..., None])
    return stored.Q4Linear(packed, sz, cols, rows, None), ref.reshape(rows, cols)


def test_q4_linear_computes_the_blocks_weights():
    layer, w = _q4_linear()
    x = torch.randn(2, 5, 96)
    y = layer(x)
    assert y.shape == (2, 5, 64) and y.dtype == torch.float32
    ref = x.to(torch.bfloat16).float() @ w.t()
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_q4_linear_rows_do_not_depend_on_each_other():
    """A prompt in chunks and in one pass give the same values only if every row's output is its own."""
    layer, _ = _q4_linear()
    x = torch.randn(70, 96)
    whole = layer(x)
    for a, b in ((0, 1), (3, 4), (5, 37), (37, 70), (0, 70)):
        assert torch.equal(layer(x[a:b]), whole[a:b]), (a, b)


def test_output_layer_multiplies_many_rows_in_float32_as_bfloat16_would():
    """From Bf16Linear.WIDE rows on, the output layer multiplies the same bfloat16 values in float32 (faster for
    batched questions): each row's result is the one-row bfloat16 kernel's, but for a rare last bit."""
    g = torch.Generator().manual_seed(3)
    layer = stored.Bf16Linear(torch.randn(300, 96, generator=g), torch.randn(300, generator=g))
    x = torch.randn(2, 4, 96, generator=g)  # 8 rows
    alone = torch.cat([layer(x.reshape(8, 96)[i : i + 1]) for i in range(8)]).view(2, 4, 300)
    assert layer._wide is None  # one row at a time never made the float32 copy
    together = layer(x)
    assert layer._wide is not None and together.shape == (2, 4, 300) and together.dtype == torch.float32
    ulp = 2.0 ** (torch.floor(torch.log2(alone.abs().clamp_min(1e-30))) - 7)  # bfloat16's spacing at each value
    assert bool(((together - alone).abs() <= ulp).all())
    assert (together != alone).float().mean() < 0.02
    ref = x.to(torch.bfloat16).double() @ layer.weight.double().t() + layer.bias.double()
    assert torch.allclose(together.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def q4_lm(session_home):
    old = os.environ.get("KVCLI_HOME")
    os.environ["KVCLI_HOME"] = str(session_home)
    try:
        yield kvcli.load(weights="q4")
    finally:
        if old is None:
            os.environ.pop("KVCLI_HOME", None)
        else:
            os.environ["KVCLI_HOME"] = old


def test_q4_load_runs_every_linear_from_its_codes_and_records_it(q4_lm):
    modules = dict(q4_lm.model.named_modules())
    q4 = [n for n, m in modules.items() if isinstance(m, stored.Q4Linear)]
    assert len(q4) == 7 * 30  # q, k, v, o, gate, up, down in each of 30 layers
    assert not any(type(m) is torch.nn.Linear for m in modules.values())
    assert isinstance(q4_lm.model.get_output_embeddings(), stored.Bf16Linear)
    assert q4_lm.source["weights"] == "q4" and q4_lm.fingerprint["weights"] == "q4"
    assert q4_lm.fingerprint["dtype"] == "float32"


@pytest.fixture(scope="module")
def short_document(tmp_path_factory):
    """The sample's first 5,000 characters (about 1,000 tokens): enough to answer from, quick to prefill."""
    path = tmp_path_factory.mktemp("q4doc") / "license.txt"
    path.write_text((SAMPLES / "document.txt").read_text()[:5000])
    return kvcli.read_document(path)


@pytest.fixture(scope="module")
def q4_cache(q4_lm, short_document, tmp_path_factory):
    out = tmp_path_factory.mktemp("q4") / "document.kv"
    kvcli.prefill(q4_lm, short_document, out)
    return out


def test_q4_check_reports_its_agreement_as_approximate(q4_lm, q4_cache):
    """Not token-exact (stored.py says why): --check measures how close, as for a lossy cache."""
    session = kvcli.Session(q4_lm, q4_cache)
    answer = session.ask(QUESTION, kvcli.GenerationOptions(max_new_tokens=24), check=True)
    check = answer.check
    assert check.weights == "q4" and check.tokens == len(answer.answer_token_ids) > 0
    assert "q4 weights" in check.describe() and "differences expected" in check.describe()
    # measured on the whole sample (8 questions, 64 tokens): agreement 0.984-1.0, mean KL at most 0.0015 nats
    assert check.agreement >= 0.8 and check.kl_mean < 0.05, check.describe()
    assert answer.answer_token_ids[0] == reference_answer(q4_lm.model, answer.prompt_token_ids, 1)[0]


def test_q4_questions_batch_under_bfloat16s_tolerance_and_stay_close_to_a_recompute(q4_lm, q4_cache):
    """A q4 model's linears compute in bfloat16, so its batching probe allows bfloat16's rounding (float32's
    found rows 0.44 off and decoded them one at a time, 2.3x slower for 8 questions); a row that missed the
    document or another row's tokens would still be off by whole units. Batched answers are approximate like
    every q4 answer: --check measures them."""
    from kvcli.engine.scheduling import probe

    assert stored.linear_dtype(q4_lm.model) == torch.bfloat16
    found = probe.probe(q4_lm.model)
    assert found.ok and 0 < found.max_diff < 3, found.reason
    assert "bfloat16" in found.reason
    questions = [QUESTION, "Who may grant a patent license?"]  # each check recomputes the document: two are enough
    answers = kvcli.Session(q4_lm, q4_cache).ask_many(questions, kvcli.GenerationOptions(max_new_tokens=12), check=True)
    assert {a.decoding for a in answers} == {"batched"}
    for a in answers:  # measured on the whole sample (8 questions, 64 tokens): agreement 0.969-1.0, mean KL 0.00085
        assert a.check.weights == "q4" and a.check.agreement >= 0.8 and a.check.kl_mean < 0.05, a.check.describe()


def test_caches_of_one_arithmetic_are_refused_by_the_other(q4_lm, q4_cache, default_lm, short_document, tmp_path):
    with pytest.raises(CacheMismatchError, match="weights .cache q4, model float"):
        kvcli.Session(default_lm, q4_cache)
    float_cache = tmp_path / "float.kv"
    kvcli.prefill(default_lm, short_document, float_cache)
    with pytest.raises(CacheMismatchError, match="weights .cache float, model q4"):
        kvcli.Session(q4_lm, float_cache)


def test_cli_asks_a_q4_cache_in_its_weights_and_info_says_which(q4_lm, q4_cache):
    result = run("ask", "--cache", q4_cache, QUESTION, "--json", "--max-new-tokens", "8", "--no-server")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    assert a["answer"].strip() and a["cached_tokens"] > 800
    info = run("info", q4_cache)
    assert info.exit_code == 0 and "q4 (the GGUF file's 4-bit weights as stored" in info.stdout
    assert json.loads(run("info", q4_cache, "--json").stdout)["weights"] == "q4"


def test_q4_weights_quantized_from_float_ones_stay_within_half_a_step():
    """A model without a GGUF file gets Q4_1-style blocks from its float weights: each weight within half a step."""
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(5))
    codes, d, m = stored.quantize_q4(w)
    assert codes.shape == (48, 96) and int(codes.max()) <= 15 and d.shape == m.shape == (48, 3)
    err = (stored.dequantize(codes, d, m) - w).abs().reshape(48, 3, 32)
    assert bool((err <= d.float()[..., None] / 2 + 1e-3).all()), float(err.max())


def test_q4_on_a_folder_model_quantizes_it_at_load(tiny_model_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document about licenses. " * 8)
    result = run("prefill", doc, "--model", tiny_model_dir, "--weights", "q4", "--no-server", "--quiet")
    assert result.exit_code == 0, result.stderr
    info = run("info", tmp_path / "doc.kv")
    assert info.exit_code == 0 and "q4 (4-bit weights in groups of 32, quantized at load" in info.stdout
    lm = kvcli.load(str(tiny_model_dir), weights="q4")
    modules = dict(lm.model.named_modules())
    assert sum(isinstance(m, stored.Q4Linear) for m in modules.values()) == 7 * 2  # every linear of the 2 layers
    assert isinstance(lm.model.get_output_embeddings(), stored.Bf16Linear)


def _q8_layer(rows: int = 64, cols: int = 96, seed: int = 2) -> tuple[stored.Q8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, bias = torch.randn(rows, cols, generator=g), torch.randn(rows, generator=g)
    return stored.Q8Linear(*stored.quantize_q8(w), bias), w


def test_q8_layer_stays_close_to_the_float_layer():
    """Symmetric int8 per output row: each weight within half a step of its row's scale, so an output within
    that over its row's inputs (plus bfloat16's rounding of inputs and outputs)."""
    layer, w = _q8_layer()
    assert layer.codes.dtype == torch.int8 and layer.scales.shape == (64,)
    step = layer.scales.float()[:, None]
    assert bool(((layer.codes.float() * step - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(4))
    exact = x @ w.t() + layer.bias
    for rows in (x[:1, :1], x):  # one row (the int8 kernel) and 15 (wide: float32 products of the same values)
        y = layer(rows)
        assert y.shape == (*rows.shape[:-1], 64) and y.dtype == torch.float32
        ref = exact[: rows.shape[0], : rows.shape[1]]
        bound = (x.abs()[: rows.shape[0], : rows.shape[1]].sum(-1, keepdim=True) * layer.scales.float() / 2
                 + 2e-2 * ref.abs() + 0.05)
        assert bool(((y - ref).abs() <= bound).all()), float((y - ref).abs().max())
        assert float((y - ref).abs().mean()) < 0.05 * float(ref.abs().mean())


def test_q8_rows_do_not_depend_on_each_other_and_both_paths_agree():
    """A prompt in chunks and in one pass: each row's output is its own on either path, and the wide path's
    float32 products of the same bfloat16 values round to the kernel's results but for a rare last bit."""
    layer, _ = _q8_layer()
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(6))
    whole = layer(x)  # wide
    for a, b in ((0, 17), (17, 40), (5, 37)):
        assert torch.equal(layer(x[a:b]), whole[a:b]), (a, b)
    narrow = torch.cat([layer(x[i : i + 1]) for i in range(40)])  # the int8 kernel, one row at a time
    assert torch.equal(torch.cat([layer(x[i : i + 8]) for i in range(0, 40, 8)]), narrow)
    ulp = 2.0 ** (torch.floor(torch.log2((narrow - layer.bias).abs().clamp_min(1e-30))) - 7)
    assert bool(((whole - narrow).abs() <= ulp + 1e-6).all())
    assert (whole != narrow).float().mean() < 0.05


@pytest.fixture(scope="module")
def q8_tiny(tiny_model_dir):
    return kvcli.load(str(tiny_model_dir), weights="q8")


@pytest.fixture(scope="module")
def tiny_document(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8doc") / "doc.txt"
    path.write_text((SAMPLES / "document.txt").read_text()[:1200])
    return path


def test_q8_load_replaces_every_linear_and_records_it(q8_tiny):
    modules = dict(q8_tiny.model.named_modules())
    assert sum(isinstance(m, stored.Q8Linear) for m in modules.values()) == 7 * 2 + 1  # and the output layer
    assert not any(type(m) is torch.nn.Linear for m in modules.values())
    assert q8_tiny.weights == "q8" and q8_tiny.source["weights"] == "q8"
    assert stored.linear_dtype(q8_tiny.model) == torch.bfloat16


def test_q8_caches_and_float_caches_are_refused_by_the_other(q8_tiny, tiny_model_dir, tiny_document, tmp_path):
    doc = kvcli.read_document(tiny_document)
    q8_cache, float_cache = tmp_path / "q8.kv", tmp_path / "float.kv"
    kvcli.prefill(q8_tiny, doc, q8_cache)
    float_lm = kvcli.load(str(tiny_model_dir))
    kvcli.prefill(float_lm, doc, float_cache)
    with pytest.raises(CacheMismatchError, match="weights .cache q8, model float"):
        kvcli.Session(float_lm, q8_cache)
    with pytest.raises(CacheMismatchError, match="weights .cache float, model q8"):
        kvcli.Session(q8_tiny, float_cache)


def test_cli_prefills_q8_asks_it_in_its_weights_and_checks_the_agreement(tiny_model_dir, tiny_document, tmp_path):
    cache = tmp_path / "doc.kv"
    made = run("prefill", tiny_document, "-o", cache, "--model", tiny_model_dir, "--weights", "q8", "--no-server", "--quiet")
    assert made.exit_code == 0, made.stderr
    info = run("info", cache)
    assert info.exit_code == 0 and "q8 (int8 weights per output channel" in info.stdout
    assert json.loads(run("info", cache, "--json").stdout)["weights"] == "q8"
    # ask loads the model the cache's way by itself (no --weights), and --check says it is approximate
    asked = run("ask", "--cache", cache, "Who is the Licensor?", "--max-new-tokens", "8", "--check", "--json",
                "--no-server")
    assert asked.exit_code in (0, 4), asked.stderr
    (a,) = json_lines(asked.stdout)
    assert a["check"]["weights"] == "q8" and a["check"]["tokens"] == len(a["answer_token_ids"]) > 0
    assert 0 <= a["check"]["agreement"] <= 1 and a["check"]["kl_mean"] >= 0
    plain = run("ask", "--cache", cache, "Who is the Licensor?", "--max-new-tokens", "4", "--check", "--no-server")
    assert plain.exit_code in (0, 4) and "q8 weights" in plain.stderr and "differences expected" in plain.stderr


def test_q8_questions_batch_under_bfloat16s_tolerance(q8_tiny):
    from kvcli.engine.scheduling import probe

    found = probe.probe(q8_tiny.model)
    assert found.ok and "bfloat16" in found.reason, found.reason


def test_bench_measures_the_q8_weights_and_says_so(q8_tiny, tiny_document, tmp_path):
    from rich.console import Console

    from kvcli import bench

    result = bench.run(q8_tiny, kvcli.read_document(tiny_document), tokens=[128], questions=1, chunk_size=64,
                       workdir=tmp_path, answer_tokens=4)
    assert result["weights"] == "q8"
    console = Console(record=True, width=200)
    console.print(bench.render(result))
    assert "float32, q8 weights" in " ".join(console.export_text().split())  # the title wraps over a narrow table


def test_help_names_the_weights_modes():
    import re

    for command in ("prefill", "bench"):
        text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", run(command, "--help").stdout).split())
        assert "--weights <float|q8|q4|gguf>" in text, command
        assert "gguf (the default for a .gguf file): the file's own low-bit weights" in text, command
        assert "q8: any model's weights as int8 per output channel" in text, command


def test_codes_that_do_not_give_back_the_weights_stop_the_load(default_lm):
    """The check that guards the row order and block layout: one weight off and the load refuses."""
    import copy

    from kvcli.engine.model.models import default_gguf_path

    model = copy.deepcopy(default_lm.model)  # weights in memory, not the shared model's mapped file
    with torch.inference_mode():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] += 1
    with pytest.raises(ModelError, match="blk.0.attn_q.weight does not give back the weights"):
        stored.stored_blocks(model, default_gguf_path())


def test_what_is_remembered_per_model_keeps_the_two_arithmetics_apart(q4_lm, default_lm):
    """The batching probe's verdict and the prefill speed records are kept per model on disk: a q4 model's
    must not be read for the float one (its probe finds batched rows inexact; the float model's does not)."""
    from kvcli.engine import throughput
    from kvcli.engine.scheduling import probe

    assert probe.disk_key(q4_lm) != probe.disk_key(default_lm)
    assert throughput.model_key(q4_lm.source) != throughput.model_key(default_lm.source)
    assert throughput.model_key(default_lm.source) == f"sha256:{default_lm.source['sha256']}"  # float: as before



def test_bench_measures_the_q4_weights_and_says_so(q4_lm, tmp_path):
    from rich.console import Console

    from kvcli import bench
    from kvcli.documents import decode

    doc = decode((SAMPLES / "document.txt").read_bytes()[:1500], "doc.txt")
    result = bench.run(q4_lm, doc, tokens=[128], questions=1, chunk_size=64, workdir=tmp_path, answer_tokens=4)
    assert result["weights"] == "q4" and result["sizes"][0]["restore_s"] > 0
    console = Console(record=True, width=200)
    console.print(bench.render(result))
    assert "float32, q4 weights" in " ".join(console.export_text().split())  # the title wraps to the table's width


def test_a_served_q4_cache_is_answered_on_q4_weights(q4_lm, q4_cache, monkeypatch):
    """The warm server loads the model the way the cache records (its source's weights), as `ask` does alone."""
    from tests.serve_helpers import ThreadServer, short_dir

    server = ThreadServer(short_dir() / "s.sock")
    monkeypatch.setenv("KVCLI_SOCKET", str(server.path))
    try:
        served = run("ask", "--cache", q4_cache, QUESTION, "--json", "--max-new-tokens", "6", "--server")
        assert served.exit_code == 0, served.stderr
        (a,) = json_lines(served.stdout)
        alone = kvcli.Session(q4_lm, q4_cache).ask(QUESTION, kvcli.GenerationOptions(max_new_tokens=6))
        assert a["answer_token_ids"] == alone.answer_token_ids
        (model,) = server.server.warm.status()["models"]  # `kvcli ps --json` shows the same rows
        assert model["weights"] == "q4" and model["name"] == "SmolLM2-135M-Instruct"
    finally:
        server.close()


@pytest.mark.parametrize("mode, source, device, needle", [
    ("q2", {"kind": "default"}, "cpu", "--weights q2: choose float, q8, q4 or gguf"),
    ("gguf", {"kind": "folder", "name": "m"}, "cpu", "--weights gguf runs a .gguf file's own low-bit weights, and m is not one"),
    ("gguf", {"kind": "gguf"}, "cuda", "runs on the CPU only .torch.s packed int4 and int8 kernel"),
    ("q4", {"kind": "default"}, "cuda", "runs on the CPU only .torch.s packed int4 kernel"),
    ("q8", {"kind": "folder", "name": "m"}, "cuda", "runs on the CPU only .torch.s packed int8 kernel"),
])
def test_a_weights_mode_that_cannot_run_is_refused_before_any_weight_loads(mode, source, device, needle):
    with pytest.raises(ModelError, match=needle):
        stored.check_mode(mode, source, device)
    stored.check_mode("float", source, device)  # float runs anywhere
