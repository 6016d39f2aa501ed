"""kvcli's attention functions, registered through AttentionInterface and selected per model.

- Grouped-query attention without repeating key/value heads: transformers' sdpa attention copies every
  key/value head n_rep times before attending whenever a mask is given (a question after a cached
  document, a prefill chunk), unless a process-wide environment switch is set. kvcli registers its own
  function, which calls torch's sdpa with `enable_gqa=True`, for models that run sdpa on the CPU,
  where it was measured faster and gives the same tokens (tests/engine/test_attention.py).
- Cascade attention for many questions on one document (engine/decoding/batch.py): while a forward pass runs
  inside `sharing(cache)` with a SharedPrefixCache, every kvcli function attends over the shared document
  and each question's own tokens instead; otherwise each does exactly what the model's own attention did
  (sdpa, or the modeling file's eager function for models such as gemma2 that need softcapping).
  The cache travels in a context variable, not as a forward() keyword: some modeling files (StableLM's
  decoder layer) drop the keywords they are given before calling attention, and their batched rows then
  attended only to their own suffix buffer, never to the document. Whether a loaded model really batches
  exactly is measured, not assumed (engine/scheduling/probe.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

NAME = "kvcli_gqa_sdpa"  # sdpa models on the CPU
SDPA_NAME = "kvcli_sdpa"  # sdpa models elsewhere
EAGER_NAME = "kvcli_eager"  # models that attend eagerly (softcapping)
NAMES = (NAME, SDPA_NAME, EAGER_NAME)
_registered = False
_SHARED: ContextVar[Any] = ContextVar("kvcli_shared_prefix_cache", default=None)  # this thread's running batch


@contextmanager
def sharing(cache: Any) -> Iterator[None]:
    """Within this block (this thread or task only), kvcli's attention functions run the cascade over `cache`."""
    token = _SHARED.set(cache)
    try:
        yield
    finally:
        _SHARED.reset(token)


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs) -> tuple[Any, None]:
    """query [b, heads, q, d], key/value [b, kv_heads, kv, d] -> output [b, q, heads, d], as transformers' sdpa."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _SHARED.get() is not None:
        return shared_prefix_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    if _one_row_eager(query, attention_mask, dropout, kwargs):
        return _one_row_attention(query, key, value, scaling)
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups <= 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("output_attentions", False)):
        # no mask: transformers already attends grouped heads natively; the rest is sdpa's own business
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False, enable_gqa=True
    )  # [b, heads, q, d]
    return out.transpose(1, 2).contiguous(), None


def _one_row_eager(query, attention_mask, dropout, kwargs) -> bool:
    """A decoding step's query (one row) in bfloat16 or float16 on the CPU, with nothing but the keys to attend:
    torch's flash kernel takes 7x (1,024 keys) to 20x (8,192) the time of the plain products there
    (docs/performance.md, "Compute dtype: float32 against bfloat16")."""
    import torch

    return (query.shape[2] == 1 and query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cpu"
            and attention_mask is None and not dropout and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "position_bias"))
            and not kwargs.get("output_attentions", False) and not kwargs.get("sliding_window"))


def _one_row_attention(query, key, value, scaling):
    """transformers' eager attention for one query row, grouped heads read in place: scores in the model's dtype,
    softmax in float32. query [b, heads, 1, d], key/value [b, kv_heads, kv, d] -> [b, 1, heads, d]."""
    import torch

    from .kernels import backend, native

    b, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    if backend() != "torch" and native.attends(query, key, value):  # the same roundings, each key read once
        return native.attend(query, key, value, scale), None
    q = query.reshape(b, kv_heads, heads // kv_heads, dim)  # a key/value head's query heads as its rows
    scores = torch.matmul(key, q.transpose(-1, -2)).transpose(-1, -2) * scale  # [b, kv_heads, rep, kv]; keys read in place
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # [b, kv_heads, rep, d]
    return out.reshape(b, 1, heads, value.shape[-1]), None


def sdpa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' sdpa, or the cascade attention of a batch."""
    if _SHARED.get() is not None:
        return shared_prefix_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def eager_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The modeling file's own eager attention (its public eager_attention_forward), or a batch's cascade."""
    if _SHARED.get() is not None:
        return shared_prefix_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    import importlib

    own = importlib.import_module(type(module).__module__).eager_attention_forward
    return own(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def register() -> str:
    """Register kvcli's attention functions (each with the mask builder of the attention it stands for), once."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

        for name, fn, mask in ((NAME, gqa_sdpa_attention, sdpa_mask), (SDPA_NAME, sdpa_attention, sdpa_mask),
                               (EAGER_NAME, eager_attention, eager_mask)):
            AttentionInterface.register(name, fn)
            AttentionMaskInterface.register(name, mask)
        _registered = True
    return NAME


def select(model: Any) -> bool:
    """Switch this model (only) to the kvcli function standing for its attention; True if switched.

    sdpa on the CPU gets grouped-query sdpa; sdpa elsewhere and eager attention get functions that do
    exactly what they did, plus the cascade path of batched questions. Other attentions are left alone
    (batched questions then run one at a time)."""
    import torch

    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "sdpa":
        name = NAME if torch.device(model.device).type == "cpu" else SDPA_NAME
    elif impl == "eager":
        name = EAGER_NAME
    else:
        return False
    register()
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name


def kernel_name(implementation: str | None) -> str:
    """The attention kernel behind an implementation name, as caches record it: kvcli's functions run
    torch's sdpa or the model's own eager attention (tests/engine/test_attention.py shows identical logits)."""
    return {NAME: "sdpa", SDPA_NAME: "sdpa", EAGER_NAME: "eager"}.get(implementation, str(implementation or "unknown"))


