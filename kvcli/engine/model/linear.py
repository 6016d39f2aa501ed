"""Linear layers of a batched decoding step multiplied weight-first: W [out, in] @ x^T, for a few float32 rows.

torch's `linear` of a few rows (x @ W^T) ran 1.5-2.5x slower than the same product with the weight as the
left operand on this project's AVX2 CPU through MKL (8 rows of SmolLM2's 30 layers: 110-116 against 62-75 ms,
its output layer 47 against 19 ms; docs/performance.md, "Batched steps"). Only the batch's forward passes
(engine/decoding/batch.py) run inside weight_first(): one question's forward keeps torch's own kernel, which
gives every row the bits a recompute gives it, while batched rows are held to float32's rounding anyway
(engine/scheduling/probe.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LINEAR = torch.nn.functional.linear


class WeightFirst(TorchFunctionMode):
    """Within this mode, `linear` of 2+ float32 rows on the CPU runs as mm(W, x^T); everything else as usual."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR and len(args) >= 2:  # linear(input, weight[, bias]) as nn.Linear calls it; keywords pass
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2
                    and x.dim() >= 2 and x.numel() > x.shape[-1]):
                return weight_first_product(x, weight, bias)
        return func(*args, **kwargs)


def weight_first_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] W^T (+ bias) -> [..., out], computed as mm(W, x^T) (the weight's rows outermost), contiguous."""
    rows = x.reshape(-1, x.shape[-1])  # [n, in]
    y = torch.mm(weight, rows.T).T.contiguous()  # [n, out], laid out as linear's (OPT's rows came out NaN otherwise)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def weight_first(enabled: bool = True) -> WeightFirst | nullcontext:
    """The mode, for a `with` block around one batched forward pass (a no-op when not enabled)."""
    return WeightFirst() if enabled else nullcontext()


def weight_first_helps(model: Any) -> bool:
    """Whether `model` has float32 linear layers on the CPU, the only ones the mode changes (a q4 model has none:
    its layers multiply 4-bit codes, engine/model/stored.py), so that other models skip the mode's per-call cost."""
    return any(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
               for m in model.modules())
