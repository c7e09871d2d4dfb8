"""FP8, honestly sized (notebook 12): one matmul with its inputs cast to FP8 on the CPU, its error
against bf16 and fp32, the bytes it saves, and what the memory calculator says FP8 training saves.

    rows = matmul_errors(m=128, k=512, n=128)        # one row per input format
    print(format_errors(rows))
    print(calculator_table("llama3-8b", seq=4096))   # fp32, bf16-mixed, bf16-mixed + fp8 per rank

FP8 comes in two formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"):

    format       exponent  mantissa  largest  smallest normal  relative step
    e4m3 (fn)        4         3        448       2^-6              2^-3
    e5m2             5         2      57344       2^-14             2^-2

Three mantissa bits cannot hold a tensor's values as they are: activations and gradients span a
few powers of two around their own scale, not fp8's. So each tensor is *scaled* into the format
first, ``x_fp8 = cast(x / s)`` with ``s = amax(|x|) / 448`` (per-tensor scaling: the largest
value lands on e4m3's largest), and the matmul multiplies by ``s_a · s_b`` afterwards. Here the
matmul is ``torch._scaled_mm`` (fp8 inputs, their scales, fp32 output), the call that runs on an
H100's FP8 tensor cores; on the CPU it works and is slow. One outlier makes ``amax`` large and
every other value falls among fp8's few smallest steps: per-block scaling (a scale for every 128
consecutive values of a row, DeepSeek-V3 §3.3) limits the damage to the outlier's block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from labs.theory.memory_report import GIB, compare, format_rows
from labs.theory.presets import GPUS, preset

if TYPE_CHECKING:
    from matplotlib.axes import Axes

E4M3 = torch.float8_e4m3fn  # activations and weights: more precision
E5M2 = torch.float8_e5m2  # gradients: more range
BLOCK = 128  # values per scale with per-block scaling (DeepSeek-V3's 1 x 128 tiles)
SCALE_BYTES = 4  # a scale is an fp32 number


# name -> (dtype, exponent bits, mantissa bits), widest first
FORMATS = {
    "fp32": (torch.float32, 8, 23),
    "bf16": (torch.bfloat16, 8, 7),
    "fp16": (torch.float16, 5, 10),
    "fp8 e4m3": (E4M3, 4, 3),
    "fp8 e5m2": (E5M2, 5, 2),
}


def formats_table() -> str:
    """Each training format's bits, largest value, smallest normal value and relative step
    (2^-mantissa bits: the gap between 1 and the next value), read from ``torch.finfo``."""
    lines = [
        f"{'format':<10}{'bytes':>6}{'exp':>5}{'mant':>6}{'largest':>12}{'smallest':>11}{'step':>10}"
    ]
    for name, (dtype, exponent, mantissa) in FORMATS.items():
        info = torch.finfo(dtype)
        lines.append(
            f"{name:<10}{info.bits // 8:>6}{exponent:>5}{mantissa:>6}{info.max:>12.3g}"
            f"{info.smallest_normal:>11.3g}{info.eps:>10.3g}"
        )
    return "\n".join(lines)


def fp8_max(dtype: torch.dtype = E4M3) -> float:
    """The largest finite value of an fp8 format: 448 (e4m3), 57344 (e5m2)."""
    return torch.finfo(dtype).max


def quantize(
    x: torch.Tensor, dtype: torch.dtype = E4M3, *, block: int | None = None, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [R, C] cast to fp8 ``dtype``, with its scale: ``(x_fp8, s)`` and ``x ≈ x_fp8 · s``.

    Per tensor (``block=None``): one scale, ``s = amax(|x|) / fp8_max`` (shape []). Per block:
    a scale for every ``block`` consecutive values of a row (shape [R, C/block]). ``scaled=False``
    casts ``x`` as it is (``s = 1``): what happens without scaling."""
    if x.dim() != 2:
        raise ValueError(f"x must be a matrix [R, C], got shape {tuple(x.shape)}")
    if dtype not in (E4M3, E5M2):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    x = x.float()
    if not scaled:
        return x.to(dtype), torch.ones((), dtype=torch.float32)
    if block is None:
        amax = x.abs().max()
    else:
        if x.shape[1] % block:
            raise ValueError(f"x has {x.shape[1]} columns, not a multiple of block={block}")
        amax = x.reshape(x.shape[0], -1, block).abs().amax(dim=-1)  # [R, C/block]
    scale = (amax / fp8_max(dtype)).clamp(min=torch.finfo(torch.float32).tiny)
    q = _apply(x, scale, block, divide=True)
    # x / s is within ±fp8_max by construction; clamp anyway: a cast past it would be NaN (e4m3fn)
    return q.clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """The fp32 values an fp8 tensor and its scale stand for: ``q · s``."""
    return _apply(q.float(), scale, block, divide=False)