def shared_prefix_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                            softcap=None, **kwargs):
    """Attention of queries [active, heads, q, dim] over the shared document plus each row's own tokens.

    Two softmax parts combined exactly through their maxima and sums (as flash attention does across
    blocks). `key`/`value` are the layer's whole suffix buffers; the rows and slots come from the step.
    """
    import torch

    layer = _SHARED.get().layers[module.layer_idx]
    if key.data_ptr() != layer.keys.data_ptr() or value.data_ptr() != layer.values.data_ptr():
        # the layer changed its keys/values after the cache update (diffllama splits its values): the document's
        # copy read below would not be what the model attends to
        raise RuntimeError(f"{type(module).__name__} attends to other keys/values than its cache holds")
    step = layer.step  # batch.Step
    a, heads, q, dim = query.shape
    kv_heads = layer.prefix_keys.shape[1]
    rep = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    qf = query.to(work) * scale
    window, device = layer.sliding_window, query.device
    # slot of every query token in its row: [active, q]
    slots = step.once("slots", lambda: step.offsets[:, None] + torch.arange(q, device=device)[None, :])

    # Part 1: every row's queries against the one copy of the document: [kv_heads, active*rep*q, cached]
    qp = qf.reshape(a, kv_heads, rep * q, dim).transpose(0, 1).reshape(kv_heads, a * rep * q, dim)
    o1, m1, l1 = _document_part(layer, qp, work, softcap, slots)
    vdim = o1.shape[-1]
    o1 = o1.reshape(kv_heads, a, rep * q, vdim).transpose(0, 1)  # [active, kv_heads, rep*q, vdim]
    m1 = m1.reshape(kv_heads, a, rep * q, 1).transpose(0, 1)
    l1 = l1.reshape(kv_heads, a, rep * q, 1).transpose(0, 1)

    # Part 2: each row against its own tokens: [active, kv_heads, rep*q, used]
    used = step.once("used", lambda: int(step.offsets.max()) + q)
    sk = key[:, :, :used].index_select(0, step.rows).to(work)  # [active, kv_heads, used, dim]: only the used slots copied
    sv = value[:, :, :used].index_select(0, step.rows).to(work)
    s2 = torch.matmul(qf.reshape(a, kv_heads, rep * q, dim), sk.transpose(-1, -2))
    if softcap:
        s2 = torch.tanh(s2 / softcap) * softcap

    def own_tokens() -> torch.Tensor:  # causal within the row (and its window): [active, kv_heads, rep*q, used]
        key_slot = torch.arange(used, device=device)
        allowed = key_slot[None, None, :] <= slots[..., None]  # [active, q, used]
        if window is not None:
            allowed &= (slots[..., None] - key_slot[None, None, :]) < window
        return allowed[:, None, None].expand(a, kv_heads, rep, q, used).reshape(a, kv_heads, rep * q, used)

    s2 = s2.masked_fill(~step.once(("own", window, kv_heads, rep), own_tokens), float("-inf"))
    m2 = s2.amax(-1, keepdim=True)  # finite: every query sees its own token
    e2 = torch.exp(s2 - m2)
    l2 = e2.sum(-1, keepdim=True)
    o2 = torch.matmul(e2, sv)

    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * w1 + o2 * w2) / (l1 * w1 + l2 * w2)  # [active, kv_heads, rep*q, vdim]
    out = out.reshape(a, heads, q, vdim).transpose(1, 2).to(query.dtype)  # [active, q, heads, vdim]
    return out.contiguous(), None


def _document_part(layer, qp, work, softcap, slots):
    """Queries qp [kv_heads, n, dim] (scaled; n = active*rep*q, slots [active, q]) against the shared document:
    o [kv_heads, n, vdim] and the maxima m and sums l [kv_heads, n, 1] of its softmax, the attention being o / l.

    Without a window or softcap, on the CPU, torch's flash kernel does it in one call that reads each key once
    (o comes normalized: m is its log-sum-exp and l one), faster than the plain products for a batch
    (docs/performance.md, "Batched steps", has the measurement)."""
    import torch

    pk, pv = layer.prefix_keys[0], layer.prefix_values[0]  # [kv_heads, cached, dim]
    window = layer.sliding_window
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if (flash is not None and window is None and not softcap and qp.device.type == "cpu" and pk.dtype == work
            and pk.shape[-1] == pv.shape[-1]):
        o, lse = flash(qp[None], layer.prefix_keys, layer.prefix_values, scale=1.0)  # [1, kv_heads, n, vdim|-]
        return o[0], lse[0, ..., None], torch.ones_like(lse[0, ..., None])
    pk, pv = pk.to(work), pv.to(work)
    s1 = torch.matmul(qp, pk.transpose(-1, -2))
    if softcap:
        s1 = torch.tanh(s1 / softcap) * softcap
    if window is not None:  # the document's last keys sit at positions length-cached .. length-1
        cached, length, step = pk.shape[-2], layer.prefix_length, layer.step
        a, q = slots.shape
        rep = qp.shape[1] // (a * q)

        def document_window() -> torch.Tensor:  # [1, active*rep*q, cached]
            key_pos = length - cached + torch.arange(cached, device=qp.device)  # [cached]
            allowed = ((length + slots)[..., None] - key_pos) < window  # [active, q, cached]
            return allowed[:, None].expand(a, rep, q, cached).reshape(1, a * rep * q, cached)

        s1 = s1.masked_fill(~step.once(("document", window, cached, length, rep), document_window), float("-inf"))
    m1 = s1.amax(-1, keepdim=True)
    e1 = torch.exp(s1 - m1.clamp_min(torch.finfo(work).min))  # a fully masked row stays all-zero
    return torch.matmul(e1, pv), m1, e1.sum(-1, keepdim=True)
