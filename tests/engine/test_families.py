"""Decoder-only families beyond test_architectures.py: each exact batched and alone, or refused at load.

Each family is a tiny random-weight model (2-4 layers, hidden 64) whose config keeps what sets the
real family apart (partial rotary, q/k norms, parallel residuals, multi-query heads, learned or ALiBi
positions, multipliers, logit scales, sliding windows, NoPE layers, experts), with the real SmolLM2
tokenizer. For each: the probe's verdict (engine/scheduling/probe.py) is what EXPECT says; every answer alone
equals greedy generate() on the full prompt without a cache; several questions in one ask_many
equal the same questions asked alone, whichever path the verdict chose; and where the verdict allows
batching, a single row through batch.BatchDecoder gives the same answer too (the path every question
may take). A model whose batched path is broken is caught by the probe and answers one at a time.
"""

from __future__ import annotations

import pytest
import torch

import kvcli
from kvcli.documents import decode
from kvcli.engine.model import attention
from kvcli.engine.scheduling import probe
from kvcli.engine.decoding import batch
from kvcli.engine.decoding.protocol import Row
from kvcli.engine.prefilling import prefill
from kvcli.engine.decoding.questions import greedy
from kvcli.errors import ModelError
from tests.conftest import reference_answer, sample_text

QUESTIONS = (
    "What does the word Licensor mean?",
    "When does the patent license terminate?",
    "Is the Work provided with any warranty?",
)
MAX_NEW = 8
OPTS = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
DOC_CHARS = 900  # about 200 tokens: several times the windows below (32)
CHUNK = 56
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.1)

# name -> (model type, config kwargs). Names with a suffix are a second variant of one family.
FAMILIES = {
    # stablelm-2-1_6b: partial rotary 0.25, qkv bias, sequential residual, multi-head
    "stablelm": ("stablelm", dict(TINY, num_key_value_heads=4, partial_rotary_factor=0.25, use_qkv_bias=True)),
    # stablelm-2-12b: per-head q/k LayerNorm, parallel residual, grouped-query
    "stablelm-12b": ("stablelm", dict(TINY, num_key_value_heads=2, partial_rotary_factor=0.25, qk_layernorm=True,
                                      use_parallel_residual=True)),
    # Pythia: partial rotary 0.25, parallel residual, fused qkv
    "gpt_neox": ("gpt_neox", dict(TINY, partial_rotary_factor=0.25, use_parallel_residual=True)),
    # phi-2: partial rotary 0.4 of head_dim 20, parallel attention + MLP, gelu_new
    "phi": ("phi", dict(TINY, hidden_size=80, num_key_value_heads=4, partial_rotary_factor=0.4)),
    # granite-3: embedding/residual/attention multipliers (attention 1/head_dim as 1/128 there), logits scaling
    "granite": ("granite", dict(TINY, num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                                attention_multiplier=1 / 16, logits_scaling=8.0, initializer_range=0.2)),
    # command-r: parallel block, LayerNorm without bias, interleaved rotary, logit_scale, tied embeddings
    "cohere": ("cohere", dict(TINY, num_key_value_heads=2, logit_scale=0.0625, initializer_range=0.2)),
    # command-r-plus: per-head q/k norms
    "cohere-qknorm": ("cohere", dict(TINY, num_key_value_heads=2, logit_scale=0.0625, use_qk_norm=True,
                                     initializer_range=0.2)),
    # OPT-125m: learned positions (offset 2), pre-LayerNorm, ReLU
    "opt": ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
                        max_position_embeddings=2048, init_std=0.1)),
    # OPT-350m: embeddings projected in and out (word_embed_proj_dim < hidden), post-LayerNorm
    "opt-350m": ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                             do_layer_norm_before=False, max_position_embeddings=2048, init_std=0.1)),
    # falcon-7b: multi-query, parallel attention, rotary
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                              parallel_attn=True, new_decoder_architecture=False, alibi=False, initializer_range=0.1)),
    # falcon-40b: the new decoder architecture (grouped kv heads, two layer norms)
    "falcon-40b": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                  new_decoder_architecture=True, alibi=False, initializer_range=0.1)),
    # falcon-rw-1b: ALiBi positions, sequential block
    "falcon-rw": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
                                 parallel_attn=False, alibi=True, bias=True, initializer_range=0.1)),
    # starcoder2: sliding window (4096, here 32), biases, LayerNorm, grouped-query
    "starcoder2": ("starcoder2", dict(TINY, num_key_value_heads=2, sliding_window=32, use_bias=True)),
    # OLMo-2: RMSNorm on the whole q and k projections, norms after attention and MLP
    "olmo2": ("olmo2", dict(TINY, num_key_value_heads=4)),
    # OLMo-1.7: clipped qkv, LayerNorm without parameters
    "olmo": ("olmo", dict(TINY, num_key_value_heads=4, clip_qkv=8.0)),
    # santacoder / starcoder-1: multi-query, learned absolute positions
    "gpt_bigcode": ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, multi_query=True, n_positions=2048,
                                        initializer_range=0.1)),
    # GPT-J: interleaved rotary on part of each head (rotary_dim), parallel block
    "gptj": ("gptj", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=2048, initializer_range=0.2)),
    # CodeGen: GPT-J's rotary with qkv packed for model parallelism
    "codegen": ("codegen", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=2048, n_ctx=2048,
                                initializer_range=0.2)),
    # Persimmon / Fuyu: q/k LayerNorm, partial rotary 0.5, squared ReLU
    "persimmon": ("persimmon", dict(TINY, partial_rotary_factor=0.5, qk_layernorm=True)),
    # Nemotron (Minitron): partial rotary 0.5, LayerNorm1p, squared ReLU
    "nemotron": ("nemotron", dict(TINY, num_key_value_heads=2, partial_rotary_factor=0.5)),
    # SmolLM3: every fourth layer without rotary embeddings (NoPE)
    "smollm3": ("smollm3", dict(TINY, num_hidden_layers=4, num_key_value_heads=2, no_rope_layers=[1, 1, 1, 0],
                                use_sliding_window=False)),
    # Mixtral: mixture of experts (top-2 of 4)
    "mixtral": ("mixtral", dict(TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    # OLMoE: experts plus q/k norms
    "olmoe": ("olmoe", dict(TINY, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)),
    # Cohere2 (command-r7b): three sliding layers per full one, no rotary on the full layers
    "cohere2": ("cohere2", dict(TINY, num_hidden_layers=4, num_key_value_heads=2, sliding_window=32, logit_scale=0.0625,
                                initializer_range=0.2)),
    # EXAONE 4: sliding and full layers, q/k norms, post-norms
    "exaone4": ("exaone4", dict(TINY, num_hidden_layers=4, num_key_value_heads=2, sliding_window=32,
                                sliding_window_pattern=4)),
    # GPT-Neo: local attention (window 256, here 32) on every other layer, attention without scaling
    "gpt_neo": ("gpt_neo", dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                                attention_types=[[["global", "local"], 1]], window_size=32, max_position_embeddings=2048,
                                initializer_range=0.1)),
    # BLOOM: ALiBi positions, embedding LayerNorm
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.2)),
    # DiffLlama: differential attention (two softmaxes subtracted)
    "diffllama": ("diffllama", dict(TINY, num_key_value_heads=2)),
}

