"""A safetensors folder's `--weights q8/q4` quantized layer by layer as it loads (engine/model/quantize_load.py): the
same layers, codes, logits and fingerprint as loading the float model and quantizing it, never a float model on the
way (checked under a memory cap in a subprocess), and a folder that would not fit refused up front."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcli
from kvcli.engine.model import memory, quantize_load
from kvcli.engine.model.fingerprint import weights_sha256
from kvcli.engine.model.memory import ModelTooLargeError
from tests.conftest import tiny_llama
from tests.helpers import assert_clean_error, REPO, run


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Tiny llama folders: tied embeddings; untied with attention biases, sharded in two files."""
    base = tmp_path_factory.mktemp("quantize-load")
    made = {}
    for name, kwargs, shard in (("tied", {}, None), ("untied", {"tie_word_embeddings": False, "attention_bias": True}, "200KB")):
        folder = base / name
        model = tiny_llama(len(tokenizer), seed=3, **kwargs)
        model.generation_config.eos_token_id = [2, 5]  # stop ids beyond the config's, read from generation_config.json
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        tokenizer.save_pretrained(folder)
        made[name] = folder
    assert quantize_load.safetensors_files(made["untied"]) and len(quantize_load.safetensors_files(made["untied"])) > 1
    return made


@pytest.mark.parametrize("mode", ["q8", "q4"])
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_layer_by_layer_gives_the_float_models_quantized_layers_bit_for_bit(folders, which, mode, monkeypatch, tmp_path):
    held = []
    make = quantize_load._make_linear

    def watched(model, name, module, values, *rest):
        held.append(len(values))  # float tensors waiting for their layer: this layer's weight and bias at most
        return make(model, name, module, values, *rest)

    monkeypatch.setattr(quantize_load, "_make_linear", watched)
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path / "a"))
    streamed = kvcli.load(str(folders[which]), weights=mode)
    assert held and max(held) <= 2
    monkeypatch.setattr(quantize_load, "load", lambda *a, **k: None)  # the float model, then stored.use
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path / "b"))  # nothing remembered: each fingerprint computed anew
    floated = kvcli.load(str(folders[which]), weights=mode)
    a, b = streamed.model.state_dict(), floated.model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert {n: type(m) for n, m in streamed.model.named_modules()} == {n: type(m) for n, m in floated.model.named_modules()}
    assert streamed.fingerprint == floated.fingerprint and streamed.weights == mode
    assert streamed.model.generation_config.eos_token_id == floated.model.generation_config.eos_token_id == [2, 5]
    ids = torch.tensor([[1, 2, 3, 400, 500, 7]])
    with torch.inference_mode():
        assert torch.equal(streamed.model(ids).logits, floated.model(ids).logits)


def test_the_streamed_fingerprint_is_the_float_weights(folders, monkeypatch, tmp_path):
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path))
    lm = kvcli.load(str(folders["untied"]), weights="q8")
    float_lm = kvcli.load(str(folders["untied"]))  # float: remembered from the q8 load by the files' identity
    assert lm.fingerprint["weights_sha256"] == weights_sha256(float_lm.model) == float_lm.fingerprint["weights_sha256"]


def test_a_checkpoint_with_other_names_loads_the_float_way(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    folder.mkdir()
    for f in folders["tied"].iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folders["tied"] / "model.safetensors")
    save_file({k.replace("model.", "model.x.", 1) if "norm" in k else k: v for k, v in tensors.items()}, folder / "model.safetensors")
    config = kvcli.load(str(folders["tied"])).model.config
    assert quantize_load.load(config, torch.float32, [folder / "model.safetensors"], "q8") is None
    config.quantization_config = {"quant_method": "fp8"}  # stored quantized: transformers' quantizer's to read
    assert quantize_load.load(config, torch.float32, quantize_load.safetensors_files(folders["tied"]), "q8") is None


PEAK = r"""
import sys
import torch
torch.set_num_threads(1)
import kvcli
from kvcli.engine.model import models, quantize_load  # noqa: F401  (imported before the peak is read)
import transformers.models.llama.modeling_llama  # noqa: F401
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1])  # the tokenizer's own memory, before the peak is read
def kb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
base = kb("VmRSS:")
lm = kvcli.load(sys.argv[1], weights=sys.argv[2])
print((kb("VmHWM:") - base) * 1024)
"""


def _peak(folder: Path, mode: str, env: dict) -> int:
    done = subprocess.run([sys.executable, "-c", PEAK, str(folder), mode], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


def test_q8_and_q4_never_make_the_float_model(tokenizer, tmp_path):
    """A folder whose float32 weights are mostly linear layers (small vocabulary), stored in bfloat16: the peak memory
    a q8 or q4 load adds stays under half the float model, while a float load (the control) adds the whole of it."""
    folder = tmp_path / "wide"
    model = tiny_llama(256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=8,
                       num_key_value_heads=8).to(torch.bfloat16)
    float_bytes = sum(p.numel() for p in model.parameters()) * 4
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    # A fixed mmap threshold: glibc's moving one keeps some freed layer buffers in the heap, which swung the q8 peak
    # from 150 to 203 MB between runs; fixed, every large buffer goes back as it is freed (q8 146 MB, q4 114 MB).
    env = {**os.environ, "KVCLI_HOME": str(tmp_path / "home"), "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
           "OMP_NUM_THREADS": "1"}
    assert _peak(folder, "float", env) > float_bytes
    for mode in ("q8", "q4"):
        assert _peak(folder, mode, env) < float_bytes // 2, mode


def test_a_folder_that_will_not_fit_is_refused_with_the_size_and_the_mode_that_fits(folders):
    shapes = quantize_load.tensor_shapes(quantize_load.safetensors_files(folders["untied"]))
    need = {m: memory.folder_needed(shapes, m, 4) for m in ("float", "q8", "q4")}
    assert need["float"] > max(need["q8"], need["q4"])  # (q4 keeps the output layer in bfloat16: more than q8 here)
    with pytest.raises(ModelTooLargeError) as got:
        kvcli.load(str(folders["untied"]), available=lambda: (max(need["q8"], need["q4"]) + need["float"]) // 2)
    assert "--weights float" in str(got.value) and "--weights q8 runs it" in got.value.hint
    with pytest.raises(ModelTooLargeError) as got:
        kvcli.load(str(folders["untied"]), weights="q8", available=lambda: need["q8"] - 1)
    assert str(folders["untied"]) in str(got.value) and "smaller model" in got.value.hint
    wide = {"model.layers.0.mlp.up_proj.weight": ("F32", [4096, 4096])}  # linear weights only: q4 smaller than q8
    with pytest.raises(ModelTooLargeError) as got:
        memory.check_folder_fits(folders["untied"], wide, "q8", 4, lambda: memory.folder_needed(wide, "q4", 4))
    assert "--weights q4 runs it" in got.value.hint


def test_cli_refuses_a_folder_that_will_not_fit(folders, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The licensor is Example Corp. The term is two years.\n")
    monkeypatch.setattr(memory, "available", lambda: 1 << 20)
    result = run("prefill", doc, "--model", folders["tied"], "--weights", "q8", "--no-server", "--quiet")
    assert_clean_error(result, 1, "needs about", "--weights q8")
    assert not (tmp_path / "doc.kv").exists()
