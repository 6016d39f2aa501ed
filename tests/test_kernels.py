"""The GGUF kernels (kvcli/engine/model/kernels): every supported type dequantized bit for bit as gguf does it, on
random blocks; PackedLinear and PackedEmbedding computing those weights' products and rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcli.engine.model import kernels
from kvcli.engine.model.kernels import formats, modules

KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}  # byte offsets of each block's float16 scales (and mins)


def random_tensor(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random bytes [rows, bytes a row] of `kind`: any code, scale and min bytes, finite float16 scales."""
    rng = np.random.default_rng(seed)
    if kind in ("F16", "BF16", "F32"):
        w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
        w = w.to({"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[kind])
        return w.view(torch.uint8).reshape(rows, -1).clone()
    block, size = formats.SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in HALVES[kind]:
        scale = (rng.standard_normal(raw.shape[0]) * 0.02).astype(np.float16)
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def gguf_values(kind: str, raw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, cols)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_gguf_bit_for_bit(kind):
    rows, cols = 12, 512
    raw = random_tensor(kind, rows, cols)
    tensors = kernels.prepare(kind, raw, rows, cols)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
    got = kernels.dequantize(kind, tensors, rows, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, gguf_values(kind, raw, rows, cols))


def test_supported_types_and_refusals():
    assert all(kernels.supported(k) for k in KINDS)
    assert not any(kernels.supported(k) for k in ("Q2_K", "Q3_K", "IQ4_XS", "TQ1_0"))
    with pytest.raises(ValueError, match="Q2_K"):
        kernels.prepare("Q2_K", torch.zeros(1, 84, dtype=torch.uint8), 1, 256)
    with pytest.raises(ValueError, match="shape"):
        kernels.prepare("Q4_K", torch.zeros(2, 143, dtype=torch.uint8), 2, 256)
    with pytest.raises(ValueError, match="whole number"):
        kernels.prepare("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 2, 200)


def _layer(kind: str, rows: int, cols: int, bias: bool, **kw) -> tuple[kernels.PackedLinear, torch.Tensor, torch.Tensor | None]:
    raw = random_tensor(kind, rows, cols, seed=rows + cols)
    b = torch.randn(rows) if bias else None
    tensors = kernels.prepare(kind, raw, rows, cols)
    return kernels.PackedLinear(kind, rows, cols, tensors, b, **kw), kernels.dequantize(kind, tensors, rows, cols), b


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = float(ref.abs().max())
    assert float((y.float() - ref).abs().max()) <= rel * scale, (float((y.float() - ref).abs().max()), scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3, 40])
def test_packed_linear_torch_path_multiplies_the_dequantized_weights(kind, n):
    rows, cols = 48, 512
    layer, w, b = _layer(kind, rows, cols, bias=True, native=False)
    x = torch.randn(n, cols)
    y = layer(x)
    assert y.shape == (n, rows) and y.dtype == torch.float32
    ref = x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T + b  # bfloat16 inputs, float32 sums
    _close(y, ref, 1e-2)  # the GEMM's output is rounded to bfloat16


def test_packed_linear_keeps_shape_and_dtype_and_tiles(monkeypatch):
    layer, w, _ = _layer("Q6_K", 64, 256, bias=False, native=False)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    whole = layer(x)
    assert whole.shape == (2, 5, 64) and whole.dtype == torch.bfloat16
    assert (layer.in_features, layer.out_features) == (256, 64)
    monkeypatch.setattr(modules, "TILE", 256 * 7)  # 7 rows a tile, the last tile short
    assert torch.equal(layer(x), whole)


@pytest.mark.parametrize("kind", ["Q5_0", "Q8_0", "Q4_K", "Q6_K", "F16"])
def test_packed_embedding_dequantizes_the_rows_asked_for(kind):
    rows, cols = 30, 256
    tensors = kernels.prepare(kind, random_tensor(kind, rows, cols), rows, cols)
    emb = kernels.PackedEmbedding(kind, rows, cols, tensors)
    ids = torch.tensor([[3, 0, 29], [3, 7, 7]])
    w = kernels.dequantize(kind, tensors, rows, cols)
    assert torch.equal(emb(ids), w[ids])
    emb16 = kernels.PackedEmbedding(kind, rows, cols, tensors, dtype=torch.bfloat16)
    assert emb16(ids).dtype == torch.bfloat16 and torch.equal(emb16(ids), w[ids].to(torch.bfloat16))
    tied = kernels.PackedLinear(kind, rows, cols, tensors)
    assert tied.blocks.data_ptr() == emb.blocks.data_ptr()  # the same tensors, not a copy


def test_backend_is_named():
    assert isinstance(kernels.backend(), str) and kernels.backend()
    with kernels.torch_only():
        assert kernels.backend() == "torch"
