"""Caches whose layers differ: full-attention and sliding-window layers restored exactly, other kinds refused.

Each supported model type is a tiny random-weight model whose config mirrors the real family's
structure (grouped-query ratios, head_dim unlike hidden/heads, rope scaling, softcapping, sliding
windows), with the real SmolLM2 tokenizer. "Exact" means: the answer ids from a restored cache equal
greedy generate() on the full prompt ids without a cache, for several questions on one loaded cache,
on a document longer than any window; and the model ran forward only each question's appended ids
and its answer tokens, never the document again.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvcli
from kvcli.engine.cache import layers
from kvcli.engine.cache.kvcache import KVCache, check_layout
from kvcli.documents import decode
from kvcli.errors import CacheMismatchError, ModelError
from kvcli.engine.prefilling import prefill
from kvcli.format.store import read_manifest
from tests.conftest import TokenCounter, reference_answer, sample_text
from tests.helpers import assert_clean_error, run
from tests.architectures import ARCHS, CHUNK, MAX_NEW, OPTS, QUESTIONS, SLIDING, assert_varied, build

def _check_answer(a, model, cached_ids: list[int], counted: list[int]) -> None:
    """Exact against recompute, and the forward passes saw the appended ids, then one answer token at a time."""
    assert a.prompt_token_ids[: len(cached_ids)] == cached_ids and a.cached_tokens == len(cached_ids)
    assert a.new_tokens == len(a.prompt_token_ids) - len(cached_ids) > 0
    assert counted[0] == a.new_tokens, counted
    assert counted[1:] == [1] * (len(a.answer_token_ids) - 1), counted
    assert sum(counted) == a.processed_tokens == a.new_tokens + len(a.answer_token_ids) - 1
    ref = reference_answer(model, a.prompt_token_ids, MAX_NEW)
    assert_varied(ref)
    assert a.answer_token_ids == ref


# ---------------------------------------------------------------------------------------------------
# Every supported model type: manifest, restored lengths, exact answers, processed-token counts
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ARCHS))
def test_plan_matches_the_models_own_cache(arch, name):
    a = arch(name)
    assert layers.plan(a.model.config) == a.plan


@pytest.mark.parametrize("name", list(ARCHS))
def test_manifest_records_each_layers_kind_window_and_counted_length(arch, name):
    a = arch(name)
    m = read_manifest(a.path)
    n = m.num_tokens
    windows = [w for _k, w in a.plan if w]
    assert n > 4 * max(windows, default=0) and n > 3 * CHUNK  # longer than any window, prefilled in several chunks
    assert [(layer.kind, layer.sliding_window) for layer in m.layers] == a.plan
    for layer in m.layers:
        assert layer.seq_length == n  # counted length: every document token, whatever the layer keeps
        kept = n if layer.kind == "full" else layer.sliding_window - 1
        assert layer.cached_length == kept and layer.key_shape[-2] == kept and layer.value_shape[-2] == kept
    assert m.model["model_type"] == name


@pytest.mark.parametrize("name", list(ARCHS))
def test_restored_cache_counts_the_whole_document(arch, name):
    a = arch(name)
    session = kvcli.Session(a.lm, a.path)
    n = len(session.token_ids)
    cache = session.cache
    assert [layer.get_seq_length() for layer in cache.layers] == [n] * len(a.plan)
    assert cache.get_seq_length() == n
    for layer, (kind, window) in zip(cache.layers, a.plan):
        assert layer.keys.shape[-2] == (n if kind == "full" else window - 1)


@pytest.mark.parametrize("name", list(ARCHS))
def test_several_questions_on_one_loaded_cache_match_recompute(arch, name):
    a = arch(name)
    session = kvcli.Session(a.lm, a.path)
    counter = TokenCounter(a.model)
    try:
        answers = []  # (answer, token positions of each forward pass)
        for q in QUESTIONS:  # the second and third questions reuse the loaded cache
            counter.reset()
            answers.append((session.ask(q, OPTS), list(counter.calls)))
    finally:
        counter.close()
    for ans, counted in answers:
        _check_answer(ans, a.model, session.token_ids, counted)
    assert len({tuple(ans.answer_token_ids) for ans, _c in answers}) > 1  # the questions did change the answers


@pytest.mark.parametrize("name", SLIDING)
def test_wrong_counted_length_is_refused_before_any_forward(arch, name, monkeypatch):
    """Restore sliding layers with seq_length = stored length (window-1): generate() would treat most of the
    document as new and run it again (silently right on an all-sliding model), a batched step would put the
    question at wrong positions. The engine refuses such states, batched or one at a time, before any forward."""
    from kvcli.engine.scheduling.scheduler import engine_for
    from kvcli.errors import CacheCorruptError

    a = arch(name)
    good = kvcli.Session(a.lm, a.path)
    ok = good.ask(QUESTIONS[0], OPTS)
    for batched in (True, False):
        monkeypatch.setattr(engine_for(a.lm), "batched", batched)
        bad = kvcli.Session(a.lm, a.path)
        bad.cache = KVCache.from_states(
            [dataclasses.replace(s, seq_length=s.keys.shape[-2]) if s.kind == "sliding" else s for s in bad.states])
        counter = TokenCounter(a.model)
        try:
            with pytest.raises(CacheCorruptError, match="counted length"):
                bad.ask(QUESTIONS[0], OPTS)
            assert counter.total == 0
            again = good.ask(QUESTIONS[0], OPTS)  # the engine goes on
        finally:
            counter.close()
        assert again.answer_token_ids == ok.answer_token_ids


# ---------------------------------------------------------------------------------------------------
# Windows recorded in the manifest: a model with other windows or layer kinds is refused
# ---------------------------------------------------------------------------------------------------


def test_model_with_another_window_is_refused(arch):
    a = arch("mistral")
    other = kvcli.from_objects(build("mistral", a.tok, sliding_window=24), a.tok, name="tiny-mistral-w24")
    with pytest.raises(CacheMismatchError) as err:
        kvcli.Session(other, a.path)
    assert err.value.exit_code == 3 and "model config" in str(err.value)


def _same_fingerprint(lm, like):
    """A LoadedModel claiming the fingerprint of `like`: only the per-layer check can tell them apart."""
    return dataclasses.replace(lm, fingerprint=dict(like.fingerprint))


def test_layer_check_catches_another_window_even_when_hashes_agree(arch):
    a = arch("mistral")
    other = _same_fingerprint(kvcli.from_objects(build("mistral", a.tok, sliding_window=24), a.tok), a.lm)
    with pytest.raises(CacheMismatchError) as err:
        kvcli.Session(other, a.path)
    assert err.value.exit_code == 3
    assert "layer 0 is sliding (window 32) in the cache, sliding (window 24) in the model" in str(err.value)


def test_layer_check_catches_other_layer_kinds_even_when_hashes_agree(arch):
    a = arch("gemma3_text")
    swapped = ["full_attention"] + ["sliding_attention"] * 3
    other = _same_fingerprint(kvcli.from_objects(build("gemma3_text", a.tok, layer_types=swapped), a.tok), a.lm)
    with pytest.raises(CacheMismatchError) as err:
        kvcli.Session(other, a.path)
    assert "layer 0 is sliding (window 48) in the cache, full (window None) in the model" in str(err.value)


def test_states_of_another_layout_are_refused(arch):
    a = arch("gemma2")
    states = kvcli.Session(a.lm, a.path).states
    plan = layers.plan(a.model.config)
    check_layout(plan, states)
    with pytest.raises(ModelError, match="layer 0: model has a sliding layer \\(window 24\\), cache holds full"):
        KVCache.from_states([dataclasses.replace(states[0], kind="full", sliding_window=None), *states[1:]], plan=plan)
    with pytest.raises(ModelError, match="cache layers"):
        check_layout(plan, states[:-1])


# ---------------------------------------------------------------------------------------------------
# The core exactness requirements on llama (grouped-query), qwen2 and gpt2: several documents
# ---------------------------------------------------------------------------------------------------

LONG_CHARS = {"llama": 14000, "qwen2": 14000, "gpt2": 3200}  # gpt2: document + question + answer within 1024
DOCS = {
    # name -> (text, chunk_size)
    "long": (None, 512),
    "short": ("Minutes of the 3 May meeting: Bruno will order forty chairs; the hall opens at nine.", 512),
    "odd": (None, 7),  # tiny chunks, a boundary in mid-sentence
}
CORE_QUESTIONS = ("Who is named in the text?", "Summarise the text in one sentence.")


@pytest.fixture(scope="module")
def core(arch, tmp_path_factory):
    """core(name): {doc name: (Document, cache path)} for the several-documents tests."""
    made: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in made:
            a = arch(name)
            folder = tmp_path_factory.mktemp(f"core-{name}")
            texts = {
                "long": sample_text(LONG_CHARS[name])[: LONG_CHARS[name]],
                "short": DOCS["short"][0],
                "odd": sample_text()[5000:5600] + " trailing space ",
            }
            made[name] = {}
            for key, text in texts.items():
                doc = decode(text.encode(), f"{key}.txt")
                prefill(a.lm, doc, folder / f"{key}.kv", chunk_size=DOCS[key][1])
                made[name][key] = (doc, folder / f"{key}.kv")
        return made[name]

    return get


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_several_documents_several_questions_exact(arch, core, name):
    a = arch(name)
    docs = core(name)
    n_long = read_manifest(docs["long"][1]).num_tokens
    assert n_long >= (2000 if name != "gpt2" else 600) and n_long > 512  # prefilled in several chunks
    if name == "gpt2":
        assert a.lm.max_positions == 1024 and n_long + 320 <= 1024
    counter = TokenCounter(a.model)
    try:
        for key, (doc, path) in docs.items():
            session = kvcli.Session(a.lm, path)
            assert session.manifest.framing["kind"] == ("plain" if name == "gpt2" else "chat")
            for q in CORE_QUESTIONS:
                counter.reset()
                ans = session.ask(q, OPTS)
                counted = list(counter.calls)
                text = a.tok.decode(ans.prompt_token_ids)
                assert doc.text.strip() in text and q in text, key
                assert text.index(doc.text.strip()) < text.rindex(q)
                _check_answer(ans, a.model, session.token_ids, counted)
    finally:
        counter.close()


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_second_answer_equals_that_question_alone(arch, core, name):
    a = arch(name)
    _doc, path = core(name)["long"]
    session = kvcli.Session(a.lm, path)
    first = session.ask(CORE_QUESTIONS[0], OPTS)
    second = session.ask(CORE_QUESTIONS[1], OPTS)
    alone = kvcli.Session(a.lm, path).ask(CORE_QUESTIONS[1], OPTS)
    assert second.answer_token_ids == alone.answer_token_ids and second.answer == alone.answer
    assert second.prompt_token_ids == alone.prompt_token_ids
    assert second.processed_tokens == alone.processed_tokens == second.new_tokens + len(second.answer_token_ids) - 1
    assert first.answer_token_ids != second.answer_token_ids


# ---------------------------------------------------------------------------------------------------
# Refused: state-space / linear-attention hybrids, encoder-decoder, compressed latent attention (MLA)
# ---------------------------------------------------------------------------------------------------

REFUSED = {
    # model type -> (config kwargs for a tiny model, what the message must name)
    "mamba": (dict(hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4), "LinearAttentionLayer"),
    "falcon_h1": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                       mamba_n_groups=1, mamba_d_conv=4), "LinearAttentionAndFullAttentionLayer"),
    "qwen3_next": (dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
                        num_experts_per_tok=1, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8), "LinearAttentionLayer"),
    "t5": (dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4), "encoder-decoder"),
    "bart": (dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64), "encoder-decoder"),
    "deepseek_v3": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1,
                         n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1), "compressed latent attention (MLA)"),
}


def _refused_config(name: str, vocab: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(name, vocab_size=vocab, **REFUSED[name][0])


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_model_is_refused_from_objects(tokenizer, name):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = _refused_config(name, len(tokenizer))
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = auto.from_config(config)  # a real tiny random-weight model of that type
    with pytest.raises(ModelError) as err:
        kvcli.from_objects(model, tokenizer)
    assert err.value.exit_code == 1
    assert f"model type '{name}'" in str(err.value) and REFUSED[name][1] in str(err.value)


@pytest.mark.parametrize("name", ["mamba", "falcon_h1", "qwen3_next", "t5", "deepseek_v3"])
def test_unsupported_model_is_refused_by_the_cli_before_prefill(tokenizer, tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_refused_config(name, len(tokenizer)).to_dict()))
    doc = tmp_path / "doc.txt"
    doc.write_text(sample_text()[:500], encoding="utf-8")
    out = tmp_path / "doc.kv"
    result = run("prefill", doc, "--model", folder, "-o", out)
    assert_clean_error(result, 1, f"model type '{name}'", REFUSED[name][1])
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "doc.txt"])


def test_cache_of_a_supported_model_is_refused_by_an_unsupported_one(arch, tokenizer):
    """Even handed a cache directly, a model with other layer kinds gets an error, never an answer."""
    a = arch("llama")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(_refused_config("qwen3_next", len(tokenizer)))
    lm = dataclasses.replace(a.lm, model=hybrid)  # bypasses from_objects' own check
    with pytest.raises(ModelError, match="model type 'qwen3_next' has a LinearAttentionLayer"):
        kvcli.Session(lm, a.path).ask(QUESTIONS[0], OPTS)


def test_prefill_refuses_a_hybrid_cache_even_when_the_model_check_is_bypassed(tokenizer, tmp_path):
    """The prefill's cache is built from layers.plan, which refuses state kvcli cannot store (here falcon_h1's SSM
    state next to its keys/values) before any forward pass: no cache of keys/values alone is written."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvcli.engine.model.models import LoadedModel, fingerprint

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_refused_config("falcon_h1", len(tokenizer))).eval()
    lm = LoadedModel(model=model, tokenizer=tokenizer, source={"kind": "object", "name": "x"}, fingerprint=fingerprint(model, tokenizer))
    with pytest.raises(ModelError, match="has a LinearAttentionAndFullAttentionLayer cache layer \\(layer 0\\)"):
        prefill(lm, decode(sample_text()[:400].encode(), "d.txt"), tmp_path / "x.kv", chunk_size=64)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------
