"""Whether a model fits the memory free now: refused before anything loads, with the size it needs and the mode that
fits, never left to the kernel's out-of-memory killer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ...errors import ModelError

RUNTIME = 600 << 20  # torch, transformers, the tokenizer and a prefill chunk's activations: what any mode adds
SLACK = 1.1  # caches, allocator slack


class ModelTooLargeError(ModelError):
    """The model would not fit the memory free now (exit 1)."""


def available() -> int:
    """Bytes of memory free for a new process now (the kernel's MemAvailable: free plus reclaimable cache)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown here (not Linux): nothing is refused


def needed(path: Path, mode: str, dtype: str) -> int:
    """Bytes a GGUF model needs in `mode`: the file's own tensors (mapped) for gguf; float32 weights (two bytes a
    weight for a 16-bit --dtype) for the modes that load transformers' float model first."""
    if mode == "gguf":
        weights = path.stat().st_size
    else:
        from .gguf_file import read_header

        per = 2 if dtype in ("bfloat16", "float16") else 4
        weights = sum(i.rows * i.cols for i in read_header(path).tensors.values()) * per
    return int(weights * SLACK) + RUNTIME


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(path: Path, mode: str, dtype: str, free: Callable[[], int] | None = None) -> None:
    """Refuse (ModelTooLargeError) a GGUF model that needs more than `free()` bytes (default: available) in `mode`,
    naming the size it needs and the mode that fits, if one does."""
    have = (free or available)()
    need = needed(path, mode, dtype)
    if need <= have:
        return
    what = "its own low-bit weights (--weights gguf)" if mode == "gguf" else f"--weights {mode} (float weights)"
    message = f"{path}: the model needs about {_gb(need)} of memory as {what}, and {_gb(have)} is free"
    small = needed(path, "gguf", dtype)
    if mode != "gguf" and small <= have:
        raise ModelTooLargeError(message, hint=f"--weights gguf runs it in about {_gb(small)}")
    raise ModelTooLargeError(message, hint="free memory, or use a smaller or lower-bit GGUF file")


def folder_needed(shapes: dict[str, tuple[str, list[int]]], mode: str, per: int) -> int:
    """Bytes a safetensors model (tensor name -> (dtype, shape)) needs in `mode` at `per` bytes a float weight: every
    tensor as float, or (q8, q4) its linear weights quantized as they load (quantize_load) and the rest as float."""
    total = 0
    for name, (_, shape) in shapes.items():
        n = 1
        for d in shape:
            n *= d
        linear = len(shape) == 2 and name.endswith(".weight") and "embed" not in name and "wte" not in name
        if mode == "q8" and linear:
            total += n + 2 * shape[0]  # int8 codes, a bfloat16 scale a row
        elif mode == "q4" and linear:
            total += 2 * n if "lm_head" in name else n // 2 + n // 8  # the output layer in bfloat16; codes, scale+zero
        else:
            total += n * per
    return int(total * SLACK) + RUNTIME


def check_folder_fits(folder: Path, shapes: dict[str, tuple[str, list[int]]], mode: str, per: int,
                      free: Callable[[], int] | None = None) -> None:
    """Refuse (ModelTooLargeError) a folder or hub model that needs more than `free()` bytes in `mode`, naming the size
    it needs and the mode that fits, if one does."""
    have = (free or available)()
    need = folder_needed(shapes, mode, per)
    if need <= have:
        return
    what = f"--weights {mode}" + (" (float weights)" if mode == "float" else " (quantized as it loads)")
    message = f"{folder}: the model needs about {_gb(need)} of memory as {what}, and {_gb(have)} is free"
    fits = next((m for m in ("q8", "q4") if m != mode and folder_needed(shapes, m, per) <= have
                 and (mode == "float" or m == "q4")), None)
    if fits:
        raise ModelTooLargeError(message, hint=f"--weights {fits} runs it in about {_gb(folder_needed(shapes, fits, per))}")
    raise ModelTooLargeError(message, hint="free memory, or use a smaller model")
