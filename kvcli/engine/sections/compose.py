"""Chosen sections of a sectioned cache composed into one prompt: the framing head, then the sections in document
order joined by the separator, as one document.

The head is restored as stored (exact). Each section's stored keys sit at the positions it was computed at (after
its primer); they are moved to their place in the prompt by one rotary rotation (engine/cache/blend.py). As a
blend does, each section's glue and first ceil(f * n) tokens are recomputed so that they see the sections chosen
before it; the first section composed, right after the head, has none before it and is kept as stored (recomputing
it would only trade its primer for nothing; at f = 1 it is recomputed, so that the prompt is exact). All the
recomputed tokens of all sections run in one forward pass at their true positions: the moved keys are put in the
cache first, and a mask lets each recomputed token see exactly the tokens before it in the prompt (the cache's
order of slots is not the prompt's; attention depends only on positions and the mask). With `defer`, the last of
those passes (up to a chunk of tokens) is left pending on the cache (kvcache.Pending): the question's own first pass
runs them in front of its ids, so a question reads the weights once instead of twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import CacheCorruptError, PromptTooLongError
from ..prompt import framing as fr


@dataclass
class Composed:
    cache: Any  # KVCache holding the composed prompt (mark = its length)
    token_ids: list[int]  # the prompt's ids in order
    framing: fr.Framing  # the last section's: questions follow it
    chosen: list[int]
    recompute: float
    recomputed_tokens: int
    moved_tokens: int
    starts: list[int] = field(default_factory=list)  # where each chosen section's ids start in token_ids


def part_framing(manifest: Any, part: Any) -> fr.Framing:
    """The framing a question follows when `part` comes last (its own cut)."""
    cut = part.framing
    return fr.Framing(kind=manifest.framing["kind"], system=manifest.framing.get("system"), anchor=cut.get("anchor", ""),
                      anchor_tokens=int(cut.get("anchor_tokens", 0)), pending=cut.get("pending", ""))


def prompt_ids(lm: Any, manifest: Any, chosen: list[int]) -> tuple[list[int], list[tuple[Any, list[int], int]]]:
    """The composed prompt's ids, and per chosen section (part, glue ids, where its ids start)."""
    from ..cache import blend as bl

    parts = manifest.sections.parts
    ids = list(manifest.token_ids)
    plans, prev = [], None
    for i in sorted(chosen):
        p = parts[i]
        glue = [] if prev is None else bl._glue(lm.tokenizer, part_framing(manifest, prev), ids, f"section {prev.index}")
        plans.append((p, glue, len(ids) + len(glue)))
        ids += glue + p.token_ids
        prev = p
    return ids, plans


def restore_head(lm: Any, opened: Any) -> Any:
    """The sectioned cache's head restored (read and verified) once, as a copy every question's compose starts from
    (tiers.HostCopy of the layers, on lm's device)."""
    from ..cache import tiers
    from ..cache.restore import load_cache

    return tiers.HostCopy(load_cache(opened, device=lm.device, dtype=lm.dtype, room=0).states())


def _move_section(lm: Any, opened: Any, part: Any, r: int, start: int, cache: Any) -> None:
    """Append section `part`'s stored keys/values after its first r tokens to every layer of `cache`, the keys
    rotated from where they were computed to `start` on (only this section's shards read; a damaged one named).
    The shards decode straight into the layers' free room; the first r tokens are then overwritten by the rest."""
    from ...format import parts, sections as sec
    from ..cache import blend as bl
    from ..cache.restore import restore_into

    n = part.num_tokens
    rooms = [layer.room(n) for layer in cache.layers]  # each (keys, values) [b, kv_heads, n, head_dim]
    with parts.open_part(opened.path, opened.manifest, part.index) as stored:
        try:
            restore_into(stored, rooms)
        except CacheCorruptError as exc:
            raise sec.named(part, exc) from None
    kept = [k[:, :, r:] for k, _v in rooms]  # each [b, kv_heads, n - r, head_dim]
    if start != part.position:  # (a turn by 0 would give the same bits)
        kept = bl.move_layers(kept, *bl.rotation(lm, start - part.position))
    elif r:  # copied first: below, the kept tokens move down over the recomputed ones' slots, which they overlap
        kept = [k.clone() for k in kept]
    for layer, (k, v), keys in zip(cache.layers, rooms, kept):
        if r or start != part.position:
            k[:, :, : n - r].copy_(keys)
        if r:
            v[:, :, : n - r].copy_(v[:, :, r:].clone())
        layer.advance(n - r)