def _apply(x: torch.Tensor, scale: torch.Tensor, block: int | None, divide: bool) -> torch.Tensor:
    if block is None or scale.dim() == 0:
        return x / scale if divide else x * scale
    blocks = x.reshape(x.shape[0], -1, block)  # [R, C/block, block]
    s = scale.unsqueeze(-1)  # [R, C/block, 1]
    return (blocks / s if divide else blocks * s).reshape(x.shape)


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    dtype: torch.dtype = E4M3,
    *,
    block: int | None = None,
    scaled: bool = True,
) -> torch.Tensor:
    """``a`` [M, K] @ ``b`` [K, N] with both inputs cast to fp8, accumulated in fp32 [M, N].

    Per-tensor scales: ``torch._scaled_mm`` (it wants ``b`` column-major: ``b.T`` contiguous,
    transposed back). Per-block scales: each input dequantised, then an fp32 matmul (the same
    fp8 values and the same products; real kernels apply the scales per block in the loop)."""
    qa, sa = quantize(a, dtype, block=block, scaled=scaled)
    # b's blocks run along K, its reduction dimension, as a's do: quantise b.T [N, K]
    qbt, sbt = quantize(b.T, dtype, block=block, scaled=scaled)
    if block is None:
        return torch._scaled_mm(qa, qbt.T, scale_a=sa, scale_b=sbt, out_dtype=torch.float32)
    return dequantize(qa, sa, block=block) @ dequantize(qbt, sbt, block=block).T


