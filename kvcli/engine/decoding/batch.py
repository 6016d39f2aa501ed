"""Many questions on one document at once: every decoding step reads the weights once for all of them.

The questions share the document's restored keys/values, read-only and never copied per question; each
question appends its own tokens to a row of a small suffix buffer. Attention runs in two parts merged
exactly by their log-sum-exp (cascade attention): every question's queries against the one copy of
the document at once, then each question against its own tokens. A finished question leaves the
batch and a waiting one takes its row between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..model import attention
from ..model.linear import weight_first, weight_first_helps
from ..cache.shared import GROW_TOKENS, SharedPrefixCache, Step
from .protocol import Row, RowQueue, take


class BatchDecoder(RowQueue):
    """The batch, one step at a time (engine/decoding/protocol.py's Decoder): rows join between steps, leave
    when finished (or dropped).

    Holds at most `width` rows in a SharedPrefixCache over the document's `states` (the suffix buffers go
    with the decoder: the engine drops it once its document has no asker left). step() runs one forward
    pass: the joining rows' own tokens if any wait (they share one padded pass), else one new token for
    every active row.
    """

    def __init__(self, model: Any, states: Sequence[Any], *, width: int, eos: set[int], pad_id: int,
                 length: int | None = None):
        super().__init__(model, states, eos, length)
        self.states, self.width, self.pad_id = states, width, pad_id
        self.device = states[0].keys.device
        self.cache: SharedPrefixCache | None = None
        self.free = list(range(width))
        self.mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)  # a 4D mask is passed as-is
        self.weight_first = weight_first_helps(model)  # float32 linear layers on the CPU: engine/model/linear.py

    def bytes(self) -> int:
        """The suffix buffers' bytes (held until the engine lets this decoder go)."""
        layers = self.cache.layers if self.cache is not None else ()
        return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))

    def _leave(self, row: Row) -> None:
        self.free.append(row.slot)

    def _forward(self, batch: list[Row], ids: torch.Tensor, uniform: int | None, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, q, vocab] of ids [rows, q] at each row's slots; [rows, 1, vocab] at positions `last` [rows, 1]."""
        q = ids.shape[1]
        cache = self._room(max(r.offset for r in batch) + q, batch)
        self.last_rows = len(batch)
        offsets = torch.tensor([r.offset for r in batch], device=self.device)
        cache.begin(Step(torch.tensor([r.slot for r in batch], device=self.device), offsets, uniform, q))
        positions = self.cached_length + offsets[:, None] + torch.arange(q, device=self.device)[None, :]  # [active, q]
        extra = {"logits_to_keep": last} if last is not None and self.keeps_logits else {}
        with attention.sharing(cache), weight_first(self.weight_first):  # attention reads the document from `cache`
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=self.mask, cache=cache, use_cache=True,
                             **extra)
        if last is not None and not extra:
            return out.logits.gather(1, last[..., None].expand(-1, -1, out.logits.shape[-1]))
        return out.logits  # [active, q or 1, vocab]

    def _room(self, need: int, rows: list[Row]) -> SharedPrefixCache:
        """The suffix buffers, with room for `need` tokens per row (grown in steps, never past the longest answer)."""
        longest = max(len(r.appended) + r.max_new for r in self.active + rows)
        if self.cache is None:
            self.cache = SharedPrefixCache(self.states, self.width, max(need, min(longest, need + GROW_TOKENS)))
        elif need > self.cache.capacity:
            self.cache.grow(max(need, min(longest, need + GROW_TOKENS)))
        return self.cache

    def adopt(self, row: Row, own: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take in a row that has been decoding elsewhere (engine/decoding/lone.py): `own` holds, per layer, the keys
        and values [1, kv_heads, n, head_dim] of its n own tokens so far (its question and all but its last answer
        id), copied into a free row; it goes on with the others at the next step."""
        n = own[0][0].shape[2]
        if n != len(row.appended) + len(row.answer) - 1 or not self.free:
            raise RuntimeError(f"cannot take in a row holding {n} tokens ({len(row.appended)} asked, {len(row.answer)} answered)")
        cache = self._room(n + 1, [row])
        row.slot, row.offset = self.free.pop(0), n
        for layer, (k, v) in zip(cache.layers, own):
            layer.keys[row.slot, :, :n].copy_(k[0])
            layer.values[row.slot, :, :n].copy_(v[0])
        self.active.append(row)

    def step(self) -> list[Row]:
        """One forward pass; returns the rows it finished (their slots are free again)."""
        with torch.inference_mode():
            joining = []
            while self.waiting and self.free:
                row = self.waiting.pop(0)
                row.slot, row.offset = self.free.pop(0), 0
                joining.append(row)
            if joining:  # the questions' own ids, right-padded; pads are never attended by real tokens
                q = max(len(r.appended) for r in joining)
                ids = torch.full((len(joining), q), self.pad_id, dtype=torch.long, device=self.device)
                for i, r in enumerate(joining):
                    ids[i, : len(r.appended)] = torch.tensor(r.appended, device=self.device)
                last = torch.tensor([[len(r.appended) - 1] for r in joining], device=self.device)  # [rows, 1]
                try:
                    logits = self._forward(joining, ids, 0, last)
                except BaseException:  # they wait again (the caller decides whether to drop them)
                    self.free.extend(r.slot for r in joining)
                    self.waiting[:0] = joining
                    raise
                self.active += joining
                for i, r in enumerate(joining):
                    r.offset = len(r.appended)
                    r.processed += len(r.appended)
                    take(r, logits[i, 0].float(), self.eos)
            elif self.active:
                ids = torch.tensor([[r.answer[-1]] for r in self.active], device=self.device)
                logits = self._forward(self.active, ids, None)
                for i, r in enumerate(self.active):
                    r.offset += 1
                    r.processed += 1
                    take(r, logits[i, 0].float(), self.eos)
        return self._finished()


def decode_rows(model: Any, states: Sequence[Any], rows: list[Row], *, batch_size: int, eos: set[int], pad_id: int) -> None:
    """Run every row to its end through one BatchDecoder, outside any engine (the batching probe, tests), at most
    batch_size at once; rows fill in place (answer, timings)."""
    if not rows:
        return
    decoder = BatchDecoder(model, states, width=min(batch_size, len(rows)), eos=eos, pad_id=pad_id)
    for row in rows:
        decoder.add(row)
    while decoder.busy:
        decoder.step()


def padding_id(tokenizer: Any, model: Any) -> int:
    for candidate in (tokenizer.pad_token_id, model.generation_config.pad_token_id, tokenizer.eos_token_id, 0):
        if isinstance(candidate, int):
            return candidate
    return 0


def eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
