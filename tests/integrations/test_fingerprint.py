"""The weights fingerprint covers every weight (0.2 sampled 1,024 elements per tensor) and is remembered by the
identity of the model's files, so a warm start does not hash the weights again."""

from __future__ import annotations

import hashlib
import shutil

import torch

import kvcli
from kvcli.engine.model import fingerprint as fp
from tests.conftest import sample_text
from tests.helpers import assert_clean_error, run


def _sampled_sha256(model, samples: int = 1024) -> str:
    """0.2's fingerprint: a fixed sample of each tensor (kept here to show the edit below escapes it)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            k = min(samples, flat.numel())
            idx = torch.arange(k, dtype=torch.long) * (flat.numel() - 1) // max(k - 1, 1)
            h.update(f"{name}:{list(param.shape)}:".encode())
            h.update(flat[idx].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def test_a_weight_edit_outside_any_old_sample_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    doc = tmp_path / "doc.txt"
    doc.write_text(sample_text()[:600], encoding="utf-8")
    cache = tmp_path / "doc.kv"
    assert run("prefill", doc, "-o", cache, "--model", tiny_model_dir).exit_code == 0
    edited = tmp_path / "edited-model"
    shutil.copytree(tiny_model_dir, edited)
    model = AutoModelForCausalLM.from_pretrained(edited, dtype=torch.float32)
    before = _sampled_sha256(model)
    weight = model.get_input_embeddings().weight
    assert weight.numel() > 4096
    with torch.no_grad():
        weight.view(-1)[1] += 0.5  # element 1: between sample 0 and sample 1 (every ~numel/1023 elements)
    assert _sampled_sha256(model) == before  # 0.2's fingerprint cannot tell
    model.save_pretrained(edited)
    refused = run("ask", "--cache", cache, "What is licensed?", "--model", edited)
    assert_clean_error(refused, 3, "built for another model", "weights")
    assert run("ask", "--cache", cache, "What is licensed?", "--model", tiny_model_dir, "--max-new-tokens", "2").exit_code == 0


def test_the_fingerprint_is_remembered_by_file_identity(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    calls = []
    real = fp._hash_every_weight
    monkeypatch.setattr(fp, "_hash_every_weight", lambda m: calls.append(1) or real(m))
    first = kvcli.load(str(model_dir)).fingerprint["weights_sha256"]
    second = kvcli.load(str(model_dir)).fingerprint["weights_sha256"]
    assert first == second and len(calls) == 1  # the second load read the remembered value
    assert first == kvcli.load(str(tiny_model_dir)).fingerprint["weights_sha256"]  # the same weights elsewhere: the same value
    calls.clear()
    (model_dir / "model.safetensors").touch()  # another mtime: hashed again
    assert kvcli.load(str(model_dir)).fingerprint["weights_sha256"] == first and len(calls) == 1


def test_an_old_cache_is_refused_with_a_reason(tiny_lm, tmp_path):
    import json

    from kvcli.errors import CacheMismatchError
    from kvcli.documents import decode

    cache = tmp_path / "old.kv"
    kvcli.prefill(tiny_lm, decode(sample_text()[:300].encode(), "d.txt"), cache)
    manifest = cache / "manifest.json"
    body = json.loads(manifest.read_text())
    del body["model"]["weights_scheme"]
    body["model"]["weights_sha256"] = _sampled_sha256(tiny_lm.model)
    from kvcli.format.manifest import checksum

    body["manifest_sha256"] = checksum(body)
    manifest.write_text(json.dumps(body))
    try:
        kvcli.Session(tiny_lm, cache)
    except CacheMismatchError as exc:
        assert "covers only samples of the weights: rebuild it" in str(exc)
    else:
        raise AssertionError("a cache with 0.2's sampled fingerprint was used")
