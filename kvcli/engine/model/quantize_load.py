"""A safetensors model quantized layer by layer as it loads (`weights="q8"` or `"q4"` on a folder or a hub model).

The transformers model is built without weights (on the meta device); each tensor is then read alone from
the safetensors files (read, not mapped, so the file's pages are not counted as the process's memory), in the
model's dtype, and a linear layer's weight goes straight into its quantized layer (stored.Q8Linear, Q4Linear,
Bf16Linear for q4's output layer), quantized a slice of rows at a time: memory peaks at the quantized model plus
one layer's float weight, never at the float model. The layers, their codes and the weights' fingerprint are those of
loading the float model and quantizing it in place (stored.use_q8, use_q4): the same bits. A checkpoint whose
names are not the model's own (transformers renames or merges them as it loads), or that is not safetensors, is
left to that path (load returns None).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from . import stored

_CHUNK = 1 << 22  # elements hashed at a time (format.identity.weights_sha256's chunk)


def safetensors_files(folder: Path) -> list[Path] | None:
    """The folder's safetensors weight files (an index's shards, or model.safetensors), None when its weights are in
    another format or the index names a file that is not there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        files = [folder / n for n in names]
        return files if all(f.is_file() for f in files) else None
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _entries(files: list[Path]) -> dict[str, tuple[Path, int, str, list[int], int]]:
    """name -> (file, where its bytes start, safetensors dtype, shape, byte count), from the files' headers alone."""
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            head = json.loads(fh.read(size))
        for k, v in head.items():
            if k != "__metadata__":
                lo, hi = v["data_offsets"]
                out[k] = (f, 8 + size + lo, v["dtype"], v["shape"], hi - lo)
    return out


