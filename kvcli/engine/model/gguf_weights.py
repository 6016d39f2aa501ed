"""A GGUF file's own low-bit weights on the nearest torch kernel (`weights="gguf"`), with the error stated.

Each linear layer runs the type its tensor has in the file:
- Q4_0, Q4_1, Q4_K: the file's own 4-bit codes through torch's int4 kernel (stored.Q4Linear, groups of 32).
  Every such block is w = scale * q + add with q in 0..15 (Q4_K: scale = d * sc and add = -dmin * m per
  32-weight sub-block), which the kernel holds as (q - 8) * scale + zero; scale and zero are rounded to
  bfloat16, the kernel's only difference from the file.
- Any other type (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, 16- and 32-bit floats): more than 4 bits a weight, which the
  int4 kernel cannot hold, so torch's int8 kernel (stored.Q8Linear) on the file's weights quantized per output
  row, the output layer included.
- Types of fewer bits (Q2_K, Q3_K, IQ*): int4 in groups of 32 quantized from the file's weights.

The difference of every layer's kernel weights from the file's (as gguf dequantizes them) is measured at load
and kept in the fingerprint ("weights_error": max and mean absolute difference, and the mean absolute
weight, per file type), so `info` and `--check` can say how close the arithmetic is to the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import ModelError
from . import stored

_Q4 = {"Q4_0", "Q4_1", "Q4_K"}  # types whose codes the int4 kernel runs as stored
_FEWER_BITS = {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0"}


def q4_codes(raw: torch.Tensor, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0, Q4_1 or Q4_K tensor's bytes [rows, bytes a row] -> codes [rows, cols] uint8 (0..15), scale and add
    [rows, cols/32] float32, with w = scale * q + add as gguf's dequantizer computes it."""
    if kind == "Q4_K":  # 256 weights: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of codes
        b = raw.reshape(rows, cols // 256, 144)
        d = b[..., 0:2].contiguous().view(torch.float16).float()  # [rows, n, 1]
        dmin = b[..., 2:4].contiguous().view(torch.float16).float()
        s = b[..., 4:16].long().reshape(rows, -1, 3, 4)
        lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()  # [rows, n, 8]
        mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1).float()
        qs = b[..., 16:].reshape(rows, -1, 4, 32)  # sub-blocks 2j (low nibbles) and 2j+1 (high nibbles)
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(rows, cols)
        return codes, (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1)
    width = 18 if kind == "Q4_0" else 20
    b = raw.reshape(rows, cols // 32, width)
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    qs = b[..., width - 16:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, cols)
    add = -8 * d if kind == "Q4_0" else b[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    return codes, d, add


def _scales_zeros(codes: torch.Tensor, scale: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernel's scales and zeros for w = scale * q + add ([cols/32, rows, 2] bfloat16, as stored._pack_q4
    makes them from Q4_1's d and m), and the weights the kernel then runs [rows, cols] float32."""
    rows, cols = codes.shape
    sz = torch.stack([scale.t(), (add + 8 * scale).t()], dim=-1).to(torch.bfloat16).contiguous()
    runs = (codes.reshape(rows, cols // 32, 32).float() - 8) * sz[..., 0].t().float()[..., None] + sz[..., 1].t().float()[..., None]
    return sz, runs.reshape(rows, cols)


def _file_weights(tensor: Any, rows: int, cols: int) -> torch.Tensor:
    """A GGUF tensor as gguf dequantizes it: [rows, cols] float32 (the file's row order)."""
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(values.astype("float32", copy=False)).reshape(rows, cols)


def _in_model_order(file_w: torch.Tensor, weight: torch.Tensor, config: Any, name: str, path: Path) -> torch.Tensor | None:
    """The row order that gives the model's weight from the file's (transformers permutes llama's q/k rows)."""
    for order in stored._row_orders(file_w.shape[0], config):
        rows = file_w if order is None else file_w[order]
        if torch.equal(rows.to(weight.dtype), weight):
            return order
    raise ModelError(f"{path}: the file's weights for {name} are not the model's (kvcli cannot run this file's own "
                     "low-bit weights); use --weights float")


class _Errors:
    """Per file type: layers, weights, max and summed absolute difference, summed absolute weight."""

    def __init__(self) -> None:
        self.by_type: dict[str, list[float]] = {}

    def add(self, kind: str, kernel: str, runs: torch.Tensor, file_w: torch.Tensor) -> None:
        diff = (runs - file_w).abs()
        row = self.by_type.setdefault(f"{kind}->{kernel}", [0, 0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += diff.numel()
        row[2] = max(row[2], float(diff.max()))
        row[3] += float(diff.double().sum())
        row[4] += float(file_w.abs().double().sum())

    def report(self) -> dict[str, dict[str, float]]:
        return {k: {"layers": int(n), "max_abs": float(f"{mx:.3g}"), "mean_abs": float(f"{s / w:.3g}"),
                    "mean_weight": float(f"{a / w:.3g}")} for k, (n, w, mx, s, a) in sorted(self.by_type.items())}


def _kernel_tensors(model: Any, gguf_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """For every linear layer of `model` (loaded from `gguf_path`), the tensors of the kernel nearest its type in the
    file ("name.int4": codes two a byte [rows, cols/2] uint8, "name.int4sz": scales and zeros [cols/32, rows, 2]
    bfloat16; or "name.int8": codes [rows, cols] int8, "name.int8s": scales [rows] bfloat16), and the weights'
    difference from the file's, per file type -> kernel."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = stored._tensor_names(model, reader)
    output = model.get_output_embeddings()
    names = {m: n for n, m in model.named_modules()}
    if output is not None and names.get(output) not in tensors:  # the output layer: its own tensor, else the tied embedding
        by_name = {t.name: t for t in reader.tensors}
        own = by_name.get("output.weight") or by_name.get("token_embd.weight")
        if own is not None:
            tensors[names[output]] = own
    config, errors, out = model.config.get_text_config(), _Errors(), {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelError(f"{gguf_path}: no tensor in the file for the model's layer {name}; use --weights float")
        rows, cols = module.out_features, module.in_features
        kind = gguf.GGMLQuantizationType(int(tensor.tensor_type)).name
        file_w = _file_weights(tensor, rows, cols)
        order = _in_model_order(file_w, module.weight.detach(), config, name, gguf_path)
        if order is not None:
            file_w = file_w[order]
        if (kind in _Q4 or kind in _FEWER_BITS) and cols % 32 == 0:
            if kind in _Q4:
                raw = torch.from_numpy(tensor.data.copy()).reshape(rows, -1)
                codes, scale, add = q4_codes(raw if order is None else raw[order], kind, rows, cols)
                if not torch.equal(stored.dequantize(codes, scale, add), file_w):
                    raise ModelError(f"{gguf_path}: tensor {tensor.name} ({kind}) does not read back as gguf reads it; "
                                     "use --weights float")
            else:
                codes, d, m = stored.quantize_q4(file_w)
                scale, add = d.float(), m.float()
            sz, runs = _scales_zeros(codes, scale, add)
            out[f"{name}.int4"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
            out[f"{name}.int4sz"] = sz
            errors.add(kind, "int4", runs, file_w)
        else:
            codes8, scales = stored.quantize_q8(file_w)
            out[f"{name}.int8"], out[f"{name}.int8s"] = codes8, scales
            errors.add(kind, "int8", codes8.float() * scales.float()[:, None], file_w)
    return out, errors.report()


def _fits(kept: dict[str, torch.Tensor], name: str, layer: Any) -> bool:
    """Whether `kept` holds one kernel's tensors for `layer` in the shapes and dtypes the kernels read (the file is
    read back, not trusted: a wrong shape would reach native code)."""
    rows, cols = layer.out_features, layer.in_features
    want = ({f"{name}.int4": ((rows, cols // 2), torch.uint8), f"{name}.int4sz": ((cols // 32, rows, 2), torch.bfloat16)}
            if f"{name}.int4" in kept else
            {f"{name}.int8": ((rows, cols), torch.int8), f"{name}.int8s": ((rows,), torch.bfloat16)})
    return all(k in kept and tuple(kept[k].shape) == shape and kept[k].dtype == dtype for k, (shape, dtype) in want.items())


def _prepared(model: Any, gguf_path: Path, folder: Path | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """_kernel_tensors, kept in `folder` (KVCLI_HOME, keyed by the file's sha256; written atomically): reading the
    GGUF's fields and dequantizing its tensors cost seconds, reading this file a fraction of one."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    from ...format.writing import hidden_sibling

    path = folder / "gguf-kernels.safetensors" if folder is not None else None
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if path is not None and path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                kept = {k: f.get_tensor(k).clone() for k in f.keys()}  # torch's own (aligned) memory: the kernels need it
                report = json.loads(f.metadata()["weights_error"])
            if all(_fits(kept, n, m) for n, m in linears.items()) and len(kept) == 2 * len(linears):
                return kept, report
        except Exception:  # unreadable or another model's: made again below
            pass
    tensors, report = _kernel_tensors(model, gguf_path)
    if path is not None:
        tmp = hidden_sibling(path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={"weights_error": json.dumps(report)})
            os.replace(tmp, path)
        except OSError:
            pass  # not kept: the next load reads the GGUF again
        finally:
            tmp.unlink(missing_ok=True)
    return tensors, report


def use_gguf(model: Any, gguf_path: Path, folder: Path | None) -> dict[str, Any]:
    """Replace every linear layer of `model` (loaded from `gguf_path`) by the kernel nearest its tensor's type in
    the file, in place (the kernels' tensors kept in `folder`); returns the weights' difference from the file's."""
    tensors, report = _prepared(model, gguf_path, folder)
    with torch.inference_mode():
        for name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            bias = module.bias.detach().clone() if module.bias is not None else None
            if f"{name}.int4" in tensors:
                two = tensors[f"{name}.int4"]  # [rows, cols/2]: even columns in the low nibble
                codes = torch.stack([two & 0x0F, two >> 4], dim=-1).reshape(module.out_features, module.in_features)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
                layer = stored.Q4Linear(packed, tensors[f"{name}.int4sz"], module.in_features, module.out_features, bias)
            else:
                layer = stored.Q8Linear(tensors[f"{name}.int8"], tensors[f"{name}.int8s"], bias)
            model.set_submodule(name, layer)
    return report
