"""A GGUF model's 4-bit weights run as stored (`weights="q4"`): faster decoding on the CPU, at a known cost.

Every linear layer whose GGUF tensor is Q4_1 runs through torch's packed int4 matmul for the CPU
(`_weight_int4pack_mm_for_cpu`, the kernel torchao and gpt-fast use) on the file's own 4-bit codes, with
bfloat16 activations and scales (the kernel's fast path takes only bfloat16); the output layer runs on
bfloat16 values (Bf16Linear). The linear layers then read about a sixth of their float32 bytes (4 bits a
weight, plus a bfloat16 scale and zero per 32).

This path is approximate, and says so. Its answers are those of its own arithmetic, not of the float32 path;
and they are not token-exact against a recompute on the same path either: torch's CPU attention gives the
last rows of a pass slightly different bits depending on where a prompt is cut (cache, then question; the
float32 path is unaffected at float32 precision), and rounding activations to bfloat16 turns those last bits
into visible logit differences (docs/exactness.md has the measured agreement). A cache records the choice
(fingerprint "weights"), is refused by a model loaded the other way, and --check reports the agreement with
the recompute in numbers, as for a lossy cache. The blocks are checked once against the float weights
transformers dequantized from the same file: codes that do not give those weights back (layout, row order)
stop the load. Any other model (a folder, the hub) gets q4 blocks of the same form quantized at load from its
float weights, as Q4_1 does it (quantize_q4).

`weights="q8"`, for any model: weight-only int8 quantized at load (quantize_q8: one symmetric scale per output
channel), run through torch's own `_weight_int8pack_mm` (Q8Linear). torch's dynamic quantization (also 8-bit
activations) is deprecated, and torchao's int8 weight-only path on the CPU multiplies dequantized weights
without torch.compile, so neither adds a kernel to this one; bfloat16 activations, as the kernel's float32 path
is about 8x slower on an AVX2 CPU. Same caveats as q4: approximate, recorded, refused the other way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import ModelError
from .linear import weight_first_product

MODES = ("float", "q8", "q4", "gguf")
GROUP = 32  # weights per Q4_1 block: one scale and one minimum each
_Q4_1 = 3  # ggml type id (gguf.GGMLQuantizationType.Q4_1)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu
_INT8_MM = torch.ops.aten._weight_int8pack_mm


class Q4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W held as packed 4-bit codes and per-block bfloat16 scale/zero.

    w = (q - 8) * scale + zero per block of 32 inputs, which is Q4_1's w = d * q + m with scale = d and
    zero = m + 8d. Rows of x are independent (a row's output does not depend on the other rows), so a
    prompt in chunks and in one pass give the same values."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)  # [out, in/2] uint8, the kernel's layout
        self.register_buffer("scales_zeros", scales_zeros)  # [in/32, out, 2] bfloat16
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out], in x's dtype
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [n, in] (the kernel reads it as dense; a bfloat16 x is not copied)
        y = _INT4_MM(rows, self.packed, GROUP, self.scales_zeros).to(x.dtype)  # [n, out]
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4 (group {GROUP})"


class Bf16Linear(torch.nn.Module):
    """A linear layer run in bfloat16 (the output layer of the q4 path), returning x's dtype.

    From WIDE rows on (batched questions, a recompute), the same bfloat16 inputs and weights are multiplied in
    float32 instead, through a float32 copy of the weights made on first use: bfloat16 products of several
    rows run row by row on AVX2 CPUs, slower than this for several rows and faster for one
    (tests/bench/bench_weights.py). The products of bfloat16 values are exact in float32, and the result is rounded to
    bfloat16 as the bfloat16 kernel's is, so only the order of the sums differs (a rare last-bit change)."""

    WIDE = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False) if bias is not None else None
        self._wide: tuple[torch.Tensor, torch.Tensor | None] | None = None  # float32 weight [out, in] and bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out], in x's dtype
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [n, in]
        if rows.shape[0] < self.WIDE:  # (q4 runs on the CPU only: check_mode)
            y = torch.nn.functional.linear(rows, self.weight, self.bias)
        else:
            if self._wide is None:
                self._wide = (self.weight.float(), None if self.bias is None else self.bias.float())
            y = weight_first_product(rows.float(), *self._wide).to(torch.bfloat16)  # [n, out]
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