def tensor_shapes(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor in `files`, from their headers alone."""
    return {k: (e[2], e[3]) for k, e in _entries(files).items()}


def _read(entry: tuple[Path, int, str, list[int], int]) -> torch.Tensor:
    """One tensor's values, read from its file into memory of its own (not mapped: the file's pages are not kept)."""
    path, start, kind, shape, nbytes = entry
    if kind not in _DTYPES:
        raise ValueError(f"{path.name} holds a tensor of type {kind}")
    buf = bytearray(nbytes)
    with open(path, "rb") as fh:
        fh.seek(start)
        if fh.readinto(buf) != nbytes:
            raise ValueError(f"{path.name} is cut short")
    return torch.frombuffer(buf, dtype=_DTYPES[kind]).reshape(shape) if nbytes else torch.empty(shape, dtype=_DTYPES[kind])


def load_files(files: list[Path], config: Any, dtype: torch.dtype, mode: str, trust_remote_code: bool = False,
               available: Any = None) -> tuple[Any, str] | None:
    """A folder or hub model whose weights are `files`: refused (memory.ModelTooLargeError) when it would not fit the
    memory free now in `mode` (safetensors files: their headers say the sizes); then, for q8 and q4, load() on them.
    None: loaded as float first (float mode, other weight files, names that are not the model's); a ModelError
    naming the folder when a tensor does not fit the model."""
    from . import memory

    shards = safetensors_files(files[0].parent) if files else None
    if not shards:
        return None
    memory.check_folder_fits(shards[0].parent, tensor_shapes(shards), mode, dtype.itemsize, available)
    if mode not in ("q8", "q4"):
        return None
    try:
        found = load(config, dtype, shards, mode, trust_remote_code)
    except (ValueError, OSError) as exc:
        from ...errors import ModelError

        raise ModelError(f"{shards[0].parent}: cannot load the model's weights ({exc})") from exc
    if found is not None and (shards[0].parent / "generation_config.json").is_file():  # as from_pretrained reads it
        from transformers import GenerationConfig

        found[0].generation_config = GenerationConfig.from_pretrained(str(shards[0].parent))
    return found


def load(config: Any, dtype: torch.dtype, files: list[Path], mode: str, trust_remote_code: bool = False) -> tuple[Any, str] | None:
    """The model of `config` with its linear layers in `mode` ("q8" or "q4"), read from `files` one tensor at a time,
    and the sha256 of its float weights (fingerprint.weights_sha256's value for the float model); None when the
    files' names do not match the model's parameters and buffers (the float path then loads it)."""
    from ...format.identity import WEIGHTS_SCHEME
    from .gguf_weights import skeleton

    if getattr(config, "quantization_config", None) is not None:
        return None  # a checkpoint stored quantized: transformers' quantizer reads it
    model = skeleton(config, dtype, trust_remote_code)
    if getattr(model, "_keep_in_fp32_modules", None) or any(
            any(True for _ in m.parameters(recurse=False)) and any(b.is_meta for b in m.buffers(recurse=False))
            for m in model.modules()):
        return None  # modules kept in float32, or initialised buffers beside weights: left to from_pretrained
    where = _entries(files)
    output = model.get_output_embeddings()
    params = dict(model.named_parameters())  # tied weights once, under the first name, as the fingerprint walks them
    persistent = {n for n, _ in model.named_buffers() if n in model.state_dict()}
    if not set(params) | persistent <= set(where):
        return None
    values: dict[str, torch.Tensor] = {}  # name -> the float tensor, until its module is made

    def read(name: str) -> torch.Tensor:
        t = _read(where[name]).to(dtype)
        if tuple(t.shape) != tuple((params.get(name) if name in params else dict(model.named_buffers())[name]).shape):
            raise ValueError(f"{name} is {list(t.shape)} in {where[name][0].name}")
        return t

    h = hashlib.sha256(WEIGHTS_SCHEME.encode())
    with torch.inference_mode():
        for name in params:  # the fingerprint's order; each weight hashed as the float model's would be
            t = read(name)
            flat = t.reshape(-1)
            h.update(f"{name}:{list(t.shape)}:".encode())
            for start in range(0, flat.numel(), _CHUNK):
                h.update(flat[start:start + _CHUNK].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            module_name, _, kind = name.rpartition(".")
            module = model.get_submodule(module_name)
            if isinstance(module, torch.nn.Linear):
                values[name] = t
                if kind == "bias" or module.bias is None or f"{module_name}.bias" in values:
                    _make_linear(model, module_name, module, values, mode, output)
            else:
                _put(module, kind, t)
        for module_name, module in model.named_modules():  # a linear layer tied to a weight read above (the output)
            if isinstance(module, torch.nn.Linear) and module.weight.is_meta:
                values[f"{module_name}.weight"] = _tied(model, module)
                _make_linear(model, module_name, module, values, mode, output)
        for name in sorted(persistent):
            module_name, _, kind = name.rpartition(".")
            model.get_submodule(module_name).register_buffer(kind, read(name))
        for module_name, module in model.named_modules():  # buffers made at init (rotary frequencies)
            if any(b.is_meta for b in module.buffers(recurse=False)):
                module.to_empty(device="cpu", recurse=False)
                model._init_weights(module)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"no value for {left[0]}")
    return model, h.hexdigest()


def _put(module: torch.nn.Module, kind: str, value: torch.Tensor) -> None:
    setattr(module, kind, torch.nn.Parameter(value, requires_grad=False))


def _tied(model: Any, module: torch.nn.Module) -> torch.Tensor:
    embedding = model.get_input_embeddings()
    if module is not model.get_output_embeddings() or embedding.weight.is_meta:
        raise ValueError("a linear layer with no weight of its own")
    return embedding.weight.detach()


def _make_linear(model: Any, name: str, module: torch.nn.Linear, values: dict[str, torch.Tensor], mode: str,
                 output: Any) -> None:
    """Put the quantized layer of `module` (its weight and bias in `values`, dropped from there) into the model, as
    stored.use_q8 / use_q4 make it from the float layer."""
    weight = values.pop(f"{name}.weight")
    bias = values.pop(f"{name}.bias", None)
    if mode == "q8":
        layer = stored.Q8Linear(*_by_rows(stored.quantize_q8, weight), bias)
    elif module is output:
        layer = stored.Bf16Linear(weight, bias)
    elif module.in_features % stored.GROUP == 0:
        layer = stored._pack_q4(*_by_rows(stored.quantize_q4, weight), bias)
    else:  # stays a float layer, as use_q4 leaves it
        layer = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    model.set_submodule(name, layer)
    _trim()


def _trim() -> None:
    """Give the float weights just freed back to the system (glibc keeps freed blocks of a size it has seen freed in
    its heap, where they would add up to the float model's size); nothing where the C library has no malloc_trim."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


_LIBC: Any = None


def _by_rows(quantize: Any, weight: torch.Tensor, rows: int = 1024) -> tuple[torch.Tensor, ...]:
    """quantize(weight) a slice of rows at a time (its values depend on each row alone): the same tensors, with
    temporaries of a slice's size instead of the weight's."""
    out: tuple[torch.Tensor, ...] = ()
    for lo in range(0, weight.shape[0], rows):
        part = quantize(weight[lo:lo + rows])
        if not out:  # each result's rows filled in place: no list of slices to concatenate
            out = tuple(torch.empty((weight.shape[0], *t.shape[1:]), dtype=t.dtype) for t in part)
        for whole, t in zip(out, part):
            whole[lo:lo + t.shape[0]] = t
    return out