def row_errors(x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Each row's relative error ``‖x_i − reference_i‖ / ‖reference_i‖`` (float64) [rows]: the
    error of each token's output."""
    reference = reference.double()
    return (x.double() - reference).norm(dim=-1) / reference.norm(dim=-1)


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    """The median of ``row_errors``: a typical token's error. (One norm over the whole matrix
    would be dominated by an outlier's row and hide what its scale does to the others.)"""
    return row_errors(x, reference).median().item()


def input_bytes(shape_a: tuple[int, int], shape_b: tuple[int, int], fmt: str) -> int:
    """Bytes of a matmul's two inputs in format ``fmt`` ("fp32", "bf16", "fp8", "fp8-block"),
    an fp8 tensor's scales included (one per tensor, or one per ``BLOCK`` values)."""
    numel = shape_a[0] * shape_a[1] + shape_b[0] * shape_b[1]
    if fmt == "fp32":
        return 4 * numel
    if fmt == "bf16":
        return 2 * numel
    if fmt == "fp8":
        return numel + 2 * SCALE_BYTES
    if fmt == "fp8-block":
        return numel + SCALE_BYTES * numel // BLOCK
    raise ValueError(f"fmt={fmt!r} is not one of ('fp32', 'bf16', 'fp8', 'fp8-block')")


def make_inputs(
    m: int, k: int, n: int, *, seed: int = 0, magnitude: float = 1.0, outlier: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` [m, k] and ``b`` [k, n], normal with standard deviation ``magnitude`` (1e-3: the
    size of typical gradients), and ``a[0, 0] = outlier · magnitude`` when an outlier is asked
    for (a few channels of an LLM's activations are ~100x the rest)."""
    if k % BLOCK:
        raise ValueError(f"k={k} must be a multiple of {BLOCK} (the per-block scaling's block)")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * magnitude
    b = torch.randn(k, n, generator=g) * magnitude
    if outlier is not None:
        a[0, 0] = outlier * magnitude
    return a, b


def matmul_errors(
    *,
    m: int = 128,
    k: int = 512,
    n: int = 128,
    seed: int = 0,
    magnitude: float = 1.0,
    outlier: float | None = None,
) -> list[dict]:
    """One matmul in every input format: ``format``, ``bytes`` (the two inputs, scales
    included), ``saved_vs_bf16`` (share of bf16's bytes saved) and ``rel_error`` against the
    float64 product (``relative_error``: a typical row's), ``worst_rel_error`` (the worst row's).
    Inputs from ``make_inputs``."""
    a, b = make_inputs(m, k, n, seed=seed, magnitude=magnitude, outlier=outlier)
    exact = a.double() @ b.double()
    cases = [
        ("fp32", "fp32", lambda: a @ b),
        ("bf16", "bf16", lambda: (a.bfloat16() @ b.bfloat16()).float()),
        ("fp8 e4m3, no scaling", "fp8", lambda: fp8_matmul(a, b, scaled=False)),
        ("fp8 e4m3, per-tensor scale", "fp8", lambda: fp8_matmul(a, b)),
        ("fp8 e4m3, per-block scale", "fp8-block", lambda: fp8_matmul(a, b, block=BLOCK)),
        ("fp8 e5m2, per-tensor scale", "fp8", lambda: fp8_matmul(a, b, E5M2)),
    ]
    bf16_bytes = input_bytes(a.shape, b.shape, "bf16")
    rows = []
    for name, fmt, product in cases:
        nbytes = input_bytes(a.shape, b.shape, fmt)
        errors = row_errors(product(), exact)
        rows.append(
            {
                "format": name,
                "bytes": nbytes,
                "saved_vs_bf16": 1 - nbytes / bf16_bytes,
                "rel_error": errors.median().item(),
                "worst_rel_error": errors.max().item(),
            }
        )
    return rows


def format_errors(rows: list[dict]) -> str:
    """``matmul_errors`` rows as a table (bytes also as a multiple of bf16's)."""
    head = f"{'inputs':<28}{'bytes':>9}{'x bf16':>8}{'error: typical row':>20}{'worst row':>11}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['format']:<28}{r['bytes']:>9,}{1 - r['saved_vs_bf16']:>8.2f}"
            f"{r['rel_error']:>20.2e}{r['worst_rel_error']:>11.2e}"
        )
    return "\n".join(lines)


def calculator_rows(model: str = "llama3-8b", **run) -> list[dict]:
    """The memory calculator (``labs.theory``) for ``model`` in fp32, bf16-mixed and bf16-mixed
    with FP8 linear layers, under the same ``run`` keywords (seq, mbs, zero, dp, ...)."""
    configs = {
        "fp32": {"precision": "fp32"},
        "bf16-mixed": {"precision": "bf16-mixed"},
        "bf16-mixed + fp8": {"precision": "bf16-mixed", "fp8": True},
    }
    return compare(preset(model), configs, **run)


def calculator_table(
    model: str = "llama3-8b", *, gpu_mem_gib: float = GPUS["H100 80GB"].memory_gib, **run
) -> str:
    """``calculator_rows`` as the calculator's table on an H100's 79.6 GiB (``gpu_mem_gib``), and
    what FP8 saves over bf16-mixed."""
    rows = calculator_rows(model, **run)
    bf16, fp8 = rows[1], rows[2]
    saved = bf16["total_bytes"] - fp8["total_bytes"]
    return "\n".join(
        [
            format_rows(rows, gpu_mem_gib=gpu_mem_gib, label=model),
            f"FP8 linear layers save {saved / GIB:.2f} GiB per rank, all of it activations:"
            f" {saved / bf16['activation_bytes']:.0%} of them, {saved / bf16['total_bytes']:.0%}"
            " of the total",
        ]
    )


def plot_errors(cases: dict[str, list[dict]], ax: Axes | None = None) -> Axes:
    """A typical row's relative error per input format (log scale), one group of bars per case
    of ``matmul_errors`` (e.g. {"N(0, 1)": ..., "gradient-sized": ..., "one outlier": ...})."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    formats = [r["format"] for r in next(iter(cases.values()))]
    width = 0.8 / len(cases)
    for i, (case, rows) in enumerate(cases.items()):
        xs = [j + (i - (len(cases) - 1) / 2) * width for j in range(len(formats))]
        ax.bar(xs, [r["rel_error"] for r in rows], width=width, label=case)
    ax.set_xticks(range(len(formats)), [f.replace(", ", "\n") for f in formats], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("relative error (typical row)")
    ax.set_title("one matmul, inputs in each format, against float64")
    ax.legend(fontsize=8)
    return ax