def _recompute(lm: Any, cache: Any, ids: list[int], pos: list[int], slots: list[int]) -> None:
    """Run `ids` (at prompt positions `pos`) through the model into `cache` a chunk at a time, each token seeing the
    cache slots before it in the prompt (`slots`: each slot's prompt position, extended with `pos` as they go)."""
    from ..cache.kvcache import Pending
    from ..prefilling import DEFAULT_CHUNK
    from ..scheduling.scheduler import engine_for

    engine = engine_for(lm)
    for at in range(0, len(ids), DEFAULT_CHUNK):
        chunk = Pending(ids[at : at + DEFAULT_CHUNK], pos[at : at + DEFAULT_CHUNK], list(slots))  # its inputs and mask
        with engine.turn():
            lm.model(**chunk.inputs([], lm.device), cache=cache, use_cache=True, logits_to_keep=1)
        slots += chunk.positions


def compose(lm: Any, opened: Any, chosen: list[int], recompute: float, *, room: int | None = None,
            head_copy: Any = None, defer: bool = False) -> Composed:
    """The composed cache of the chosen sections of the sectioned cache `opened` (format.store.OpenedCache, checked
    against lm), only those sections' shards read. head_copy: restore_head's (else the head is read here). defer:
    the last chunk of recomputed tokens left pending on the cache, for the next forward pass (the question's)."""
    import torch

    from ..cache import blend as bl, tiers
    from ..cache.kvcache import Pending
    from ..cache.restore import ROOM_TOKENS, load_cache
    from ..prefilling import DEFAULT_CHUNK

    recompute = bl.check_fraction(recompute)
    bl.check_supported(lm)
    m = opened.manifest
    head = len(m.token_ids)
    ids, plans = prompt_ids(lm, m, chosen)
    limit = getattr(lm, "max_positions", None)
    if limit and len(ids) >= limit:
        raise PromptTooLongError(f"{PromptTooLongError.LEAD}the {len(plans)} sections chosen need {len(ids)} of the "
                                 f"model's {limit} positions")
    extra = ROOM_TOKENS if room is None else room
    if head_copy is None:
        cache = load_cache(opened, device=lm.device, dtype=lm.dtype, room=len(ids) - head + extra)
    else:
        cache = tiers.from_host(head_copy, None, len(ids) - head + extra)
    slots = list(range(head))  # the prompt position of each cache slot
    run_ids: list[int] = []
    run_pos: list[int] = []
    moved = 0
    with torch.inference_mode():
        for p, glue, start in plans:
            n = p.num_tokens
            # the first section composed has no chosen section before it: kept as computed after its primer (below 1)
            exact = start == head and (p.position == head or recompute < 1)
            r = 0 if exact else min(n, math.ceil(recompute * n))
            run_ids += glue + p.token_ids[:r]
            run_pos += list(range(start - len(glue), start + r))
            if r < n:
                _move_section(lm, opened, p, r, start, cache)
                slots += range(start + r, start + n)
                moved += n - r
        last = (len(run_ids) - 1) // DEFAULT_CHUNK * DEFAULT_CHUNK if defer else len(run_ids)  # where the pending tokens start
        _recompute(lm, cache, run_ids[: max(0, last)], run_pos[: max(0, last)], slots)
    for layer in cache.layers:
        layer.mark = layer.offset  # the composed prompt is the document now: questions rewind to its end
    cache.rewind()
    if 0 <= last < len(run_ids):
        cache.pending = Pending(run_ids[last:], run_pos[last:], list(slots))
        slots += run_pos[last:]
    held = cache.get_seq_length() + (len(cache.pending.ids) if cache.pending else 0)
    if held != len(ids) or sorted(slots) != list(range(len(ids))):
        raise RuntimeError(f"the composed cache holds {held} tokens, its prompt {len(ids)}")
    return Composed(cache=cache, token_ids=ids, framing=part_framing(m, plans[-1][0]), chosen=[p.index for p, _g, _s in plans],
                    recompute=recompute, recomputed_tokens=len(run_ids), moved_tokens=moved,
                    starts=[s for _p, _g, s in plans])
