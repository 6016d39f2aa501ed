"""Linear layers of a decoding step: weight-first for a few float32 rows, split across the cores for one.

Weight-first: W [out, in] @ x^T, for a few float32 rows.
torch's `linear` of a few rows (x @ W^T) can run well below the same product with the weight as the left
operand through MKL on AVX2 CPUs (docs/performance.md, "Batched steps", has the measurement). Only the batch's
forward passes (engine/decoding/batch.py) run inside weight_first(): one question's forward keeps torch's own
kernel, which gives every row the bits a recompute gives it, while batched rows are held to float32's rounding
anyway (engine/scheduling/probe.py).

Split rows: torch's `linear` of one float32 row (MKL's sgemv) runs on one core whatever the thread count on
some CPUs (AMD EPYC, for one); on others (Intel Xeon, for one) MKL threads it itself. Each output element is
one dot product, computed the same way in parts of the weight's rows that start at a multiple of a few rows
(MKL's kernel takes 4 at a time; parts of 1 or 11 rows give other bits), so within split_rows() a SplitLinear
layer's one-row product runs as one `bmm` over equal ROWS-aligned parts of the weight, which torch spreads
over its threads in native code (no Python between the parts). The first product of each shape is
also computed whole and compared: a kernel that gives other bits split leaves that shape unsplit
(tests/engine/test_linear.py). The parts are assigned, so a core taken by another process slows the product down;
engine/decoding/solo.py then measures the unsplit step faster and takes it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
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
    y = torch.mm(weight, rows.T).T.contiguous()  # [n, out], laid out as linear's output: later ops may assume it
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def weight_first(enabled: bool = True) -> WeightFirst | nullcontext:
    """The mode, for a `with` block around one batched forward pass (a no-op when not enabled)."""
    return WeightFirst() if enabled else nullcontext()


def weight_first_helps(model: Any) -> bool:
    """Whether `model` has float32 linear layers on the CPU, the only ones the mode changes (a q4 model has none:
    its layers multiply 4-bit codes, engine/model/stored.py), so that other models skip the mode's per-call cost."""
    return any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
               for m in model.modules())


SPLIT_MIN = 1 << 16  # weight elements (256 KiB of float32): smaller products cost less than a parallel region
ROWS = 32  # every part starts at a multiple of this many rows


@functools.lru_cache(maxsize=None)
def parts(out_features: int, threads: int, rows: int = ROWS) -> int:
    """Into how many equal parts of whole `rows`-row blocks a weight's rows are cut for `threads` threads: the
    evenest share of parts per thread, then the fewest parts (576 rows, 2 threads: 2 parts of 288); 1 when
    no cut of two or more parts exists."""
    if threads < 2 or out_features % rows:
        return 1
    blocks = out_features // rows
    cuts = [p for p in range(2, blocks + 1) if blocks % p == 0]
    return min(cuts, key=lambda p: (-(-p // threads) * threads / p, p), default=1)


def split_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cut: int) -> torch.Tensor:
    """linear(x, weight, bias) of one row x [..., in] -> [..., out] as one `bmm` (`baddbmm` with a bias) over
    `cut` equal parts of the weight's rows: torch runs the parts on its own threads in one parallel region,
    each part by the kernel the whole product uses."""
    n, k = weight.shape
    row = x.reshape(1, 1, k).expand(cut, 1, k)  # [cut, 1, in]
    w = weight.view(cut, n // cut, k).transpose(1, 2)  # [cut, in, n/cut]: views of the weight, no copy
    y = torch.bmm(row, w) if bias is None else torch.baddbmm(bias.view(cut, 1, n // cut), row, w)  # [cut, 1, n/cut]
    return y.view(*x.shape[:-1], n)


# Inside split_rows: the caller's record of shapes checked, (weight shape, bias or not) -> split gave linear's bits
_SPLIT: ContextVar[dict[tuple, bool] | None] = ContextVar("kvcli_split_rows", default=None)


class SplitLinear(torch.nn.Linear):
    """A torch Linear holding another's parameters (the same tensors: tied weights stay tied), whose product of one
    float32 row on the CPU runs as split_product inside split_rows(), when the weight has SPLIT_MIN elements or
    more and its rows cut into parts; everything else exactly as torch.nn.Linear. A module of its own rather than
    a TorchFunctionMode: a mode sees every torch call of the forward pass, about 2,300 a step of the default
    model, and costs more than the split gains (docs/performance.md, "One question's decode")."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.train(linear.training)  # an eval() model stays in eval mode throughout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        weight, bias, same_bits = self.weight, self.bias, _SPLIT.get()
        if (same_bits is not None and x.numel() == x.shape[-1] and x.dtype == weight.dtype == torch.float32
                and x.device.type == "cpu" and weight.numel() >= SPLIT_MIN and weight.is_contiguous()
                and torch.is_inference_mode_enabled() and (bias is None or bias.dtype == torch.float32)):
            shape = (tuple(weight.shape), bias is not None)
            cut = parts(weight.shape[0], torch.get_num_threads(), ROWS)
            if cut > 1 and same_bits.get(shape, True):
                y = split_product(x, weight, bias, cut)
                if shape not in same_bits:
                    same_bits[shape] = torch.equal(y, _LINEAR(x, weight, bias))
                if same_bits[shape]:
                    return y
        return _LINEAR(x, weight, bias)


def use_split_linears(model: Any) -> None:
    """Make every float32 torch Linear of `model` on the CPU a SplitLinear over the same parameters, in place: no
    product changes until a one-row pass runs inside split_rows()."""
    for name, module in list(model.named_modules()):
        if (type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu"):
            model.set_submodule(name, SplitLinear(module))


@contextmanager
def split_rows(same_bits: dict[tuple, bool] | None) -> Iterator[None]:
    """Within this block (this thread only), the one-row products of SplitLinear layers split, each shape's first
    split checked against the whole product and recorded in `same_bits` (its owner's: engine/model/cpu.py);
    None: nothing splits."""
    token = _SPLIT.set(same_bits)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def split_rows_helps(model: Any) -> bool:
    """Whether one-row steps of `model` can run split_rows: SplitLinear layers (use_split_linears) and two torch
    threads or more to spread their parts over."""
    return torch.get_num_threads() >= 2 and any(isinstance(m, SplitLinear) for m in model.modules())


def pool_beside_helps(model: Any) -> bool:
    """Whether one-row steps of `model` may choose to keep a pool beside the engine's: on the CPU, with two torch
    threads or more (whose workers can spin or sleep)."""
    return torch.get_num_threads() >= 2 and getattr(model, "device", torch.device("cpu")).type == "cpu"
