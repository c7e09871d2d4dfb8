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
        return check_pp_split(split, n_layers=spec.n_layers, nproc=nproc)
    if mode == "dp":
        train.per_rank_batch(nproc)
        if zero not in zero_theory.STAGES:
            raise ValueError(
                f"zero={zero!r} is not one of {zero_theory.STAGES}; 0 is DDP, 1-3 the ZeRO stages"
            )
    if mode == "tp":
        tp_theory.check(spec, tp=nproc, batch=train.batch_size, seq=cfg.seq_len)
    return None


def check_pp_split(split, *, n_layers: int, nproc: int) -> tuple[int, ...]:
    """``split`` (default: ``theory.default_split``) if the lab can train it on ``nproc`` stages:
    the theory's rules (``theory.check_split``), and a decoder layer on every stage between the
    first (the encoder's) and the last (norm and head), or that stage has nothing to train. Raises
    ValueError naming the valid ``nproc`` or a valid split."""
    most = n_layers + 2  # the encoder's stage, one stage per layer, the head's stage
    if nproc > most:
        raise ValueError(
            f"mode='pp' with nproc={nproc}: the {n_layers}-layer decoder fills at most {most}"
            f" stages (stage 0 holds the encoder, the last stage the norm and head, and every stage"
            f" between them needs a layer); use nproc in 2..{most}"
        )
    split = split if split is not None else theory.default_split(n_layers, nproc)
    split = theory.check_split(split, n_layers=n_layers, stages=nproc)
    empty = [s for s in range(1, nproc - 1) if split[s] == 0]
    if empty:
        raise ValueError(
            f"split={split}: stage {empty[0]} holds no decoder layer, so it has nothing to train;"
            f" only stage 0 (the encoder's) and the last stage (norm and head) may hold 0, every"
            f" stage between them at least 1, e.g. {theory.default_split(n_layers, nproc)}"
        )
    return split


def reference_run(cfg: MultimodalConfig, train: TrainConfig, dp: int = 1) -> ReferenceResult:
    """The single-process run on the same global batches (on ``dp`` ranks' shares), with step 1's
    gradients (``labs.train.train_multimodal_reference``)."""
    return train_multimodal_reference(cfg, train, dp=dp, return_grads=True)