# seed 0 gives these a degenerate or question-blind answer
SEEDS = {"opt": 1, "starcoder2": 1, "gpt_neox": 1, "falcon": 1, "falcon-40b": 1, "falcon-rw": 1}


def _sharpen_qk_norms(model) -> None:
    """Per-head q/k LayerNorms make a random model's attention nearly uniform (every question then gets one
    answer); trained ones are far sharper. Scaled weights give varied answers, as in a real model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                param.mul_(4.0)


TWEAKS = {"stablelm-12b": _sharpen_qk_norms}

# name -> "batched" (the probe lets rows share one BatchDecoder), "alone" (the probe refuses: one row at a time),
# or ("refused", words the load error must contain)
ALONE = ("falcon", "falcon-40b", "falcon-rw", "gpt_neo", "bloom", "diffllama")
EXPECT = {name: "alone" if name in ALONE else "batched" for name in FAMILIES}


def build(name: str, tok, seed: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = FAMILIES[name]
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), **special, **kwargs)
    torch.manual_seed(SEEDS.get(name, 0) if seed is None else seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if name in TWEAKS:
        TWEAKS[name](model)
    assert model.config.model_type == model_type
    return model


@pytest.fixture(scope="module")
def family(tokenizer, tmp_path_factory):
    """family(name): (model, LoadedModel or the ModelError of its load, cache path or None), built once."""
    built: dict = {}

    def get(name: str):
        if name not in built:
            model = build(name, tokenizer)
            try:
                lm = kvcli.from_objects(model, tokenizer, name=f"tiny-{name}")
            except ModelError as exc:
                built[name] = (model, exc, None)
                return built[name]
            path = tmp_path_factory.mktemp(name.replace("-", "_")) / "doc.kv"
            prefill(lm, decode(sample_text()[:DOC_CHARS].encode(), "licence.txt"), path, chunk_size=CHUNK)
            built[name] = (model, lm, path)
        return built[name]

    return get


def _single_row(session, question: str) -> list[int]:
    """The answer of one question as a single row through batch.BatchDecoder (greedy)."""
    lm = session.lm
    prompt = session.prompt_ids(question)
    row = Row(index=0, prompt=prompt, appended=prompt[len(session.token_ids):], max_new=MAX_NEW, choose=greedy,
              on_token=lambda _t: False)
    batch.decode_rows(lm.model, session.states, [row], batch_size=1, eos=batch.eos_ids(lm.model),
                      pad_id=batch.padding_id(lm.tokenizer, lm.model))
    return row.answer


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_exact_batched_and_alone_or_refused(family, name, exactness_report):
    model, lm, path = family(name)
    expect = EXPECT[name]
    if isinstance(expect, tuple):
        assert isinstance(lm, ModelError), f"{name} loaded; expected it refused"
        assert lm.exit_code == 1 and expect[1] in str(lm)
        return
    assert not isinstance(lm, ModelError), str(lm)
    verdict = probe.verdict(lm.model)
    exactness_report.append(f"{name:14s} probe ok={verdict.ok} max_diff={verdict.max_diff:.2e} {verdict.ms:6.1f} ms: {verdict.reason}")
    assert verdict.ok == (expect == "batched"), verdict
    assert probe.batchable(model) == verdict.ok
    session = kvcli.Session(lm, path)
    alone = [session.ask(q, OPTS) for q in QUESTIONS]
    for a in alone:
        ref = reference_answer(model, a.prompt_token_ids, MAX_NEW)
        assert len(ref) >= 4 and len(set(ref)) >= 3, f"degenerate reference answer {ref}"
        assert a.answer_token_ids == ref, (name, a.question)
    many = session.ask_many(QUESTIONS, OPTS, batch_size=2)  # 3 questions, 2 rows: the third joins a freed row
    assert [m.answer_token_ids for m in many] == [a.answer_token_ids for a in alone], name
    assert [m.processed_tokens for m in many] == [a.processed_tokens for a in alone]
    if verdict.ok:
        assert [_single_row(session, q) for q in QUESTIONS] == [a.answer_token_ids for a in alone]
    assert len({tuple(a.answer_token_ids) for a in alone}) > 1  # the questions did change the answers


def test_why_stablelm_needed_the_context_variable(family):
    """StableLM's decoder layer drops the keywords it is given before calling attention: a batch that passed
    the shared cache as a forward() keyword never reached the cascade (rows saw no document)."""
    import inspect

    from transformers.models.stablelm import modeling_stablelm

    call = inspect.getsource(modeling_stablelm.StableLmDecoderLayer.forward).split("self.self_attn(")[1].split(")")[0]
    assert "**kwargs" not in call  # if transformers fixes this, the context variable is still the one channel
    model, lm, _path = family("stablelm")
    assert probe.verdict(lm.model).ok and probe.verdict(lm.model).max_diff < 1e-4


def test_diffllama_is_refused_batching_with_its_reason(family):
    _model, lm, _path = family("diffllama")
    assert not probe.verdict(lm.model).ok and "attends to other keys/values than its cache holds" in probe.verdict(lm.model).reason


def test_broken_batched_path_is_caught_by_the_probe_and_answers_alone(tokenizer, tmp_path, monkeypatch):
    """A cascade that is slightly wrong (every batched output nudged) fails the probe; the model then answers
    every question one at a time, exactly, and the verdict says why."""
    real = attention.shared_prefix_attention

    def nudged(*args, **kwargs):
        out, weights = real(*args, **kwargs)
        return out * 1.01, weights

    monkeypatch.setattr(attention, "shared_prefix_attention", nudged)
    model = build("stablelm", tokenizer)
    lm = kvcli.from_objects(model, tokenizer, name="tiny-broken")
    assert not probe.verdict(lm.model).ok and not probe.batchable(model)
    assert probe.verdict(lm.model).max_diff > 1e-3 and "rows decode one at a time" in probe.verdict(lm.model).reason
    path = tmp_path / "doc.kv"
    prefill(lm, decode(sample_text()[:DOC_CHARS].encode(), "licence.txt"), path, chunk_size=CHUNK)
    session = kvcli.Session(lm, path)
    many = session.ask_many(QUESTIONS, OPTS, batch_size=3)
    for m in many:
        assert m.answer_token_ids == reference_answer(model, m.prompt_token_ids, MAX_NEW)
        assert m.decoding == "one at a time"
    from kvcli.engine.scheduling.scheduler import engine_for

    assert engine_for(lm).why == probe.verdict(lm.model).reason  # what ps --json shows as decoding_why
    # the verdict is measured once per model and attention implementation, then kept
    assert probe.verdict(model) is probe.verdict(lm.model)


def test_probe_refuses_what_it_cannot_run(tiny_lm):
    """A model not attending through kvcli's functions is never batched; a failure inside the BatchDecoder is a verdict."""
    model = tiny_lm.model
    impl = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        v = probe.verdict(model)
        assert not v.ok and "'eager' is not one of kvcli's functions" in v.reason
    finally:
        model.set_attn_implementation(impl)
    assert probe.verdict(model).ok
