"""The GGUF kernels (kvcli/engine/model/kernels): every supported type dequantized bit for bit as gguf does it, on
random blocks, in torch and in the native code; the native one-row products equal to the products of the same 8-bit
activations in float64 (at every CPU level this machine runs) and within the bound the 8-bit rounding allows of the
float product; PackedLinear and PackedEmbedding on both paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcli.engine.model import kernels
from kvcli.engine.model.kernels import formats, modules, native

QUANTIZED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
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


def _cpu_has(*flags: str) -> bool:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    words = set(text.split())
    return all(f in words for f in flags)


def test_native_extension_is_built_where_the_cpu_runs_it():
    """The install builds the extension (pyproject ext-modules, optional): on a CPU with AVX2, FMA and F16C the
    native kernels must be there, so a failed build shows here instead of as a slow fallback."""
    if not _cpu_has("avx2", "fma", "f16c"):
        assert kernels.backend() == "torch"
        return
    assert native.level() > 0 and kernels.backend() in ("avx2", "avx-vnni", "avx512-vnni")
    if _cpu_has("avx512_vnni", "avx512vl", "avx512bw"):
        assert kernels.backend() == "avx512-vnni"


needs_native = pytest.mark.skipif(native.level() == 0, reason="native kernels not built or CPU without AVX2/FMA/F16C")


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED)
def test_native_dequantize_is_gguf_bit_for_bit(kind):
    """At every CPU level this machine runs and in the scalar code (level 0), float32 and bfloat16."""
    rows, cols = 9, 512
    raw = random_tensor(kind, rows, cols, seed=5)
    want = gguf_values(kind, raw, rows, cols)
    for level in [0, *levels()]:
        assert torch.equal(native.dequantize(kind, raw, cols, at=level), want), level
        assert torch.equal(native.dequantize(kind, raw, cols, torch.bfloat16, at=level), want.to(torch.bfloat16)), level
    assert torch.equal(kernels.dequantize(kind, kernels.prepare(kind, raw, rows, cols), rows, cols), want)


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED)
def test_native_dequantize_rounds_to_bfloat16_as_torch_does_at_every_level(kind):
    """Scales spread over float16's whole finite range, so products land on bfloat16 ties, subnormals and the
    largest values: every level rounds them as torch does."""
    rows, cols = 64, 512
    raw = random_tensor(kind, rows, cols, seed=11).numpy().copy()
    block, size = formats.SIZES[kind]
    blocks = raw.reshape(-1, size)
    rng = np.random.default_rng(3)
    for at in HALVES[kind]:
        halves = rng.integers(0, 0x7C00, blocks.shape[0], dtype=np.uint16) | (rng.integers(0, 2, blocks.shape[0], dtype=np.uint16) << 15)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    raw = torch.from_numpy(raw)
    want = gguf_values(kind, raw, rows, cols)
    assert bool(want.isfinite().all())
    for level in [0, *levels()]:
        assert torch.equal(native.dequantize(kind, raw, cols, torch.bfloat16, at=level), want.to(torch.bfloat16)), level


@needs_native
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # gguf's own inf * 0
def test_native_reads_every_float16_scale_as_gguf_does():
    """Every float16 bit pattern (subnormals, infinities and NaNs included) as a Q8_0 scale over codes of 1."""
    raw = np.zeros((65536, 34), dtype=np.uint8)
    raw[:, 0:2] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:] = 1
    raw_t = torch.from_numpy(raw.reshape(256, -1))
    got, want = native.dequantize("Q8_0", raw_t, 256 * 32), gguf_values("Q8_0", raw_t, 256, 256 * 32)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def activations_8bit(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the native kernel multiplies: x [n, cols] -> codes [n, cols] (round(x * 127 / amax), half to even) and
    scales amax / 127 [n, cols / group], in float32 as the C code computes them."""
    g = x.float().reshape(x.shape[0], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(g * inv).clamp(-127, 127).reshape(x.shape), (amax / 127).squeeze(-1)


def levels() -> list[int]:
    return list(range(1, native.level() + 1))


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_native_product_is_the_8bit_activations_product(kind, x_dtype):
    """At every CPU level: y equals sum over blocks of (activation scale) * sum(w * code), computed in float64, to
    float32's rounding; and it is within the rigorous bound of 8-bit rounding of the float product x W^T:
    |y - x W^T| <= sum over blocks of scale / 2 * sum |w| (the measured error is printed)."""
    rows, cols, n = 42, 768, 6  # four weight rows at a time and single ones, four activation rows and single ones
    raw = random_tensor(kind, rows, cols, seed=11)
    w = gguf_values(kind, raw, rows, cols).double()  # [rows, cols]
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(2)).to(x_dtype)
    bias = torch.randn(rows)
    group = 256 if kind.endswith("_K") else 32
    codes, scales = activations_8bit(x, group)
    terms = (w[None] * codes.double()[:, None, :]).reshape(n, rows, -1, group).sum(-1)  # [n, rows, blocks]
    exact = (terms * scales.double()[:, None, :]).sum(-1) + bias.double()
    size = ((w.abs()[None] * codes.double().abs()[:, None, :]).reshape(n, rows, -1, group).sum(-1)
            * scales.double()[:, None, :]).sum(-1)
    xf = x.double()
    bound = ((w.abs().reshape(rows, -1, group).sum(-1)[None] * scales.double()[:, None, :] / 2).sum(-1)) * 1.001
    float_product = xf @ w.T + bias.double()
    for level in levels():
        y = native.gemv(kind, raw, cols, x, bias, at=level)
        assert y.dtype == x_dtype and y.shape == (n, rows)
        rounding = 2e-6 * size + 1e-30 if x_dtype == torch.float32 else 2 ** -8 * exact.abs() + 2e-6 * size
        assert bool(((y.double() - exact).abs() <= rounding).all()), level
        assert bool(((y.double() - float_product).abs() <= bound + rounding).all()), level
    err = (y.double() - float_product).abs().max() / float_product.abs().max()
    print(f"{kind} {x_dtype}: max |native - float| / max |float| = {float(err):.2e}")


