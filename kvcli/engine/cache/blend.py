"""Several caches prefilled apart, blended into one prompt: documents in order, then the question.

The composed prompt's ids are the first cache's ids whole (its framing head included), then for each later
cache the framing separator ("\\n\\n", the glue) and that cache's ids without the shared framing head; the
question follows with the last cache's framing. A later document's cached keys sit at the positions it was
prefilled at; moving them is one rotary rotation by the offset d (R(p + d) = R(d) R(p)), values do not move.

Each later document attended only to itself when it was prefilled, never to the documents before it now:
that is what makes a blend approximate. Recompute (the selection rule): for each later document, its glue
and its first ceil(f * n) tokens run forward at their true positions on top of the cache composed so far (so
they see every earlier document), then the rest of its keys are moved into place. f = 0 recomputes only
the glue; f = 1 recomputes every later document whole, which is the exact prefill of the composed prompt.

Refused (BlendError, exit 3): models whose keys cannot be moved by one rotation: learned absolute positions
(GPT-2, OPT), rope scaling other than default/linear/llama3 (dynamic NTK and longrope depend on the sequence
length, YaRN scales attention), partial rotary, sliding-window layers, and architectures outside
SUPPORTED_TYPES (the ones the tests prove).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...requests import DEFAULT_RECOMPUTE, Blend  # noqa: F401  (DEFAULT_RECOMPUTE: this module's name for it)
from ...errors import BlendError, CacheMismatchError, PromptTooLongError, UsageError
from ..model.fingerprint import text_config
from ..prompt import framing as fr
from . import layers as ly

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")  # rotate_half rotary over the whole head, proven by tests/engine/test_blend.py
SUPPORTED_ROPE = ("default", "linear", "llama3")  # frequencies fixed per position: R(p + d) = R(d) R(p) holds


@dataclass
class Blended:
    """A composed cache and what it stands for: prompt ids, the framing questions follow, and the record."""

    cache: Any  # KVCache holding the composed prompt (mark = its length)
    token_ids: list[int]
    framing: fr.Framing
    documents: int
    recompute: float
    recomputed_tokens: int  # glue and document tokens run forward (the first document's not counted: restored)
    moved_tokens: int  # cached tokens rotated into place
    caches: list[str] = field(default_factory=list)
    storage: str = "lossless"  # the lossiest of the caches' storage

    def record(self) -> dict[str, Any]:
        """What --json and the check report: the answer is approximate, and how much was recomputed."""
        return {"documents": self.documents, "recompute": self.recompute, "recomputed_tokens": self.recomputed_tokens,
                "moved_tokens": self.moved_tokens, "caches": list(self.caches)}

    def describe(self) -> str:
        return f"{self.documents} documents blended, {self.recompute:g} of each later one recomputed"


def check_fraction(recompute: float) -> float:
    return Blend(recompute).recompute


def check_supported(lm: Any) -> None:
    """BlendError unless this model's cached keys can be moved exactly by one rotary rotation."""
    config = lm.model.config
    text = text_config(config)
    model_type = getattr(config, "model_type", "unknown")
    decoder = lm.model.get_decoder() if hasattr(lm.model, "get_decoder") else None
    if getattr(decoder, "rotary_emb", None) is None:
        raise BlendError(f"model type '{model_type}' has no rotary position embedding (learned absolute positions): its "
                         "cached keys cannot move to new positions, so its caches cannot be blended")
    if any(kind == "sliding" for kind, _w in ly.plan(config)):
        raise BlendError(f"model type '{model_type}' has sliding-window layers: a blended document would need keys its "
                         "cache does not keep; its caches cannot be blended")
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default"}
    if "rope_type" not in rope:
        raise BlendError(f"model type '{model_type}' uses several rotary embeddings (one per layer type); blending "
                         "supports one")
    if rope["rope_type"] not in SUPPORTED_ROPE:
        raise BlendError(f"model type '{model_type}' uses {rope['rope_type']} rope scaling, under which moving a key is "
                         f"not one rotation; blending supports {', '.join(SUPPORTED_ROPE)}")
    if float(rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise BlendError(f"model type '{model_type}' rotates only part of each head (partial rotary); blending does not "
                         "support it")
    if model_type not in SUPPORTED_TYPES:
        raise BlendError(f"model type '{model_type}': blending is proven only for {', '.join(SUPPORTED_TYPES)}")


def rotation(lm: Any, offset: int):
    """cos, sin [head_dim] (float32) of the model's own rotary embedding at position `offset`, without any
    attention scaling (the cached keys carry it already)."""
    import torch

    rotary = lm.model.get_decoder().rotary_emb
    x = torch.zeros(1, device=lm.device, dtype=torch.float32)  # only its dtype and device are read
    cos, sin = rotary(x, torch.tensor([[offset]], device=lm.device))  # [1, 1, head_dim]
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    return cos[0, 0].float() / scale, sin[0, 0].float() / scale


def move_keys(keys, cos, sin):
    """Keys [b, h, n, d] rotated by the angle whose cos/sin [d] are given (rotate_half layout), in float32."""
    k = keys.float()
    half = k.shape[-1] // 2
    out = k * cos  # plus rotate_half(k) * sin, rotate_half: (x1, x2) -> (-x2, x1), in place by halves
    out[..., :half].addcmul_(k[..., half:], sin[:half], value=-1)
    out[..., half:].addcmul_(k[..., :half], sin[half:])
    return out.to(keys.dtype)


def move_layers(keys: list, cos, sin) -> list:
    """Every layer's keys [b, h, n, d] rotated as move_keys does: in one pass over them stacked where their shapes
    agree (a handful of kernels instead of a handful a layer; the same elementwise products, the same bits)."""
    import torch

    if len(keys) > 1 and len({(tuple(k.shape), k.dtype) for k in keys}) == 1:
        return list(move_keys(torch.stack(keys), cos, sin).unbind(0))  # [layers, b, h, n, d]
    return [move_keys(k, cos, sin) for k in keys]


def head_ids(tokenizer: Any, framing: fr.Framing) -> list[int]:
    """The framing head every cache of this framing starts with (chat: the template up to the document)."""
    return fr.head_ids(tokenizer, framing)


def _glue(tokenizer: Any, before: fr.Framing, cached: list[int], where: str) -> list[int]:
    """Ids between one document and the next: the earlier document's pending text (a framing cut) and the
    separator, tokenized together; a cut's anchor ids are checked against the cache and dropped."""
    text = before.anchor + before.pending + fr.SEPARATOR
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    k = before.anchor_tokens
    if k:
        if ids[:k] != list(cached[-k:]):
            raise BlendError(f"{where}: the end of this document tokenizes differently before the next one; "
                             "it can be blended only as the last document")
        ids = ids[k:]
    return ids


def compose(lm: Any, opened: list[Any], recompute: float = DEFAULT_RECOMPUTE, *, room: int | None = None,
            rule: str = "first") -> Blended:
    """Blend opened caches (format.store.OpenedCache, each already checked against lm by fit.check_fits)
    into one KVCache: the first restored whole, each later one glued, partly recomputed, the rest moved.
    rule: which tokens of a later document are recomputed: "first" (kvcli's rule) or "last" (measured
    against it by tests/bench/bench_blend.py --rule last)."""
    import torch

    from ..prefilling import DEFAULT_CHUNK
    from ..scheduling.scheduler import engine_for
    from .restore import ROOM_TOKENS, load_cache, load_states

    recompute = check_fraction(recompute)
    if rule not in ("first", "last"):
        raise ValueError(f"rule {rule!r}: 'first' or 'last'")
    if len(opened) < 2:
        raise UsageError("blending needs at least two caches")
    check_supported(lm)
    tok = lm.tokenizer
    first = opened[0].manifest
    framings = [fr.Framing.from_record(o.manifest.framing) for o in opened]
    for o in opened[1:]:
        m = o.manifest
        same = (m.framing.get("kind"), m.framing.get("system"), m.framing.get("template_sha256"))
        if same != (first.framing.get("kind"), first.framing.get("system"), first.framing.get("template_sha256")):
            raise CacheMismatchError(f"{o.path}: framed differently ({m.framing.get('kind')}, system "
                                     f"{m.framing.get('system')!r}) from {opened[0].path}; blended caches share one framing")
        if m.dtype != first.dtype:
            raise CacheMismatchError(f"{o.path}: keys/values in {m.dtype}, {opened[0].path} in {first.dtype}; "
                                     "blended caches share one dtype")
    head = head_ids(tok, framings[0])
    ids = list(first.token_ids)
    plans = []  # (opened, glue, body start, recomputed count)
    for i, o in enumerate(opened[1:], start=1):
        m = o.manifest
        if list(m.token_ids[: len(head)]) != head:
            raise BlendError(f"{o.path}: its ids do not start with the framing head tokenized alone; it cannot be blended")
        glue = _glue(tok, framings[i - 1], ids, str(opened[i - 1].path))
        n = len(m.token_ids) - len(head)
        r = min(n, math.ceil(recompute * n))
        plans.append((o, glue, len(head), r))
        ids += glue + list(m.token_ids[len(head):])
    limit = getattr(lm, "max_positions", None)
    if limit and len(ids) >= limit:
        raise PromptTooLongError(f"{PromptTooLongError.LEAD}the blended documents need {len(ids)} of the model's {limit} positions")
    extra = ROOM_TOKENS if room is None else room
    cache = load_cache(opened[0], device=lm.device, dtype=lm.dtype, room=len(ids) - len(first.token_ids) + extra)
    recomputed = moved = 0
    engine = engine_for(lm)

    def forward(run: list[int]) -> None:
        """Run ids at their true positions, on top of everything composed so far: a chunk per turn of the
        model's engine (answers decoding on the model go on between two chunks)."""
        nonlocal recomputed
        for at in range(0, len(run), DEFAULT_CHUNK):
            chunk = torch.tensor([run[at : at + DEFAULT_CHUNK]], device=lm.device)  # [1, <= DEFAULT_CHUNK]
            with engine.turn():
                lm.model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
        recomputed += len(run)

    def move(states, lo: int, hi: int) -> None:
        """Append the cached tokens stored at positions [lo, hi), their keys rotated to land at the cache's end."""
        nonlocal moved
        if hi > lo:
            cos, sin = rotation(lm, cache.get_seq_length() - lo)
            keys = move_layers([s.keys[:, :, lo:hi] for s in states], cos, sin)  # each [b, kv_heads, hi - lo, head_dim]
            for layer, s, k in zip(cache.layers, states, keys):
                layer.update(k, s.values[:, :, lo:hi])
            moved += hi - lo

    with torch.inference_mode():
        for o, glue, start, r in plans:
            states = load_states(o, device=lm.device, dtype=lm.dtype, room=0)
            body = list(o.manifest.token_ids[start:])
            if rule == "first":
                forward(glue + body[:r])
                move(states, start + r, start + len(body))
            else:  # "last": the tokens nearest the question recomputed
                forward(glue)
                move(states, start, start + len(body) - r)
                forward(body[len(body) - r:])
            del states
    for layer in cache.layers:
        layer.mark = layer.offset  # the composed prompt is the document now: questions rewind to its end
    cache.rewind()
    if cache.get_seq_length() != len(ids):
        raise BlendError(f"the blended cache holds {cache.get_seq_length()} tokens, its prompt {len(ids)}")
    storages = [o.manifest.storage for o in opened if o.manifest.storage != "lossless"]
    return Blended(cache=cache, token_ids=ids, framing=framings[-1], documents=len(opened), recompute=recompute,
                   recomputed_tokens=recomputed, moved_tokens=moved, caches=[str(o.path) for o in opened],
                   storage=storages[0] if storages else "lossless")