class Q8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W held as int8 codes and one bfloat16 scale per output row: w = q * scale.

    Up to WIDE rows (decoding) run torch's int8 kernel on bfloat16 inputs; more rows (a prefill chunk, a recompute),
    where that kernel is slower than float32 GEMM, multiply the same bfloat16 inputs by the dequantized
    weights in float32 (q * scale is exact there) and round to bfloat16 as the kernel does: only the order of the
    sums differs."""

    WIDE = 16

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out] bfloat16
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out], in x's dtype
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [n, in] (dense, as the kernel reads it)
        if rows.shape[0] <= self.WIDE:
            y = _INT8_MM(rows, self.codes, self.scales)  # [n, out] bfloat16
        else:
            weight = self.codes.float() * self.scales.float()[:, None]  # [out, in], made per call: no float copy kept
            y = torch.mm(rows.float(), weight.T).to(torch.bfloat16)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8 (per output channel)"


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [out, in] -> int8 codes [out, in] in -127..127 and bfloat16 scales [out] (symmetric, per row;
    the codes are rounded against the bfloat16 scale the kernel multiplies by)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [rows, cols] -> Q4_1-style codes [rows, cols] (0..15), d and m [rows, cols/32] float16, as
    q4_blocks returns them: each block of 32 spans its own min..max in 15 steps."""
    rows, cols = weight.shape
    w = weight.detach().float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    step = torch.where(d == 0, torch.ones_like(d), d).float()
    codes = torch.round((w - m.float()[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(rows, cols), d, m


def q4_blocks(raw: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [rows, cols/32*20] -> codes [rows, cols] (0..15), d and m [rows, cols/32] float16.

    Block: d (float16), m (float16), then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31."""
    blocks = raw.reshape(rows, cols // GROUP, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, cols)
    return codes, d, m


def dequantize(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 weights d * q + m per group of 32, as gguf's (and so transformers') dequantizer computes them for
    Q4_1 (and gguf_weights.q4_codes's scale and add for Q4_0 and Q4_K): [rows, cols]."""
    rows, cols = codes.shape
    w = codes.reshape(rows, cols // GROUP, GROUP).float() * d.float()[..., None] + m.float()[..., None]
    return w.reshape(rows, cols)


def _row_orders(rows: int, config: Any) -> list[torch.Tensor | None]:
    """Row orders to try: as stored, then the query/key un-permutation transformers applies to llama GGUFs."""
    orders: list[torch.Tensor | None] = [None]
    for heads in {getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)}:
        if heads and rows % (2 * heads) == 0:
            orders.append(torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows))
    return orders


def _tensor_names(model: Any, gguf_reader: Any) -> dict[str, Any]:
    """transformers module name -> the GGUF tensor holding its weight (gguf's own name map for the architecture)."""
    import gguf

    arch_name = str(gguf_reader.fields["general.architecture"].contents())
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ModelError(f"--weights q4: GGUF architecture '{arch_name}' is unknown to the gguf package")
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0)
    names = gguf.get_tensor_name_map(arch, layers)
    by_name = {t.name: t for t in gguf_reader.tensors}
    found = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            target = names.get_name(module_name)
            if target is not None and f"{target}.weight" in by_name:
                found[module_name] = by_name[f"{target}.weight"]
    return found


def stored_blocks(model: Any, gguf_path: Path) -> dict[str, torch.Tensor]:
    """Module name -> its Q4_1 blocks [out, in/32*20] uint8 in the model's row order, each checked to give back
    the weights transformers dequantized from the same file (reading the GGUF's fields costs seconds: done once)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    stored = _tensor_names(model, reader)
    config, output = model.config.get_text_config(), model.get_output_embeddings()
    found = {}
    for name, module in model.named_modules():
        tensor = stored.get(name)
        if (module is output or tensor is None or int(tensor.tensor_type) != _Q4_1 or module.in_features % GROUP):
            continue
        rows, cols = module.out_features, module.in_features
        raw = torch.from_numpy(tensor.data.copy()).reshape(rows, -1)  # [rows, cols/32*20]
        weight = module.weight.detach()  # transformers' dequantized weights, in the model's dtype
        blocks = q4_blocks(raw, rows, cols)
        order = next((o for o in _row_orders(rows, config)
                      if torch.equal(dequantize(*(t if o is None else t[o] for t in blocks)).to(weight.dtype), weight)), False)
        if order is False:
            raise ModelError(f"{gguf_path}: tensor {tensor.name} does not give back the weights of {name} "
                             "(kvcli cannot run this file's 4-bit weights as stored); use --weights float")
        found[name] = (raw if order is None else raw[order]).contiguous()
    if not found:
        raise ModelError(f"{gguf_path}: no linear layer is stored as Q4_1; --weights q4 needs a Q4_1 GGUF file",
                         hint="--weights gguf runs any GGUF file's own low-bit weights")
    return found


def prepared_blocks(model: Any, gguf_path: Path, folder: Path) -> dict[str, torch.Tensor]:
    """stored_blocks, kept in `folder` (KVCLI_HOME, keyed by the file's sha256; written atomically) for later loads.
    The blocks are stored, not the kernel's packing, which may differ between CPUs."""
    import os

    from safetensors.torch import load_file, save_file

    from ...format.writing import hidden_sibling

    path = folder / "q4_1.safetensors"
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    try:
        blocks = load_file(path)
        if all(n in linears and b.dtype == torch.uint8 and tuple(b.shape) == (linears[n].out_features,
               linears[n].in_features // GROUP * 20) for n, b in blocks.items()) and blocks:
            return blocks
    except Exception:  # absent, or not what this model needs: made again below
        pass
    blocks = stored_blocks(model, gguf_path)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(path)
    try:
        save_file(blocks, str(tmp))
        os.replace(tmp, path)
    except OSError:
        pass  # not kept: the next load reads the GGUF again
    finally:
        tmp.unlink(missing_ok=True)
    return blocks


def linear_dtype(model: Any) -> torch.dtype:
    """The dtype the model's linear layers compute in: bfloat16 once use_q4 or use_q8 has replaced them, else the
    model's."""
    return torch.bfloat16 if any(isinstance(m, (Q4Linear, Q8Linear)) for m in model.modules()) else model.dtype


def check_mode(mode: str, source: dict[str, Any], device: str) -> None:
    """Refuse (ModelError) a weights mode this model or device cannot run, before any weight is read."""
    if mode not in MODES:
        raise ModelError(f"--weights {mode}: choose {', '.join(MODES[:-1])} or {MODES[-1]}")
    if mode == "float":
        return
    if mode == "gguf" and source.get("kind") not in ("default", "gguf"):
        raise ModelError(f"--weights gguf runs a .gguf file's own low-bit weights, and {source.get('name', 'this model')} "
                         "is not one: use --weights q8 or q4, which quantize any model at load")
    if torch.device(device).type != "cpu":
        kernel = {"q4": "int4", "q8": "int8"}.get(mode, "int4 and int8")
        raise ModelError(f"--weights {mode} runs on the CPU only (torch's packed {kernel} kernel for the CPU), not {device}")


def _pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> Q4Linear:
    """Q4Linear from codes [rows, cols] and Q4_1's d and m [rows, cols/32]."""
    rows, cols = codes.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)  # [rows, cols/2]
    scales_zeros = torch.stack([d.float().t(), (m.float() + 8 * d.float()).t()], dim=-1)  # [cols/32, rows, 2]
    return Q4Linear(packed, scales_zeros.to(torch.bfloat16).contiguous(), cols, rows, bias)


def use_q4(model: Any, gguf_path: Path | None, folder: Path | None) -> None:
    """Replace `model`'s linear layers by Q4Linear and its output layer by Bf16Linear, in place (a CPU model:
    check_mode). A GGUF's Q4_1 layers run its own codes (others stay as they are); without a GGUF every linear
    layer whose inputs come in whole blocks is quantized from its float weights."""
    blocks = prepared_blocks(model, gguf_path, folder) if gguf_path is not None else None
    output = model.get_output_embeddings()
    with torch.inference_mode():
        for name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            if module is output:
                model.set_submodule(name, Bf16Linear(module.weight, module.bias))
                continue
            bias = module.bias.detach().clone() if module.bias is not None else None
            if blocks is None and module.in_features % GROUP == 0:
                model.set_submodule(name, _pack_q4(*quantize_q4(module.weight), bias))
            elif blocks is not None and name in blocks:
                model.set_submodule(name, _pack_q4(*q4_blocks(blocks[name], module.out_features, module.in_features), bias))


def use_q8(model: Any) -> None:
    """Replace every linear layer of `model`, the output layer too, by Q8Linear quantized from its float weights,
    in place (a CPU model: check_mode)."""
    with torch.inference_mode():
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear):
                bias = module.bias.detach().clone() if module.bias is not None else None
                model.set_submodule(name, Q8Linear(*quantize_q8(module.weight), bias))


def use(model: Any, mode: str, gguf_path: Path | None, gguf_folder: Path | None) -> None:
    """Run `model`'s linear layers in `mode` ("q8" or "q4"), in place; q4 on a GGUF file (`gguf_path`, converted
    into `gguf_folder`) runs its own codes, kept beside that folder. ("gguf": gguf_weights.use_gguf.)"""
    if mode == "q8":
        use_q8(model)
    else:
        use_q4(model, gguf_path, gguf_folder.with_name(gguf_folder.name + "-q4") if gguf_folder is not None else None)
