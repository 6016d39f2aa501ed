"""The cache of a batch: one document's keys/values shared read-only by every row, plus a suffix per row.

Each question appends its own tokens to a row of small suffix buffers; the document is never copied
per question. kvcli's cascade attention (engine/model/attention.py) reads both parts through the Step the
BatchDecoder (engine/decoding/batch.py) sets before each forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

GROW_TOKENS = 64  # suffix rows grow in steps of this many tokens (copying only the suffix)


class SharedPrefixLayer(CacheLayerMixin):
    """One layer: the document's keys/values [1, kv_heads, cached, head_dim] shared by every row, and
    per-row suffix buffers [rows, kv_heads, capacity, head_dim] holding each question's own tokens."""

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seq_length: int, sliding_window: int | None,
                 rows: int, capacity: int):
        super().__init__()
        self.prefix_keys, self.prefix_values = keys, values  # never written
        self.prefix_length = seq_length  # tokens the document counted (> cached for a full sliding window)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        b, h, _, d = keys.shape
        # zeros, not empty: masked slots get weight 0, and 0 * NaN from stale memory would still be NaN
        self.keys = keys.new_zeros((rows, h, capacity, d))
        self.values = values.new_zeros((rows, h, capacity, values.shape[-1]))
        self.device = keys.device
        self.is_initialized = True
        self.step: Step | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist from the start
        pass

    def grow(self, capacity: int) -> None:
        """Room for `capacity` tokens per row (copies the suffix, never the document)."""
        if capacity <= self.keys.shape[2]:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
            new[:, :, : old.shape[2]].copy_(old)
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        """Write this step's keys/values [active, kv_heads, q, head_dim] at each active row's slots."""
        step = self.step
        q = key_states.shape[2]
        if step.uniform_offset is not None:  # every active row starts at the same slot (questions joining)
            at = step.uniform_offset
            self.keys[step.rows, :, at : at + q] = key_states
            self.values[step.rows, :, at : at + q] = value_states
        else:  # one token per row at its own slot
            self.keys[step.rows, :, step.offsets] = key_states[:, :, 0]
            self.values[step.rows, :, step.offsets] = value_states[:, :, 0]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.prefix_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prefix_length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class SharedPrefixCache(Cache):
    """A cache of SharedPrefixLayer, built explicitly from a restored document's layer states."""

    def __init__(self, states: Sequence[Any], rows: int, capacity: int):
        super().__init__(layers=[
            SharedPrefixLayer(s.keys, s.values, s.seq_length, s.sliding_window, rows, capacity) for s in states
        ])

    def begin(self, step: "Step") -> None:
        for layer in self.layers:
            layer.step = step

    def grow(self, capacity: int) -> None:
        for layer in self.layers:
            layer.grow(capacity)

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]


@dataclass
class Step:
    """What one forward pass covers: which buffer rows, and where their tokens go."""

    rows: torch.Tensor  # [active] buffer rows
    offsets: torch.Tensor  # [active] slot of each row's first new token
    uniform_offset: int | None  # the same first slot for every row (questions joining), else None
    query_length: int
    memo: dict = field(default_factory=dict)  # masks every layer of one kind shares, built once per step

    def once(self, key: Any, build: Callable[[], Any]) -> Any:
        """build(), computed for the first layer that asks for `key` in this step and reused by the rest."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]
