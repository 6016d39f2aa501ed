"""kvcli's cache object: a transformers Cache built from kvcli's own layer classes, with room to grow.

Full-attention layers follow mlx-lm's KVCache: keys/values live in a preallocated buffer
[batch, kv_heads, capacity, head_dim] plus an offset; `update` writes the new tokens at
[offset:offset+n] (a bigger buffer is allocated, and the used part copied, only when full) and
returns views [:offset+n]. Sliding-window layers are transformers' own (last window-1 tokens plus
the counted length). A restored document is a cache whose `mark` is the document's length:
`rewind()` brings it back there after a question without copying, and the document's tokens
[:mark] are never written (new tokens land after them; growth copies them into a new buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from . import layers as ly
from ...errors import ModelError

GROW_STEP = 256  # tokens: buffers grow in multiples of this (room for a question and its answer)


class FullLayer(DynamicLayer):
    """Full attention: a preallocated buffer plus an offset, appended in place (mlx-lm's KVCache idiom)."""

    def __init__(self, reserve: int = 0, step: int = GROW_STEP, **kwargs):
        super().__init__()
        self.reserve, self.step = reserve, step  # reserve: tokens allocated at the first update (a prefill of known length)
        self.offset = 0  # tokens in use
        self.mark = 0  # the document's length: rewind() goes back here
        self._k: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None
        self._arrival = None  # set by a restore onto a device: makes the reader wait for this layer's copy

    def arriving(self, wait) -> None:
        """The document's keys/values are still being copied in: `wait()` orders whatever reads them next
        after the copy (on CUDA the compute stream waits on the layer's event; the host does not block)."""
        self._arrival = wait

    def arrive(self) -> None:
        """Wait for this layer's restore (once; nothing to do for a layer already here)."""
        wait, self._arrival = self._arrival, None
        if wait is not None:
            wait()

    # ---- buffers
    def allocate(self, key_shape, value_shape, dtype, device, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate buffers for `key_shape[-2]` document tokens plus `room`; return the document's views to fill."""
        n = key_shape[-2]
        self._k = torch.empty((*key_shape[:2], n + room, key_shape[3]), dtype=dtype, device=device)
        self._v = torch.empty((*value_shape[:2], n + room, value_shape[3]), dtype=dtype, device=device)
        self.device, self.is_initialized = self._k.device, True
        self.offset = self.mark = n
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.offset], self._v[:, :, : self.offset]  # [b, h, offset, d]

    def _grow(self, need: int) -> None:
        """Move to a buffer for at least `need` tokens, copying the used part: `need` rounded up to whole steps,
        at least one step more, never a fraction of the whole cache (a long document must not grow by a quarter
        of itself for a few answer tokens)."""
        self.arrive()  # the used part is copied below
        cap = self._k.shape[2]
        new = max(need, cap + self.step)
        new = -(-new // self.step) * self.step
        bufs = []
        for old in (self._k, self._v):
            buf = torch.empty((*old.shape[:2], new, old.shape[3]), dtype=old.dtype, device=old.device)
            buf[:, :, : self.offset].copy_(old[:, :, : self.offset])
            bufs.append(buf)
        self._k, self._v = bufs  # assigned once filled: a reader of the document's views sees old or new, both whole

    def ensure(self, tokens: int) -> None:
        """Room for `tokens` more after the used part (one growth now, if any, instead of several later)."""
        if self.is_initialized and self._k is not None and self.offset + tokens > self._k.shape[2]:
            self._grow(self.offset + tokens)
            self._views()

    def room(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [b, h, tokens, d] of the free slots after the used part (grown first if short), to be written in
        place and then taken into use with advance(tokens)."""
        self.ensure(tokens)
        end = self.offset + tokens
        return self._k[:, :, self.offset : end], self._v[:, :, self.offset : end]

    def advance(self, tokens: int) -> None:
        """The next `tokens` slots, written through room(), are in use."""
        if self.offset + tokens > self.capacity:
            raise ValueError(f"advance({tokens}) past the layer's {self.capacity} slots")
        self.offset += tokens
        self._views()

    @property
    def capacity(self) -> int:
        return self._k.shape[2] if self._k is not None else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, q, d = key_states.shape
        cap = max(self.reserve, q)
        self._k = torch.empty((b, h, cap, d), dtype=key_states.dtype, device=key_states.device)
        self._v = torch.empty((*value_states.shape[:2], cap, value_states.shape[3]), dtype=value_states.dtype, device=value_states.device)
        self.device, self.is_initialized, self.offset = key_states.device, True, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write [b, h, q, d] new keys/values after the used part; return views of everything so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.arrive()  # attention reads the document's keys/values returned below
        q = key_states.shape[-2]
        if self.offset + q > self._k.shape[2]:
            self._grow(self.offset + q)
        self._k[:, :, self.offset : self.offset + q].copy_(key_states)
        self._v[:, :, self.offset : self.offset + q].copy_(value_states)
        self.offset += q
        self._views()
        return self.keys, self.values

    # ---- lengths
    def get_seq_length(self) -> int:
        return self.offset

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (transformers' convention); no copy, the next update overwrites."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.offset = max(0, self.offset + tokens_to_remove)
            self.mark = min(self.mark, self.offset)  # cropped into the document: that is the document now
            self._views()

    def rewind(self) -> None:
        if self.is_initialized:
            self.offset = self.mark
            self._views()

    def document(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the document's keys/values [b, h, mark, d] (never written while the layer lives)."""
        k, v = self._k, self._v  # read once: a concurrent growth swaps both attributes
        return k[:, :, : self.mark], v[:, :, : self.mark]

    @property
    def document_length(self) -> int:
        return self.mark

    def reset(self) -> None:
        self.offset = self.mark = 0  # an emptied cache has no document to go back to
        if self.is_initialized:
            self._views()

    # ---- batch operations (beam search and friends): applied to the buffers, views rebuilt
    def _map(self, fn) -> None:
        if self.is_initialized:
            self.arrive()
            self._k, self._v = fn(self._k), fn(self._v)
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self._k.device != self.device:
            self._map(lambda t: t.to(self.device, non_blocking=True))


class SlidingLayer(DynamicSlidingWindowLayer):
    """Sliding window: transformers' layer (it never writes into the tensors it holds), plus the document's
    state to rewind to: its last window-1 keys/values and its counted length."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self._doc: tuple[Any, Any, int] | None = None
        self._arrival = None

    arriving = FullLayer.arriving
    arrive = FullLayer.arrive

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.arrive()  # transformers' update reads the window's keys/values
        return super().update(key_states, value_states, *args, **kwargs)

    def restore(self, keys: torch.Tensor, values: torch.Tensor, seq_length: int) -> None:
        """Hold a document's state: keys/values [b, h, min(n, window-1), d] and its counted length n."""
        self.lazy_initialization(keys, values)  # device, dtype and the window tensor, as transformers sets them
        self._doc = (keys, values, seq_length)
        self.rewind()

    def rewind(self) -> None:
        if self._doc is not None:
            self.keys, self.values, self.cumulative_length = self._doc  # counted length, not keys.shape[-2]
            self.is_initialized = True

    def reset(self) -> None:
        self._doc = None  # an emptied cache has no document to go back to
        super().reset()

    def document(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The document's last window-1 keys/values [b, h, min(n, window-1), d] (never written)."""
        return self._doc[0], self._doc[1]

    @property
    def document_length(self) -> int:
        return self._doc[2] if self._doc is not None else 0


@dataclass
class Pending:
    """Prompt tokens whose keys/values are still to be computed, run in front of the next forward pass's ids (a
    composed prompt's recomputed tokens, engine/sections/compose.py; one pass then reads the weights for both):
    their ids and prompt positions, and the prompt position of each slot already in the cache (not in order)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]

    def inputs(self, ids: list[int], device: Any) -> dict[str, torch.Tensor]:
        """model(**inputs) for the pending tokens then `ids` (which follow the whole prompt): input_ids and
        position_ids [1, p + q], attention_mask [1, 1, p + q, slots + p + q] letting each token see exactly the
        tokens before it in the prompt (the cache's slot order is not the prompt's)."""
        n = len(self.slots) + len(self.ids)
        q_pos = torch.tensor(self.positions + list(range(n, n + len(ids))), device=device)  # [p + q]
        k_pos = torch.cat([torch.tensor(self.slots, device=device), q_pos])  # [slots + p + q]
        return {"input_ids": torch.tensor([self.ids + list(ids)], device=device), "position_ids": q_pos[None],
                "attention_mask": (k_pos[None, :] <= q_pos[:, None])[None, None]}


class KVCache(Cache):
    """kvcli's cache: one FullLayer or SlidingLayer per decoder layer, and the tokens it has processed.

    `processed` counts the tokens that went through layer 0's update since the last rewind: the tokens
    the model actually ran for this cache (per cache object, so concurrent questions count their own).
    `pending`: the document's tokens still to compute (Pending), run by the next forward pass (forward_inputs).
    """

    def __init__(self, layers: list[FullLayer | SlidingLayer]):
        super().__init__(layers=layers)
        self.processed = 0
        self.restore_stats = None  # restore.RestoreStats of the restore that made it
        self.pending: Pending | None = None

    def forward_inputs(self, ids: list[int], device: Any) -> dict[str, torch.Tensor] | None:
        """model(**inputs) with the pending tokens in front of `ids`; None when none are pending (the caller's own
        inputs then). After that pass returns, settled() makes them the document's."""
        return self.pending.inputs(ids, device) if self.pending is not None else None

    def settled(self) -> None:
        """The pending tokens went through a forward pass (in front of others): they are the document's now, kept
        by rewind(), and not counted as processed for the question that ran them."""
        done, self.pending = self.pending, None
        self.processed -= len(done.ids)
        for layer in self.layers:
            layer.mark += len(done.ids)

    def settle(self, model: Any) -> None:
        """Run the pending tokens alone (before a batch reads the document's states); the caller holds the model."""
        if self.pending is not None:
            with torch.inference_mode():
                model(**self.forward_inputs([], model.device), cache=self, use_cache=True, logits_to_keep=1)
            self.settled()

    @classmethod
    def for_plan(cls, plan: list[tuple[str, int | None]], reserve: int = 0) -> "KVCache":
        """An empty cache for layers of these (kind, window); full layers allocate `reserve` tokens at first use."""
        return cls([FullLayer(reserve=reserve) if kind == "full" else SlidingLayer(window) for kind, window in plan])

    @classmethod
    def for_model(cls, config: Any, reserve: int = 0) -> "KVCache":
        return cls.for_plan(ly.plan(config), reserve)

    @classmethod
    def from_states(cls, states: list[ly.LayerState], room: int = GROW_STEP, plan=None) -> "KVCache":
        """A cache holding a copy of these states (documents' own buffers: nothing is shared with `states`)."""
        if plan is not None:
            check_layout(plan, states)
        cache = cls.for_plan([(s.kind, s.sliding_window) for s in states])
        for layer, s in zip(cache.layers, states):
            if isinstance(layer, FullLayer):
                k, v = layer.allocate(tuple(s.keys.shape), tuple(s.values.shape), s.keys.dtype, s.keys.device, room)
                k.copy_(s.keys)
                v.copy_(s.values)
            else:
                layer.restore(s.keys.clone(), s.values.clone(), s.seq_length)
        return cache

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self.processed += key_states.shape[-2]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def ensure(self, tokens: int) -> None:
        """Room for `tokens` more in every full-attention layer (a question and its answer: grown once, if at all)."""
        for layer in self.layers:
            if isinstance(layer, FullLayer):
                layer.ensure(tokens)

    def nbytes(self) -> int:
        """Bytes of every buffer this cache holds now (spare room included; views counted once)."""
        seen, total = set(), 0
        for layer in self.layers:
            for t in ((layer._k, layer._v) if isinstance(layer, FullLayer) else (*(layer._doc or ())[:2], layer.keys, layer.values)):
                if isinstance(t, torch.Tensor) and t.numel():
                    st = t.untyped_storage()
                    if st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
        return total

    def rewind(self) -> None:
        """Back to the document's length, without copying; the processed count starts again at 0."""
        for layer in self.layers:
            layer.rewind()
        self.processed = 0

    def arrive(self) -> None:
        """Order whatever reads any layer next after that layer's restore (see FullLayer.arriving)."""
        for layer in self.layers:
            layer.arrive()

    def states(self, wait: bool = True) -> list[ly.LayerState]:
        """The document's state of every layer (views, not copies). wait=False: the views without waiting for a
        restore still copying them in (for their shapes and lengths; reading them needs arrive())."""
        if wait:
            self.arrive()
        out = []
        for layer in self.layers:
            k, v = layer.document()
            if isinstance(layer, FullLayer):
                out.append(ly.LayerState("full", k, v, layer.document_length, None))
            else:
                out.append(ly.LayerState("sliding", k, v, layer.document_length, int(layer.sliding_window)))
        return out

    def copy(self, room: int = GROW_STEP) -> "KVCache":
        """A private copy of the document with `room` spare tokens (for a concurrent question)."""
        return KVCache.from_states(self.states(), room=room)


def check_layout(plan: list[tuple[str, int | None]], states: list[ly.LayerState]) -> None:
    """ModelError unless the states have the model's layer count, kinds and windows."""
    if len(plan) != len(states):
        raise ModelError(f"the model has {len(plan)} cache layers, the cache {len(states)}")
    for i, ((kind, window), s) in enumerate(zip(plan, states)):
        if (kind, window) != (s.kind, s.sliding_window):
            raise ModelError(f"layer {i}: model has a {kind} layer (window {window}), cache holds {s.kind} (window {s.sliding_window})")
