"""Linear layers of a decoding step: weight-first for a few float32 rows, split across two cores for one.

Weight-first: W [out, in] @ x^T, for a few float32 rows.
torch's `linear` of a few rows (x @ W^T) can run well below the same product with the weight as the left
operand through MKL on AVX2 CPUs (docs/performance.md, "Batched steps", has the measurement). Only the batch's
forward passes (engine/decoding/batch.py) run inside weight_first(): one question's forward keeps torch's own
kernel, which gives every row the bits a recompute gives it, while batched rows are held to float32's rounding
anyway (engine/scheduling/probe.py).

Split rows: torch's `linear` of one float32 row (MKL's sgemv) runs on one core whatever the thread count on
some CPUs (AMD EPYC, for one); on others (Intel Xeon, for one) MKL threads it itself, and split_rows_helps says no.
Each output element is one dot product, computed the same way in blocks of rows that start at a multiple
of a few rows (MKL's kernel takes 4 at a time; blocks of 1 or 11 rows give other bits), so within
split_rows() a one-row product runs as `mm` on blocks of ROWS-aligned rows of the weight, taken in turn by
the calling thread and one helper thread (torch releases the GIL inside the kernel). The first product of
each shape is also computed whole and compared: a kernel that gives other bits split leaves that shape
unsplit (tests/test_linear.py). The blocks are claimed, not assigned: a helper that the OS has not
scheduled leaves its share to the caller, so a busy machine costs no wait for it.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..scheduling import openmp

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


SPLIT_MIN = 1 << 18  # weight elements (1 MiB of float32): smaller products cost less than handing half of them over
BLOCK = 1 << 18  # weight elements per claimed block (at least two blocks)
ROWS = 64  # every block starts at a multiple of this many rows


class _Helper:
    """One daemon thread running the jobs handed to it, in order; only one-row `mm`s, so it never starts an
    OpenMP pool of its own (engine/scheduling/openmp.py)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kvcli-rows", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.jobs.get()()


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def _the_helper() -> _Helper:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = _Helper()
        return _helper


