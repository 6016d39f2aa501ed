"""A paged KV buffer seen through the layout its attention backend declares. Needs torch, not vLLM.

vLLM allocates one tensor per attention layer and its backend says how it is laid out:
`get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)` (and, for some backends,
`get_kv_cache_stride_order()`, the order of those axes in memory). `Layout.from_backend` calls it with
five distinct sentinel sizes and reads from the result which axis is which (key/value, block,
position in block, head, channel). A shape that is not a permutation of those five axes (a split
key layout, packed heads, a fused MLA latent) is not understood, and the connector refuses to load
rather than guess.

`Layout.view(t)` is then a [2, num_blocks, block_size, heads, head_dim] view of the buffer (no copy),
and slot s is block s // block_size, position s % block_size, as in vLLM's slot_mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

AXES = ("kv", "block", "offset", "head", "dim")
_SENTINELS = {"kv": 2, "block": 7, "offset": 11, "head": 13, "dim": 17}


class LayoutError(ValueError):
    """The backend's buffer layout is not one this connector understands."""


@dataclass(frozen=True)
class Layout:
    """Where each logical axis sits in the buffer's declared shape: perm[i] = declared axis of AXES[i]."""

    perm: tuple[int, ...]
    block_size: int
    num_kv_heads: int
    head_size: int

    @classmethod
    def from_shape_fn(cls, shape_fn: Callable[..., Any], *, block_size: int, num_kv_heads: int, head_size: int,
                      stride_order: tuple[int, ...] | None = None) -> "Layout":
        """Read the layout from the backend's own shape function (sentinel sizes), checked for being a
        permutation of the five axes. `stride_order`, if the backend has one, says the buffer was allocated
        in that order and permuted back to the declared shape (vLLM does this), which the view handles."""
        try:
            shape = tuple(int(s) for s in shape_fn(_SENTINELS["block"], _SENTINELS["offset"], _SENTINELS["head"],
                                                  _SENTINELS["dim"]))
        except Exception as exc:  # noqa: BLE001 (any backend error: not understood)
            raise LayoutError(f"the backend's get_kv_cache_shape failed on probe sizes ({exc})") from None
        if sorted(shape) != sorted(_SENTINELS.values()):
            raise LayoutError(f"the backend's KV cache shape {shape} for sizes (blocks 7, block 11, heads 13, dim 17) "
                              "is not [2 x blocks x block x heads x dim] in some order")
        perm = tuple(shape.index(_SENTINELS[a]) for a in AXES)
        return cls(perm=perm, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size)

    def view(self, t: Any) -> Any:
        """[2, num_blocks, block_size, heads, head_dim] view of a buffer with the declared shape (no copy)."""
        if t.dim() != 5:
            raise LayoutError(f"KV buffer has {t.dim()} dimensions, the layout says 5")
        v = t.permute(*self.perm)
        if (v.shape[0], v.shape[2], v.shape[3], v.shape[4]) != (2, self.block_size, self.num_kv_heads, self.head_size):
            raise LayoutError(f"KV buffer {tuple(t.shape)} does not fit block {self.block_size}, "
                              f"{self.num_kv_heads} heads, head size {self.head_size}")
        return v

    def write(self, t: Any, slots: Any, keys: Any, values: Any) -> None:
        """keys/values [tokens, heads, head_dim] into the buffer at `slots` (one slot per token), in place."""
        v = self.view(t)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        v[0, blocks, offsets] = keys.to(v.dtype)
        v[1, blocks, offsets] = values.to(v.dtype)

    def read(self, t: Any, slots: Any) -> tuple[Any, Any]:
        """(keys, values) [tokens, heads, head_dim] stored at `slots` (copies)."""
        v = self.view(t)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return v[0, blocks, offsets].clone(), v[1, blocks, offsets].clone()


def slot_mapping(block_ids: list[int], block_size: int, num_tokens: int) -> Any:
    """Slots of the first `num_tokens` tokens of a request whose KV blocks are `block_ids` (vLLM's rule:
    token i sits in block_ids[i // block_size] at position i % block_size)."""
    import torch

    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks of {block_size}")
    pos = torch.arange(num_tokens, dtype=torch.long)
    return torch.tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