@needs_native
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_native_product_of_float_weights_is_float32s(kind, x_dtype):
    """At every CPU level: float weights times x (as float32) equal the float64 product to float32's rounding of a
    sum of cols / 8 + 8 terms (8 lanes, then across them); a bfloat16 result is that rounded."""
    rows, cols, n = 42, 776, 6
    raw = random_tensor(kind, rows, cols, seed=12)
    w = gguf_values(kind, raw, rows, cols).double()
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(3)).to(x_dtype)
    bias = torch.randn(rows)
    exact = x.double() @ w.T + bias.double()
    size = x.double().abs() @ w.abs().T + bias.double().abs()
    rounding = (cols / 8 + 8) * 2 ** -24 * size
    if x_dtype == torch.bfloat16:
        rounding = rounding + 2 ** -8 * exact.abs()
    for level in levels():
        y = native.gemv(kind, raw, cols, x, bias, at=level)
        assert y.dtype == x_dtype and y.shape == (n, rows)
        assert bool(((y.double() - exact).abs() <= rounding).all()), level
    with pytest.raises(ValueError, match="quantized"):
        native.dequantize(kind, raw, cols)
    assert not native.runs(kind, 12) and native.runs(kind, 16)


@needs_native
@pytest.mark.parametrize("kind", QUANTIZED + ["F32", "F16", "BF16"])
def test_native_rows_do_not_depend_on_their_neighbours(kind):
    """Each row of x gets the same bits alone as beside any number of other rows, at every level: a question's
    tokens, or a batch's rows, multiply as one-row steps do. Every level gives the same bits (the integer sums are
    exact, whatever the vector width; the float steps after them are the same)."""
    rows, cols = 29, 512
    raw = random_tensor(kind, rows, cols, seed=3)
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(rows)
    first = native.gemv(kind, raw, cols, x, bias, at=1)
    for level in levels():
        alone = torch.cat([native.gemv(kind, raw, cols, x[i : i + 1], bias, at=level) for i in range(len(x))])
        assert torch.equal(alone, first), level
        for n in (2, 4, 5, 11):
            assert torch.equal(native.gemv(kind, raw, cols, x[:n], bias, at=level), alone[:n]), (level, n)


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_packed_linear_native_and_torch_paths(kind):
    rows, cols = 64, 512
    layer, w, b = _layer(kind, rows, cols, bias=True)
    torch_layer = kernels.PackedLinear(kind, rows, cols, {"blocks": layer.blocks}, b, native=False)
    x = torch.randn(2, 3, cols)  # 6 rows: the native kernel
    ref = x.double() @ w.double().T + b.double()
    fast, slow = layer(x), torch_layer(x)
    with kernels.torch_only():
        assert torch.equal(layer(x), slow)  # the context forces the torch path on a native layer
    assert fast.shape == slow.shape == (2, 3, rows)
    assert not torch.equal(fast, slow)  # two arithmetics: 8-bit activations, bfloat16 ones
    _close(fast, ref, 2e-2)
    _close(slow, ref, 2e-2)
    few = torch.randn(modules.native_rows(kind), cols)  # the most rows the native kernel takes
    assert torch.equal(layer(few), native.gemv(kind, layer.blocks, cols, few, layer.bias))
    many = torch.randn(modules.native_rows(kind) + 1, cols)  # prefill: bfloat16 GEMM on natively dequantized tiles
    assert torch.equal(layer(many), torch_layer(many))


def test_packed_linear_has_no_parameters_and_takes_a_converted_bias():
    """transformers reads a model's dtype from its first parameter: the layer has none (its bias is a buffer), and a
    model moved to bfloat16 (its buffers with it) still runs."""
    layer, w, b = _layer("Q8_0", 32, 256, bias=True)
    assert not list(layer.parameters()) and layer.bias.dtype == torch.float32
    x = torch.randn(1, 256)
    before = layer(x)
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16 and layer.blocks.dtype == torch.uint8
    _close(layer(x), before.double(), 2e-2)
