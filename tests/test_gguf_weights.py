"""A GGUF file's own low-bit weights (--weights gguf, engine/model/gguf_weights.py): every 4-bit block type read
back exactly as gguf dequantizes it, the int4 kernel running those codes, and on the real default model: every
linear on the kernel nearest its type, the difference from the file measured and shown, a cache of this
arithmetic refused by the others, and --check measuring a cached answer against a recompute on the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvcli
from kvcli.engine.model import gguf_weights, stored
from kvcli.errors import CacheMismatchError, ModelError
from tests.conftest import SAMPLES
from tests.helpers import json_lines, run

QUESTION = "Who may grant a patent license under this license?"


def _q4k_bytes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks (gguf has no Q4_K quantizer): finite float16 d and dmin, any scale, min and code bytes."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.float16(rng.uniform(1e-3, 2e-2, size=(rows, cols // 256))).view(np.uint8).reshape(rows, -1, 2)
    blocks[..., 2:4] = np.float16(rng.uniform(1e-3, 2e-2, size=(rows, cols // 256))).view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_every_4bit_block_type_reads_back_as_gguf_dequantizes_it(kind):
    import gguf

    rows, cols = 48, 512
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        raw = _q4k_bytes(rows, cols)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32), qtype)
    codes, scale, add = gguf_weights.q4_codes(torch.from_numpy(raw.copy()), kind, rows, cols)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.shape == (rows, cols // 32)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols))
    assert torch.equal(stored.dequantize(codes, scale, add), expected)


def test_the_int4_kernel_runs_the_codes_with_bfloat16_scales():
    import gguf

    rows, cols = 64, 256
    raw = _q4k_bytes(rows, cols, seed=3)
    codes, scale, add = gguf_weights.q4_codes(torch.from_numpy(raw.copy()), "Q4_K", rows, cols)
    sz, runs = gguf_weights._scales_zeros(codes, scale, add)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    file_w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(rows, cols))
    # the kernel's weights differ from the file's only by the bfloat16 rounding of scale and zero
    assert float((runs - file_w).abs().max()) <= 2 ** -7 * float(file_w.abs().max()) * 4
    layer = stored.Q4Linear(packed, sz, cols, rows, None)
    x = torch.randn(3, cols, dtype=torch.bfloat16)
    ref = x.float() @ runs.t()
    assert torch.allclose(layer(x).float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.fixture(scope="module")
def gguf_lm(session_home):
    with pytest.MonkeyPatch.context() as mp:  # the module's loads keep their kernels where the session's models live
        mp.setenv("KVCLI_HOME", str(session_home))
        yield kvcli.load(weights="gguf")


def test_every_linear_runs_on_the_kernel_nearest_its_type_and_the_difference_is_recorded(gguf_lm):
    modules = dict(gguf_lm.model.named_modules())
    assert sum(isinstance(m, stored.Q4Linear) for m in modules.values()) == 7 * 30  # the file's Q4_1 layers
    assert isinstance(gguf_lm.model.get_output_embeddings(), stored.Q8Linear)  # tied to the Q8_0 embedding
    assert not any(type(m) is torch.nn.Linear for m in modules.values())
    assert gguf_lm.weights == "gguf" and gguf_lm.fingerprint["dtype"] == "bfloat16"  # the kernels' activations
    error = gguf_lm.fingerprint["weights_error"]
    assert set(error) == {"Q4_1->int4", "Q8_0->int8"} and error["Q4_1->int4"]["layers"] == 210
    for e in error.values():  # bfloat16 scales (int4) or one scale a row (int8): within a few percent of the weights
        assert 0 < e["mean_abs"] < 0.05 * e["mean_weight"] and e["max_abs"] > 0


def test_a_second_load_reads_the_kept_kernel_tensors_and_runs_the_same_products(gguf_lm, session_home):
    (kept,) = (session_home / "models").glob("gguf-*-gguf/gguf-kernels.safetensors")
    stamp = kept.stat().st_mtime_ns
    again = kvcli.load(weights="gguf")
    assert kept.stat().st_mtime_ns == stamp  # read, not made again
    assert again.fingerprint["weights_error"] == gguf_lm.fingerprint["weights_error"]
    for name, width in (("model.layers.3.mlp.down_proj", 1536), ("lm_head", 576)):  # an int4 and an int8 layer
        x = torch.randn(2, width, dtype=torch.bfloat16)
        assert torch.equal(gguf_lm.model.get_submodule(name)(x), again.model.get_submodule(name)(x))


@pytest.fixture(scope="module")
def gguf_cache(gguf_lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "license.txt"
    path.write_text((SAMPLES / "document.txt").read_text()[:5000])
    out = path.with_suffix(".kv")
    kvcli.prefill(gguf_lm, kvcli.read_document(path), out)
    return out


def test_check_measures_a_cached_answer_against_a_recompute_on_the_same_weights(gguf_lm, gguf_cache):
    """--check recomputes the whole prompt on the same model (weights, dtype, kernels) and says how close the cached
    answer is: approximate, as bfloat16 activations make the cut between cache and question visible."""
    session = kvcli.Session(gguf_lm, gguf_cache)
    answer = session.ask(QUESTION, kvcli.GenerationOptions(max_new_tokens=24), check=True)
    check = answer.check
    assert check.weights == "gguf" and check.tokens == len(answer.answer_token_ids) > 0
    assert "gguf weights" in check.describe()
    assert check.agreement >= 0.8 and check.kl_mean < 0.05, check.describe()


def test_cli_asks_a_gguf_cache_on_its_own_weights_and_dtype(gguf_cache):
    result = run("ask", "--cache", gguf_cache, QUESTION, "--json", "--max-new-tokens", "8", "--no-server")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    assert a["answer"].strip() and a["cached_tokens"] > 800
    refused = run("ask", "--cache", gguf_cache, QUESTION, "--dtype", "float32", "--no-server")
    assert refused.exit_code == 3 and "dtype (cache bfloat16, model float32" in refused.stderr


def test_caches_of_the_gguf_arithmetic_are_refused_by_the_float_model(gguf_cache, default_lm):
    with pytest.raises(CacheMismatchError, match="weights .cache gguf, model float"):
        kvcli.Session(default_lm, gguf_cache)


def test_info_states_the_difference_from_the_file(gguf_cache):
    r = run("info", str(gguf_cache))
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "gguf (the GGUF file's own low-bit weights" in text
    assert "against the file: Q4_1->int4 210 layers, mean |diff|" in text
    r = run("info", str(gguf_cache), "--json")
    assert json.loads(r.stdout)["weights_error"]["Q8_0->int8"]["layers"] == 1


def test_a_folder_model_is_refused_before_any_weight_loads(tiny_model_dir):
    with pytest.raises(ModelError, match="--weights gguf runs a .gguf file's own low-bit weights"):
        kvcli.load(str(tiny_model_dir), weights="gguf")


TYPES = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q5_0", "gate_proj": "Q4_K",
         "up_proj": "Q6_K", "down_proj": "Q5_1", "lm_head": "F16"}


def _q6k_bytes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks (gguf has no Q6_K quantizer): any codes and 8-bit scales, a finite float16 d last."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = np.float16(rng.uniform(1e-4, 1e-3, size=(rows, cols // 256))).view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama and a GGUF file holding its linear layers in seven block types (and F16), the model's weights
    set to what the file dequantizes to, as transformers' GGUF loading gives them."""
    import gguf

    from tests.conftest import tiny_llama

    model = tiny_llama(320, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            kind = TYPES[name.rsplit(".", 1)[-1]]
            qtype = gguf.GGMLQuantizationType[kind]
            rows, cols = module.weight.shape
            if kind == "Q4_K":
                raw = _q4k_bytes(rows, cols, seed=rows + cols)
            elif kind == "Q6_K":
                raw = _q6k_bytes(rows, cols, seed=rows + cols)
            else:
                raw = gguf.quants.quantize(module.weight.numpy(), qtype)
            module.weight.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)))
            writer.add_tensor(f"{names.get_name(name)}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def test_each_block_type_runs_on_the_nearest_kernel_with_its_difference_measured(mixed_gguf, tmp_path):
    import copy

    model, path = mixed_gguf
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 320, (1, 12))
    report = gguf_weights.use_gguf(model, path, tmp_path / "kernels")
    assert set(report) == {"Q4_0->int4", "Q4_1->int4", "Q4_K->int4", "Q8_0->int8", "Q5_0->int8", "Q6_K->int8",
                           "Q5_1->int8", "F16->int8"}
    assert all(e["layers"] == (1 if k == "F16->int8" else 2) for k, e in report.items())
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in model.named_modules() if isinstance(m, (stored.Q4Linear, stored.Q8Linear))}
    assert kinds == {p: (stored.Q4Linear if TYPES[p].startswith("Q4") else stored.Q8Linear) for p in TYPES}
    for e in report.values():
        assert 0 < e["mean_abs"] < 0.05 * e["mean_weight"], report
    with torch.inference_mode():
        got, want = model(ids).logits.float(), reference(ids).logits
    assert torch.allclose(got, want, atol=0.1 * float(want.abs().max())), float((got - want).abs().max())
    # a second load reads the kept kernel tensors, not the file
    again = copy.deepcopy(reference)
    moved = path.rename(path.with_suffix(".moved"))
    assert gguf_weights.use_gguf(again, path, tmp_path / "kernels") == report
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, model(ids).logits)
    # kept tensors of the wrong shape are made again from the file, never handed to the kernels
    from safetensors.torch import load_file, save_file

    kept = tmp_path / "kernels" / "gguf-kernels.safetensors"
    tensors = load_file(kept)
    tensors["model.layers.0.mlp.up_proj.int8"] = tensors["model.layers.0.mlp.up_proj.int8"][:, :-32].contiguous()
    save_file(tensors, str(kept), metadata={"weights_error": json.dumps(report)})
    moved.rename(path)
    third = copy.deepcopy(reference)
    assert gguf_weights.use_gguf(third, path, tmp_path / "kernels") == report
    with torch.inference_mode():
        assert torch.equal(third(ids).logits, model(ids).logits)
