"""The tiny random-weight model of each supported architecture, shared by the tests that run every family:
each config mirrors the real family's structure (grouped-query ratios, head_dim unlike hidden/heads, rope scaling,
softcapping, sliding windows), with the real SmolLM2 tokenizer. The `arch` fixture (tests/conftest.py) builds them."""

from __future__ import annotations

import kvcli

QUESTIONS = (
    "What does the word Licensor mean?",
    "When does the patent license terminate?",
    "Is the Work provided with any warranty?",
)
MAX_NEW = 10
OPTS = kvcli.GenerationOptions(max_new_tokens=MAX_NEW)
DOC_CHARS = 2400  # about 480 tokens: many times the windows below (24-48)
CHUNK = 56  # not a multiple of any window, and larger than some: chunks straddle window edges


def _special(tok) -> dict:
    return dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _llama(tok, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    # Llama 3.x: grouped-query (here 4 query heads per kv head), llama3 rope scaling, rope_theta 500k.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=8192, rope_parameters=rope,
               initializer_range=0.1, **_special(tok))
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **over}))


def _qwen2(tok, **over):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Qwen2.5-0.5B: qkv bias, 7:1 grouped-query (here 3:1), tied embeddings, rope_theta 1e6, no sliding.
    cfg = dict(vocab_size=len(tok), hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
               tie_word_embeddings=True, use_sliding_window=False, initializer_range=0.1, **_special(tok))
    return Qwen2ForCausalLM(Qwen2Config(**{**cfg, **over}))


def _qwen3(tok, **over):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3-0.6B: q/k RMSNorm, head_dim 128 with hidden 1024 / 16 heads (here 32 with 64 / 4), 2:1 grouped-query.
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=40960, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6},
               initializer_range=0.2, **_special(tok))  # 0.1 with tied embeddings repeats one token
    return Qwen3ForCausalLM(Qwen3Config(**{**cfg, **over}))


def _mistral(tok, **over):
    from transformers import MistralConfig, MistralForCausalLM

    # Mistral 7B v0.1: a sliding window on every layer, 4:1 grouped-query; head_dim set apart (as Mistral-Nemo).
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, sliding_window=32, max_position_embeddings=8192,
               initializer_range=0.1, **_special(tok))
    return MistralForCausalLM(MistralConfig(**{**cfg, **over}))


def _phi3(tok, **over):
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-3: fused qkv and gate_up projections, a sliding window on every layer (2047 in Phi-3-mini),
    # partial rotary embeddings (Phi-4-mini: 0.75), grouped-query as in Phi-3-medium.
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, sliding_window=40, max_position_embeddings=4096, original_max_position_embeddings=4096,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
               initializer_range=0.1, **_special(tok))
    return Phi3ForCausalLM(Phi3Config(**{**cfg, **over}))


def _gemma2(tok, **over):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Gemma 2: sliding and full layers alternating, attention and final logit softcapping, head_dim 256 with
    # hidden 2304 / 8 heads (here 32 with 64 / 4), query_pre_attn_scalar, scaled embeddings. Untied here: a tiny
    # random model with tied, sqrt(hidden)-scaled embeddings repeats one token, which would make comparisons weak.
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, sliding_window=24, query_pre_attn_scalar=32,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
               tie_word_embeddings=False, initializer_range=0.1, **_special(tok))
    return Gemma2ForCausalLM(Gemma2Config(**{**cfg, **over}))


def _gemma3(tok, **over):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Gemma 3 (text): five sliding layers per full one (here three), q/k norms, local rope theta 10k and
    # global 1M with linear rope scaling (factor 8) on the full layers only, 4:1 grouped-query. Untied as gemma2.
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, sliding_window=48, query_pre_attn_scalar=32,
               layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_parameters=rope,
               max_position_embeddings=32768, tie_word_embeddings=False, initializer_range=0.1, **_special(tok))
    return Gemma3ForCausalLM(Gemma3TextConfig(**{**cfg, **over}))


def _gpt2(tok, **over):
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2: learned absolute positions ending at n_positions (1024), multi-head attention, fused c_attn.
    cfg = dict(vocab_size=len(tok), n_positions=1024, n_embd=64, n_layer=2, n_head=4, initializer_range=0.1,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **over}))


# model type -> (builder, plain framing?, expected (kind, window) per layer)
ARCHS = {
    "llama": (_llama, False, [("full", None)] * 2),
    "qwen2": (_qwen2, False, [("full", None)] * 2),
    "qwen3": (_qwen3, False, [("full", None)] * 2),
    "mistral": (_mistral, False, [("sliding", 32)] * 3),
    "phi3": (_phi3, False, [("sliding", 40)] * 2),
    "gemma2": (_gemma2, False, [("sliding", 24), ("full", None)] * 2),
    "gemma3_text": (_gemma3, False, [("sliding", 48)] * 3 + [("full", None)]),
    "gpt2": (_gpt2, True, [("full", None)] * 2),
}
SLIDING = [name for name, (_b, _p, plan) in ARCHS.items() if any(kind == "sliding" for kind, _w in plan)]


def build(name: str, tok, seed: int = 0, **over):
    import torch

    torch.manual_seed(seed)
    model = ARCHS[name][0](tok, **over).eval()
    assert model.config.model_type == name
    return model


def assert_varied(ids: list[int]) -> None:
    assert len(ids) >= 4 and len(set(ids)) >= 3, f"degenerate reference answer {ids}: the comparison would mean little"
