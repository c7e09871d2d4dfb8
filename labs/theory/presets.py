"""Model presets and GPUs for the calculators (notebook 01 and the planner). Pure Python.

Each preset's parameter count equals ``sum(p.numel())`` of the ``transformers`` model built
from the published config on the meta device (tests/test_theory_memory.py builds them).

GPU memory is what ``nvidia-smi`` reports, in GiB (MiB / 1024): the "80 GB" of an H100 is
81559 MiB = 79.6 GiB. Peak FLOP/s are the dense bf16 tensor-core figures of the data sheets
(SXM parts), for MFU. Link bandwidths (GB/s = 10^9 bytes/s, one way, per GPU) are the planner's
defaults for a cluster of that GPU.
"""

from __future__ import annotations

from typing import NamedTuple

from labs.theory.model import ModelSpec, param_count

PRESETS: dict[str, ModelSpec] = {
    # the course model: labs.models.transformer.ModelConfig() with its defaults
    "tiny": ModelSpec(
        vocab_size=256, hidden=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128
    ),
    "gpt2-small": ModelSpec(
        arch="gpt",
        vocab_size=50257,
        hidden=768,
        n_layers=12,
        n_heads=12,
        tied_embeddings=True,
        max_positions=1024,
    ),
    "llama3.2-1b": ModelSpec(
        vocab_size=128256,
        hidden=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        tied_embeddings=True,
    ),
    "llama3-8b": ModelSpec(
        vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336
    ),
    "llama3-70b": ModelSpec(
        vocab_size=128256, hidden=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672
    ),
    "llama3-405b": ModelSpec(
        vocab_size=128256, hidden=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248
    ),
}


class GPU(NamedTuple):
    memory_gib: float  # as nvidia-smi reports it: MiB / 1024
    peak_tflops: float  # dense bf16
    intra_gbps: float  # GB/s one way per GPU to the others of its node (NVLink, or PCIe)
    inter_gbps: float  # GB/s one way per GPU between nodes (one NIC per GPU)


# Links: NVLink as the data sheets give it in both directions, halved (H100/H200 SXM 900 GB/s,
# A100 SXM 600 GB/s); between nodes one NIC per GPU as in NVIDIA's DGX systems (DGX H100: 400 Gb/s
# NDR; DGX A100, and Selene where Narayanan et al. 2021 ran: 200 Gb/s HDR). The RTX 4090 has no
# NVLink: PCIe 4.0 x16 inside a node, and we assume a 100 Gb/s NIC between nodes.
GPUS: dict[str, GPU] = {
    "A100 40GB": GPU(memory_gib=40960 / 1024, peak_tflops=312.0, intra_gbps=300.0, inter_gbps=25.0),
    "A100 80GB": GPU(memory_gib=81920 / 1024, peak_tflops=312.0, intra_gbps=300.0, inter_gbps=25.0),
    "H100 80GB": GPU(memory_gib=81559 / 1024, peak_tflops=989.0, intra_gbps=450.0, inter_gbps=50.0),
    "H200 141GB": GPU(
        memory_gib=143771 / 1024, peak_tflops=989.0, intra_gbps=450.0, inter_gbps=50.0
    ),
    "RTX 4090 24GB": GPU(
        memory_gib=24564 / 1024, peak_tflops=165.2, intra_gbps=32.0, inter_gbps=12.5
    ),
}


def preset(name: str) -> ModelSpec:
    """The preset ``name``, or a ValueError listing the valid names."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not one of {tuple(PRESETS)}")
    return PRESETS[name]


def preset_table() -> str:
    """The presets' dimensions and exact parameter counts, one per line."""
    lines = [
        f"{'preset':<13}{'arch':<6}{'layers':>7}{'hidden':>7}{'heads':>6}{'kv':>4}"
        f"{'ffn':>7}{'vocab':>8}{'tied':>6}{'parameters':>17}"
    ]
    for name, s in PRESETS.items():
        tied = "yes" if s.tied_embeddings else "no"
        lines.append(
            f"{name:<13}{s.arch:<6}{s.n_layers:>7}{s.hidden:>7}{s.n_heads:>6}{s.kv_heads:>4}"
            f"{s.ffn:>7}{s.vocab_size:>8}{tied:>6}{param_count(s):>17,}"
        )
    return "\n".join(lines)
