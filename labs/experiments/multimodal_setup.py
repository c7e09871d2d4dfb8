"""Experiment 11's setup: the model sizes, their description for the theory, the checks of a
run's options and the single-process reference, shared by ``labs.experiments.multimodal`` (the
checks) and ``labs.experiments.multimodal_timeline`` (the clock).
"""

from __future__ import annotations

from typing import NamedTuple

from labs.experiments.common import course_spec
from labs.models.transformer import ModelConfig
from labs.models.vision import MultimodalConfig, VisionConfig
from labs.theory import multimodal as theory
from labs.theory import tensor_parallel as tp_theory
from labs.theory import zero as zero_theory
from labs.theory.dims import check_divides, check_positive
from labs.theory.memory import ModelSpec
from labs.train import ReferenceResult, TrainConfig, train_multimodal_reference

MODES = ("pp", "dp", "tp")
SIZES = {
    # the tests' and the labs' model: 16 patches of width 64, a 4-layer decoder of 64
    "tiny": MultimodalConfig(),
    "timing": MultimodalConfig(
        vision=VisionConfig(n_embd=128, mlp_hidden=256),
        decoder=ModelConfig(n_layer=4, n_embd=128, n_head=8, n_kv_head=4, ffn_hidden=384),
    ),
}


class Specs(NamedTuple):
    """The theory's description of the multimodal model: its decoder and its encoder."""

    decoder: ModelSpec
    encoder: theory.EncoderSpec


def specs(cfg: MultimodalConfig) -> Specs:
    """The theory's description of the decoder and of the encoder."""
    d = cfg.decoder
    v = cfg.vision
    return Specs(
        decoder=course_spec(d),
        encoder=theory.EncoderSpec(
            tokens=v.n_patches,
            hidden=v.n_embd,
            n_layers=v.n_layer,
            n_heads=v.n_head,
            ffn_hidden=v.mlp_hidden,
            patch_dim=v.patch_dim,
        ),
    )


def check_args(
    cfg: MultimodalConfig,
    *,
    nproc: int,
    mode: str,
    split,
    microbatches: int,
    zero: int,
    train: TrainConfig,
) -> tuple | None:
    """Every ValueError ``run`` can raise, before any process starts. Returns the split (pp) or
    None."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    check_positive(nproc=nproc)
    spec = specs(cfg).decoder
    if mode == "pp":
        if nproc < 2:
            raise ValueError(
                f"mode='pp' needs nproc >= 2 (the encoder's stage and a decoder stage), got {nproc}"
            )
        check_divides(train.batch_size, "batch_size", microbatches, "microbatches")
        split = split if split is not None else theory.default_split(spec.n_layers, nproc)
        return theory.check_split(split, n_layers=spec.n_layers, stages=nproc)
    if mode == "dp":
        train.per_rank_batch(nproc)
        if zero not in zero_theory.STAGES:
            raise ValueError(
                f"zero={zero!r} is not one of {zero_theory.STAGES}; 0 is DDP, 1-3 the ZeRO stages"
            )
    if mode == "tp":
        tp_theory.check(spec, tp=nproc, batch=train.batch_size, seq=cfg.seq_len)
    return None


def reference_run(cfg: MultimodalConfig, train: TrainConfig, dp: int = 1) -> ReferenceResult:
    """The single-process run on the same global batches (on ``dp`` ranks' shares), with step 1's
    gradients (``labs.train.train_multimodal_reference``)."""
    return train_multimodal_reference(cfg, train, dp=dp, return_grads=True)
