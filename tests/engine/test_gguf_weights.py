"""A GGUF file's own low-bit weights (--weights gguf, the default for a .gguf file; engine/model/gguf_weights.py):
streamed from the mapped file into the kernels' layers, tensor by tensor, with no float32 model ever made (checked
under a memory cap in a subprocess); the prepared tensors kept once per file and layout version, reused, rebuilt
when damaged; bad files refused as model errors naming the file; a model that will not fit refused up front."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcli
from kvcli.engine.model import gguf_model, gguf_weights, kernels, models
from kvcli.engine.model.memory import ModelTooLargeError
from kvcli.errors import CacheMismatchError, ModelError
from tests.conftest import SAMPLES
from tests.helpers import assert_clean_error, json_lines, REPO, run

QUESTION = "Who may grant a patent license under this license?"
# the tiny file's linear layers: several block types, two of them (Q4_K, Q6_K) without a gguf-py quantizer
TYPES = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q5_0", "gate_proj": "Q4_K",
         "up_proj": "Q6_K", "down_proj": "Q5_1"}
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 1536, 512, 4, 2, 2


def _k_bytes(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K or Q6_K blocks (gguf has no quantizer for them): any codes and scales, finite float16 d (and dmin)."""
    rng = np.random.default_rng(seed)
    size = 144 if kind == "Q4_K" else 210
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    half = lambda lo, hi: np.float16(rng.uniform(lo, hi, size=(rows, cols // 256))).view(np.uint8).reshape(rows, -1, 2)  # noqa: E731
    if kind == "Q4_K":
        blocks[..., 0:2], blocks[..., 2:4] = half(1e-4, 1e-3), half(1e-4, 1e-3)
    else:
        blocks[..., 208:210] = half(1e-5, 1e-4)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer llama GGUF (the default model's tokenizer and vocabulary, hidden 1536: its float32 weights are
    ~600 MB, the file ~150 MB), every tensor written one at a time with gguf-py."""
    import gguf

    default = gguf.GGUFReader(str(models.default_gguf_path()))
    vocab = len(default.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(8192)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key, field in default.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (kv, HIDDEN), "v_proj": (kv, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
              "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN), "down_proj": (HIDDEN, FFN)}

    def add(name: str, values: np.ndarray | None, kind: str, shape: tuple[int, ...]) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("Q4_K", "Q6_K"):
            raw = _k_bytes(kind, *shape, seed=len(name))
        elif kind == "F32":
            raw = values.astype(np.float32)
        else:
            raw = gguf.quants.quantize(values.astype(np.float32), qtype)
        writer.add_tensor(name, raw, raw_dtype=None if kind == "F32" else qtype)

    add("token_embd.weight", rng.standard_normal((vocab, HIDDEN), dtype=np.float32) * 0.5, "Q8_0", (vocab, HIDDEN))
    add("output.weight", None, "Q6_K", (vocab, HIDDEN))
    add("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN), "F32", (HIDDEN,))
    for i in range(LAYERS):
        for part, kind in TYPES.items():
            add(f"{names.get_name(f'model.layers.{i}.{_where(part)}.{part}')}.weight",
                rng.standard_normal(shapes[part], dtype=np.float32) * 0.05, kind, shapes[part])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            add(f"{names.get_name(f'model.layers.{i}.{norm}')}.weight", rng.uniform(0.5, 1.5, HIDDEN), "F32", (HIDDEN,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _where(part: str) -> str:
    return "self_attn" if part.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def _packed(lm) -> dict[str, str]:
    return {n: m.kind for n, m in lm.model.named_modules() if isinstance(m, (kernels.PackedLinear, kernels.PackedEmbedding))}


def test_a_gguf_file_runs_its_own_blocks_by_default_with_no_float_weight(tiny_gguf):
    lm = kvcli.load(str(tiny_gguf))
    assert lm.weights == "gguf" and lm.dtype == torch.bfloat16
    packed = _packed(lm)
    assert packed["model.embed_tokens"] == "Q8_0" and packed["lm_head"] == "Q6_K"
    for part, kind in TYPES.items():
        assert packed[f"model.layers.1.{_where(part)}.{part}"] == kind
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in lm.model.modules())
    assert all(p.numel() <= HIDDEN for p in lm.model.parameters())  # norms only: no weight matrix as parameters
    assert lm.fingerprint["weights_error"]["Q4_K"]["layers"] == LAYERS


def test_the_layers_compute_the_files_weights_in_the_models_row_order(tiny_gguf):
    """Each packed layer equals a float layer on gguf's own dequantization of the file, with llama's query/key rows
    in transformers' order (the reference: transformers' own GGUF loading of the same file)."""
    from transformers import AutoModelForCausalLM

    lm = kvcli.load(str(tiny_gguf), dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    x = torch.randn(3, HIDDEN)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.gate_proj",
                 "model.layers.1.mlp.up_proj", "lm_head"):
        mine = lm.model.get_submodule(name)
        want = x.bfloat16().float() @ ref.get_submodule(name).weight.detach().bfloat16().float().T
        assert torch.allclose(mine(x), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())), name
    ids = torch.tensor([[1, 200, 3000, 45]])
    assert torch.equal(lm.model.get_input_embeddings()(ids).float(), ref.get_input_embeddings()(ids))
    for a, b in zip(lm.model.model.norm.parameters(), ref.model.norm.parameters()):
        assert torch.equal(a, b)


CAPPED = r"""
import os, resource, sys
import torch
torch.set_num_threads(1)
import kvcli
from kvcli.engine.model import gguf_weights, models  # noqa: F401  (imported before the cap)
import transformers.models.llama.modeling_llama  # noqa: F401
def vm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
path, float_bytes = sys.argv[1], int(sys.argv[2])
size = os.path.getsize(path)
cap = vm() + 2 * size + float_bytes // 2  # the file mapped twice (config reading, weights) and half a float model
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
lm = kvcli.load(path)
with torch.inference_mode():
    logits = lm.model(torch.tensor([[1, 2, 3, 4, 5]])).logits
assert logits.shape[-1] > 1000 and bool(torch.isfinite(logits).all())
try:
    torch.empty(float_bytes // 4, dtype=torch.float32).fill_(0)
except (RuntimeError, MemoryError):
    print("capped")
else:
    print("not capped")
"""


def test_loading_and_running_never_makes_a_float32_copy_of_the_model(tiny_gguf, tmp_path):
    """Under an address-space cap that leaves room for the mapped file but not for the model's float32 weights (the
    cap is shown to bite: a float32 buffer of the model's size fails after), the first load (which prepares and keeps
    the tensors) and a forward pass succeed."""
    from kvcli.engine.model.gguf_file import read_header

    float_bytes = sum(i.rows * i.cols for i in read_header(tiny_gguf).tensors.values()) * 4
    assert float_bytes > 3 * tiny_gguf.stat().st_size
    env = {**os.environ, "KVCLI_HOME": str(tmp_path / "home"), "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CAPPED, str(tiny_gguf), str(float_bytes)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["capped"]
    assert list((tmp_path / "home" / "models").glob("*-packed/packed-v*.safetensors"))


def _kept(home: Path) -> Path:
    (kept,) = (home / "models").glob("gguf-*-packed/packed-v*.safetensors")
    return kept


def test_kept_tensors_are_reused_and_rebuilt_when_damaged_or_of_another_layout(tiny_gguf, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("KVCLI_HOME", str(home))
    first = kvcli.load(str(tiny_gguf))
    kept = _kept(home)
    assert kept.stat().st_size <= 1.3 * tiny_gguf.stat().st_size
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        want = first.model(ids).logits
    stamp = kept.stat().st_mtime_ns

    def logits(lm):
        with torch.inference_mode():
            return lm.model(ids).logits

    def refuse(*_a, **_k):
        raise AssertionError("prepared again")

    with monkeypatch.context() as m:  # a second load maps what was kept: nothing is prepared
        m.setattr(kernels, "prepare", refuse)
        again = kvcli.load(str(tiny_gguf))
    assert kept.stat().st_mtime_ns == stamp and torch.equal(logits(again), want)
    assert again.fingerprint == first.fingerprint  # config and tokenizer read the same way the second time
    kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])  # cut short: made again
    assert torch.equal(logits(kvcli.load(str(tiny_gguf))), want)
    assert kept.stat().st_size > 0 and kept.stat().st_mtime_ns != stamp
    monkeypatch.setattr(kernels, "LAYOUT_VERSION", kernels.LAYOUT_VERSION + 1)
    assert torch.equal(logits(kvcli.load(str(tiny_gguf))), want)
    assert _kept(home).name == f"packed-v{kernels.LAYOUT_VERSION}.safetensors"  # the old version's file is gone


def test_prepared_tensors_other_than_the_files_bytes_are_kept_and_mapped(tiny_gguf, tmp_path, monkeypatch):
    """A layout that rearranges the bytes (here: a copy of them) keeps them, and a later load maps them back."""
    monkeypatch.setenv("KVCLI_HOME", str(tmp_path / "home"))
    real = kernels.prepare
    monkeypatch.setattr(kernels, "prepare", lambda kind, raw, rows, cols: {k: v.clone() for k, v in real(kind, raw, rows, cols).items()})
    monkeypatch.setattr(kernels, "LAYOUT_VERSION", kernels.LAYOUT_VERSION + 100)
    first = kvcli.load(str(tiny_gguf))
    kept = _kept(tmp_path / "home")
    assert 0.9 * tiny_gguf.stat().st_size < kept.stat().st_size <= 1.3 * tiny_gguf.stat().st_size
    second = kvcli.load(str(tiny_gguf))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)


@pytest.fixture(scope="module")
def tiny_cache(tiny_gguf, tmp_path_factory):
    lm = kvcli.load(str(tiny_gguf))
    path = tmp_path_factory.mktemp("tiny-cache") / "license.txt"
    path.write_text((SAMPLES / "document.txt").read_text()[:3000])
    out = path.with_suffix(".kv")
    kvcli.prefill(lm, kvcli.read_document(path), out)
    return lm, out


def test_check_measures_a_cached_answer_against_the_same_modes_recompute(tiny_cache):
    """Approximate, as every bfloat16 mode (docs/exactness.md): the cut between cache and question shows in the last
    bits, and a random model's near-ties turn some into other tokens; --check says how close. One short answer's
    agreement swings with the thread count (it sets the order of the sums: 67% to 92% over 12 tokens), so the bound
    is on four answers pooled (83% to 100% each over 24 tokens, 1 and 2 threads)."""
    lm, cache = tiny_cache
    session = kvcli.Session(lm, cache)
    checks = [session.ask(q, kvcli.GenerationOptions(max_new_tokens=24), check=True).check
              for q in (QUESTION, "What is this document about?", "Can I sell copies?", "Who wrote it?")]
    for check in checks:
        assert check.weights == "gguf" and 0 < check.tokens <= 24
        assert check.agreement == (check.tokens - len(check.divergences)) / check.tokens
        assert check.first_divergence == (check.divergences[0].position if check.divergences else None)
    agreement = sum(c.agreement for c in checks) / len(checks)
    kl = sum(c.kl_mean for c in checks) / len(checks)
    assert agreement >= 0.75 and kl < 0.05, [c.describe() for c in checks]


@pytest.mark.parametrize("damage", ["truncated", "wrong magic", "moved"])
def test_a_bad_or_missing_file_is_a_model_error_naming_it(tiny_gguf, tiny_cache, tmp_path, damage):
    bad = tmp_path / "bad.gguf"
    data = tiny_gguf.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) - 4096])
        why = "truncated"
    elif damage == "wrong magic":
        bad.write_bytes(b"GGML" + data[4:])
        why = "not a GGUF file"
    if damage != "moved":
        with pytest.raises(ModelError, match=str(bad) + ".*" + why):
            kvcli.load(str(bad))
        assert_clean_error(run("count", str(SAMPLES / "document.txt"), "--model", str(bad)), 1, str(bad))
        return
    _, cache = tiny_cache  # the cache's model file moved away: asking without --model names it
    moved = tiny_gguf.rename(tmp_path / "elsewhere.gguf")
    try:
        assert_clean_error(run("ask", "--cache", cache, QUESTION, "--no-server"), 1, str(tiny_gguf), "gone")
    finally:
        moved.rename(tiny_gguf)


def test_a_model_that_does_not_fit_free_memory_is_refused_with_the_size_and_the_mode_that_fits(tiny_gguf):
    size = tiny_gguf.stat().st_size
    with pytest.raises(ModelTooLargeError) as refused:
        kvcli.load(str(tiny_gguf), weights="float", available=lambda: 2 * size + (700 << 20))
    assert "as --weights float (float weights)" in str(refused.value) and "GB is free" in str(refused.value)
    assert refused.value.hint.startswith("--weights gguf runs it in about")
    assert refused.value.exit_code == 1
    with pytest.raises(ModelTooLargeError, match="its own low-bit weights") as none_fits:
        kvcli.load(str(tiny_gguf), available=lambda: size // 2)
    assert "smaller or lower-bit" in none_fits.value.hint


def test_a_folder_model_is_refused_before_any_weight_loads(tiny_model_dir):
    with pytest.raises(ModelError, match="--weights gguf runs a .gguf file's own low-bit weights"):
        kvcli.load(str(tiny_model_dir), weights="gguf")


# -- the default model (SmolLM2-135M, Q4_1 with a Q8_0 embedding tied to the output) in gguf mode ------------------

@pytest.fixture(scope="module")
def gguf_lm(session_home):
    with pytest.MonkeyPatch.context() as mp:  # the module's loads keep their tensors where the session's models live
        mp.setenv("KVCLI_HOME", str(session_home))
        yield kvcli.load(weights="gguf")


def test_the_tied_output_layer_shares_the_embeddings_blocks(gguf_lm):
    output, embedding = gguf_lm.model.get_output_embeddings(), gguf_lm.model.get_input_embeddings()
    assert isinstance(output, kernels.PackedLinear) and isinstance(embedding, kernels.PackedEmbedding)
    assert output.kind == embedding.kind == "Q8_0"
    assert gguf_lm.fingerprint["weights_error"] == {"Q4_1": {"layers": 210, "max_abs": 0.0, "mean_abs": 0.0},
                                                    "Q8_0": {"layers": 2, "max_abs": 0.0, "mean_abs": 0.0}}


@pytest.fixture(scope="module")
def gguf_cache(gguf_lm, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "license.txt"
    path.write_text((SAMPLES / "document.txt").read_text()[:5000])
    out = path.with_suffix(".kv")
    kvcli.prefill(gguf_lm, kvcli.read_document(path), out)
    return out


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


def test_info_names_the_gguf_weights(gguf_cache):
    r = run("info", str(gguf_cache))
    assert r.exit_code == 0, r.stderr
    assert "gguf (the GGUF file's own low-bit weights" in " ".join(r.stdout.split())
    r = run("info", str(gguf_cache), "--json")
    assert json.loads(r.stdout)["weights_error"]["Q4_1"]["layers"] == 210


def test_what_is_kept_is_at_most_the_rearranged_blocks(gguf_lm, session_home):
    """Blocks kernels.prepare leaves as they are in the file are read from the mapped file, not copied."""
    kept = gguf_weights.kept_path(gguf_model.packed_folder(models.gguf_folders(gguf_lm.source["sha256"])[0]))
    assert kept.is_relative_to(session_home)
    record, tensors = gguf_weights._read_kept(kept, gguf_lm.source["sha256"])
    copied = sum(t.numel() * t.element_size() for t in tensors.values())
    assert kept.stat().st_size < copied + (1 << 20)  # the copies and a small index
    assert kept.stat().st_size <= 1.3 * Path(gguf_lm.source["path"]).stat().st_size
    assert set(record["layers"]) >= {"token_embd.weight", "blk.29.ffn_down.weight"}