# Rope scaling whose frequencies depend on the sequence length (longrope: Phi-3-128k, Phi-3.5, Phi-4-mini)
# ---------------------------------------------------------------------------------------------------

LONGROPE_ORIGINAL = 128


def _longrope(original: int, limit: int) -> dict:
    rotary = 16 // 2 // 2  # head_dim 16, partial_rotary_factor 0.5: one factor per rotary frequency
    return dict(sliding_window=None, max_position_embeddings=limit, original_max_position_embeddings=original,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "short_factor": [1.0] * rotary, "long_factor": [4.0] * rotary,
                                 "original_max_position_embeddings": original})


def test_longrope_past_its_original_length_is_refused(tokenizer):
    model = build("phi3", tokenizer, **_longrope(LONGROPE_ORIGINAL, 4096))
    with pytest.raises(ModelError) as err:
        kvcli.from_objects(model, tokenizer)
    assert err.value.exit_code == 1
    assert "model type 'phi3'" in str(err.value) and "longrope" in str(err.value)
    # where no sequence kvcli allows can pass the switch point, longrope behaves like plain rope
    layers.plan(build("phi3", tokenizer, **_longrope(4096, 4096)).config)


def test_why_longrope_is_refused_chunked_keys_differ_from_recompute(tokenizer):
    """The hazard itself, without kvcli: prefill in chunks below the switch point, then a question past it,
    gives other logits than one pass over the whole prompt (the reference for exactness)."""
    import torch
    from transformers import DynamicCache

    model = build("phi3", tokenizer, **_longrope(LONGROPE_ORIGINAL, 4096))
    ids = tokenizer(sample_text()[:1200])["input_ids"][: 2 * LONGROPE_ORIGINAL]
    doc, question = ids[:-16], ids[-16:]
    with torch.inference_mode():
        whole = model(input_ids=torch.tensor([ids])).logits[0, -1]
        cache = DynamicCache(config=model.config)
        for start in range(0, len(doc), 64):  # the first chunks stay below the switch point
            model(input_ids=torch.tensor([doc[start : start + 64]]), cache=cache, use_cache=True)
        cached = model(input_ids=torch.tensor([question]), cache=cache, use_cache=True).logits[0, -1]
    assert (whole - cached).abs().max() > 1e-3