def split_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear(x, weight, bias) of one row x [..., in] -> [..., out], its output rows computed in blocks by this
    thread and the helper, each block by `mm` (`addmm` with a bias) as the unsplit call computes it.

    The helper computes a block into a tensor of its own and copies it in only if this thread has not
    given up on it: a helper still inside a block when this thread runs out of blocks is waited for about
    one block's time, then its block is computed here again, so a preempted helper never stalls a step."""
    row = x.reshape(1, x.shape[-1])
    n = weight.shape[0]
    step = -(-n // max(2, weight.numel() // BLOCK))
    step = -(-step // ROWS) * ROWS
    blocks = -(-n // step)
    out = torch.empty((1, n), dtype=x.dtype)
    claims = itertools.count()  # next() is atomic under the GIL: each block is claimed once
    lock = threading.Lock()
    done = threading.Event()
    held: list[int | None] = [None]  # the block the helper is computing; None once copied in or given up on

    def product(i: int, into: torch.Tensor | None) -> torch.Tensor:
        a, b = i * step, min(n, (i + 1) * step)
        w = weight[a:b].t()
        if bias is None:
            return torch.mm(row, w, out=into) if into is not None else torch.mm(row, w)
        return torch.addmm(bias[a:b], row, w, out=into) if into is not None else torch.addmm(bias[a:b], row, w)

    def helped() -> None:
        with torch.inference_mode():  # per thread: the caller's tensors are inference tensors
            while True:
                with lock:
                    i = next(claims)
                    held[0] = i if i < blocks else None
                if i >= blocks:
                    return
                try:
                    y = product(i, None)
                except BaseException:  # left held: the caller computes the block again and raises there
                    return
                with lock:
                    if held[0] != i:
                        return  # given up on: the caller has moved on
                    out[:, i * step: i * step + y.shape[1]].copy_(y)
                    held[0] = None
                    done.set()

    _the_helper().jobs.put(helped)
    t0, mine = time.perf_counter(), 0
    while (i := next(claims)) < blocks:
        product(i, out[:, i * step: (i + 1) * step])
        mine += 1
    with lock:
        late = held[0]
        done.clear()  # set again once the helper has copied in the block it holds now
    if late is not None:
        done.wait(2 * (time.perf_counter() - t0) / max(1, mine))
        with lock:
            late, held[0] = held[0], None
        if late is not None:
            product(late, out[:, late * step: (late + 1) * step])
    return out.view(*x.shape[:-1], n)


_same_bits: dict[tuple, bool] = {}  # (weight shape, bias or not) -> split_product gave linear's bits


class SplitRows(TorchFunctionMode):
    """Within this mode (and inference mode, which the helper enters too), `linear` of one float32 row on the
    CPU with a weight of SPLIT_MIN elements or more runs as split_product; everything else as usual."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR and len(args) >= 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2
                    and x.numel() == x.shape[-1] and weight.numel() >= SPLIT_MIN and weight.is_contiguous()
                    and torch.is_inference_mode_enabled()
                    and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1))):
                shape = (tuple(weight.shape), bias is not None)
                if _same_bits.get(shape, True):
                    y = split_product(x, weight, bias)
                    if shape not in _same_bits:
                        _same_bits[shape] = torch.equal(y, func(*args, **kwargs))
                    if _same_bits[shape]:
                        return y
        return func(*args, **kwargs)


def split_rows(enabled: bool = True) -> SplitRows | nullcontext:
    """The mode, for a `with` block around one one-row forward pass (a no-op when not enabled)."""
    return SplitRows() if enabled else nullcontext()


_one_core: bool | None = None  # a one-row product runs on one core here (found once per process)


def _threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: unknown
        return None


def _one_row_product() -> None:
    with torch.inference_mode():
        torch.mm(torch.ones(1, 4096), torch.ones(4096, ROWS))  # [1, 4096] x [4096, 64], as a claimed block


def _in_helper(job, timeout: float) -> None:
    """Run `job` in the helper thread and wait for it, at most `timeout` seconds."""
    done = threading.Event()
    _the_helper().jobs.put(lambda: (job(), done.set()))
    done.wait(timeout)


def _one_row_stays_on_one_core() -> bool:
    """Whether a one-row product in the helper thread runs there alone. Where torch's kernel threads it (MKL does
    on some CPUs), the helper's own OpenMP pool beside the engine's is one pool too many: every worker then sleeps
    between parallel regions, which slows a step severalfold (tests/bench/bench_handoff.py). The helper's first product is
    watched: new threads in the process mean a pool, which is given back, and no product is split."""
    global _one_core
    with _helper_lock:
        known = _one_core
    if known is not None:
        return known
    _the_helper()
    before, result = _threads(), []

    def probe() -> None:
        _one_row_product()
        after = _threads()
        result.append(before is not None and after is not None and after <= before)
        if not result[0]:
            openmp.release()

    _in_helper(probe, 60)
    with _helper_lock:
        _one_core = bool(result and result[0])
        return _one_core


def split_rows_helps(model: Any) -> bool:
    """Whether one-row steps of `model` gain from split_rows: float32 linear layers on the CPU, two torch
    threads or more to run on, and one-row products that torch's kernel leaves on one core."""
    return torch.get_num_threads() >= 2 and weight_first_helps(model) and _one_row_stays_on_one_core()


_pool_on = False  # the helper holds an OpenMP pool of its own


def pool_beside_helps(model: Any) -> bool:
    """Whether one-row steps of `model` may choose to keep a pool beside the engine's: on the CPU, two torch
    threads or more, and a kernel that threads one-row products (so split_rows does not apply)."""
    return (torch.get_num_threads() >= 2 and getattr(model, "device", torch.device("cpu")).type == "cpu"
            and not _one_row_stays_on_one_core())


def pool_beside(on: bool) -> None:
    """An OpenMP pool in the helper thread (on) or none (off). libgomp's idle workers spin between parallel
    regions only while its pools hold no more threads than there are CPUs: with the helper's pool beside the
    engine's they sleep instead. Spinning is faster on idle cores, sleeping far steadier beside busy processes
    (docs/performance.md), so a step picks by its own times (engine/decoding/solo.py). The bits are the same."""
    global _pool_on
    if on == _pool_on:
        return
    # a helper not scheduled yet does it soon: nothing depends on it but speed
    _in_helper(_one_row_product if on else openmp.release, 1.0)
    _pool_on = on
