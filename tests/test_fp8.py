"""FP8 on the CPU (notebook 12): scaling, the scaled matmul, its error beside bf16 and fp32, the
bytes it saves, and the calculator's fp8 row."""

import pytest
import torch

from labs.experiments.fp8 import (
    BLOCK,
    E4M3,
    E5M2,
    calculator_rows,
    calculator_table,
    dequantize,
    fp8_matmul,
    fp8_max,
    input_bytes,
    make_inputs,
    matmul_errors,
    quantize,
    relative_error,
)

# The relative gap between neighbouring values of a format: 2^-mantissa_bits.
STEP = {torch.bfloat16: 2.0**-7, E4M3: 2.0**-3, E5M2: 2.0**-2}


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_per_tensor_scale_fills_the_format_and_rounds_to_half_a_step(dtype):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 1e-3
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and scale.shape == ()
    assert q.float().abs().max().item() == fp8_max(dtype)  # amax lands on the largest value
    back = dequantize(q, scale)
    normal = x.abs() / scale >= torch.finfo(dtype).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max().item() <= STEP[dtype] / 2 * (1 + 1e-6)  # round to nearest
    assert relative_error(back, x) < STEP[dtype] / 2


def test_per_block_scales_each_block_of_a_row():
    x = torch.randn(4, 2 * BLOCK, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 1e5  # an outlier in row 0's first block
    q, scale = quantize(x, block=BLOCK)
    assert scale.shape == (4, 2)
    blocks = dequantize(q, scale, block=BLOCK).reshape(4, 2, BLOCK).abs().amax(-1)
    assert torch.allclose(blocks, x.reshape(4, 2, BLOCK).abs().amax(-1))  # each amax exact
    # the outlier's scale is its block's alone: the other blocks keep their precision
    assert relative_error(dequantize(q, scale, block=BLOCK)[1:], x[1:]) < STEP[E4M3] / 2


def test_scaled_mm_multiplies_the_same_fp8_values():
    """torch._scaled_mm (per-tensor scales) = the dequantised inputs multiplied in fp32."""
    a, b = make_inputs(32, BLOCK, 16, seed=2)
    qa, sa = quantize(a)
    qbt, sbt = quantize(b.T)
    expected = dequantize(qa, sa) @ dequantize(qbt, sbt).T
    assert torch.allclose(fp8_matmul(a, b), expected, rtol=1e-5, atol=1e-5)


def test_errors_order_by_mantissa_bits_and_scaling_matters():
    rows = {r["format"]: r for r in matmul_errors(m=64, k=256, n=64)}
    err = {name: r["rel_error"] for name, r in rows.items()}
    assert err["fp32"] < err["bf16"] < err["fp8 e4m3, per-tensor scale"]
    assert err["fp8 e4m3, per-tensor scale"] < err["fp8 e5m2, per-tensor scale"]
    assert err["bf16"] < STEP[torch.bfloat16]
    assert (
        err["fp8 e4m3, per-tensor scale"] < STEP[E4M3]
        and err["fp8 e5m2, per-tensor scale"] < STEP[E5M2]
    )
    # gradient-sized values: without a scale most of them fall below e4m3's smallest values
    small = {r["format"]: r["rel_error"] for r in matmul_errors(m=64, k=256, n=64, magnitude=1e-3)}
    assert small["fp8 e4m3, no scaling"] > 0.5
    assert small["fp8 e4m3, per-tensor scale"] == pytest.approx(err["fp8 e4m3, per-tensor scale"])
    # a 1e5 outlier: per-tensor scaling loses the other rows' values, per-block does not
    spiky = {r["format"]: r["rel_error"] for r in matmul_errors(m=64, k=256, n=64, outlier=1e5)}
    assert spiky["fp8 e4m3, per-tensor scale"] > 2 * err["fp8 e4m3, per-tensor scale"]
    assert spiky["fp8 e4m3, per-block scale"] < STEP[E4M3]


def test_input_bytes_are_the_tensors_bytes():
    a, b = make_inputs(16, 2 * BLOCK, 8)
    shapes = (a.shape, b.shape)
    assert input_bytes(*shapes, "fp32") == _tensor_bytes(a, b)
    assert input_bytes(*shapes, "bf16") == _tensor_bytes(a.bfloat16(), b.bfloat16())
    assert input_bytes(*shapes, "fp8") == _tensor_bytes(*quantize(a), *quantize(b.T))
    assert input_bytes(*shapes, "fp8-block") == _tensor_bytes(
        *quantize(a, block=BLOCK), *quantize(b.T, block=BLOCK)
    )
    rows = {r["format"]: r for r in matmul_errors(m=16, k=2 * BLOCK, n=8)}
    assert rows["fp8 e4m3, per-tensor scale"]["bytes"] < rows["bf16"]["bytes"] / 2 + 16


def test_calculator_fp8_row_changes_activations_only():
    run = dict(seq=4096, mbs=1, zero=1, dp=8)
    fp32, bf16, fp8 = calculator_rows("llama3-8b", **run)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert fp8[key] == bf16[key]
    assert fp8["activation_bytes"] < bf16["activation_bytes"] < fp32["activation_bytes"]
    assert "bf16-mixed + fp8" in calculator_table("llama3-8b", **run)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="matrix"):
        quantize(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="float8"):
        quantize(torch.ones(2, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="block"):
        quantize(torch.ones(2, 100), block=BLOCK)
    with pytest.raises(ValueError, match="multiple"):
        make_inputs(4, 100, 4)
    with pytest.raises(ValueError, match="fmt"):
        input_bytes((1, 1), (1, 1), "fp4")
