# Your exercise module, generated from solutions/multimodal.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 11 (notebooks/11_multimodal.ipynb): a vision encoder and the course decoder, trained in
parallel three ways.

The model (``labs.models.vision``): images [B, 3, S, S] -> encoder (ViT: P patches, width E) ->
projector -> prefix [B, P, H]; the caption's embedding follows it, and the course decoder reads L =
P + C tokens of width H. The parts differ in size and shape, so each plan below treats them
differently; every plan reuses an earlier lab through ``exercise(...)`` and must reproduce the
single-process run (``labs.models.vision.train_reference``).

(a) Pipeline, ``--mode pp`` (the encoder as its own stage; Megatron-LM's
``--encoder-pipeline-model-parallel-size``). Stage 0 is an ``EncoderStage``: encoder, projector and
the *fusion* (embed the caption, concatenate after the prefix), plus ``split[0]`` decoder layers;
stage s > 0 holds ``split[s]`` decoder layers (notebook 05's ``StageModule``); the last stage also
norm, head and loss. Trained with notebook 05's 1F1B unchanged:

    forward   stage s -> s+1   each micro-batch's fused activation   [B/M, L, H]   send / recv
    backward  stage s+1 -> s   its gradient                          [B/M, L, H]   send / recv

Bytes per rank per step: B·L·H·itemsize per direction it feeds
(``labs.theory.pipeline.p2p_bytes_per_rank`` with seq_len = L). The image never leaves stage 0: its
P·E features become P of the L tokens there. Stage 0's work (encoder on P patches + split[0] layers)
rarely equals a decoder stage's: the slowest stage sets the pace and the others wait
(``labs.theory.multimodal``); moving decoder layers onto it rebalances.

(b) Data parallel, ``--mode dp``: the whole model on every rank, the batch split (notebook 02's
``BucketedDDP``):

    backward  all-reduce of every gradient, the encoder's included
              2(N-1)/N · 4(Ψ_enc + Ψ_proj + Ψ_dec) bytes per rank

or ZeRO-``zero`` (notebook 03's ``ShardedOptimizer`` or ``fully_shard`` over ``model_units``:
encoder | projector | embedding | each decoder block | norm + head): reduce-scatter + all-gather of
the same volume (ZeRO-3: a second all-gather, 3(N-1)/N · 4Ψ padded).

(c) Tensor parallel, ``--mode tp``: the decoder cut by notebook 04's ``apply_tensor_parallel``; the
encoder and projector *replicated*: each rank runs them on the whole batch. They need no
communication at all: the gradient that reaches the prefix is already complete and equal on every
rank (f's all-reduce in each block's backward), so the replicas take identical steps. The decoder's
traffic is notebook 04's with T = L, except the embedding's all-reduce (caption tokens only, B·C·H)
and the loss's (B·C and 2·B·C fp32 numbers: only caption positions have targets)
(``labs.theory.multimodal.tp_collectives``).

References: Liu et al. 2023, "Visual Instruction Tuning" (LLaVA) and "Improved Baselines"
(LLaVA-1.5); Zhai et al. 2023, SigLIP; NVIDIA Megatron-LM ``examples/multimodal`` (encoder pipeline
and tensor parallel sizes); Zhang et al. 2024, "DistTrain: Addressing Model and Data Heterogeneity
with Disaggregated Training for Multimodal LLMs" (the encoder-stage imbalance).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from labs.data.shapes import IGNORE
from labs.models.vision import MultimodalModel, decode, fuse, run_blocks
from labs.runtime.flat import course_units
from labs.runtime.impl import exercise
from labs.runtime.pipe import Pipe
from labs.theory.dims import check_divides
from labs.theory.multimodal import check_split
from labs.train import TrainConfig, make_optimizer

NOTEBOOK = "11_multimodal.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
PARTS = {"core": 35, "tensor-parallel": 15, "pipeline": 25}

ZERO_STAGES = (0, 1, 2, 3)


# --- (a) pipeline: the encoder as stage 0 ---
class EncoderStage(nn.Module):
    """Stage 0: ``encoder``, ``projector``, the decoder's ``tok_emb`` (the fusion) and decoder
    ``layers`` ``layer_ids`` (the model's own modules, named ``layers.<i>`` as in the decoder).
    Called by notebook 05's schedule like any first stage, with the micro-batch's tokens [b, L]; the
    images come through :meth:`load` (the first stage reads its own data, as Megatron's does), one
    micro-batch per call."""

    first = True
    last = False

    def __init__(self, model: MultimodalModel, layer_ids: Sequence[int]):
        super().__init__()
        # the schedule reads cfg.n_embd: the activation it sends is [b, L, H]
        self.cfg = model.decoder.cfg
        self.encoder = model.encoder
        self.projector = model.projector
        self.tok_emb = model.decoder.tok_emb
        self.layers = nn.ModuleDict({str(i): model.decoder.layers[i] for i in layer_ids})
        self.inbox: deque = deque()

    def load(self, images: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor]) -> None:
        """Queue a step's micro-batches: images [[b, 3, S, S], ...] with their tokens [[b, L],
        ...]."""
        self.inbox.extend(zip(images, tokens))

    def next_images(self, tokens: torch.Tensor) -> torch.Tensor:
        """The queued images of the micro-batch whose tokens are ``tokens`` (the schedule runs them
        in order)."""
        if not self.inbox:
            raise RuntimeError(
                "EncoderStage has no images queued: call stage.load(images, tokens) before the step"
            )
        images, expected = self.inbox.popleft()
        if not torch.equal(expected, tokens):
            raise RuntimeError(
                "EncoderStage got micro-batches in another order than load() queued them"
            )
        return images

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, L] (P placeholders, then the caption) -> the fused sequence after this stage's
        decoder layers [b, L, H]: encoder on the micro-batch's images -> projector -> ``fuse`` ->
        ``run_blocks``.

        Part: pipeline (an extension).
        """
        images = self.next_images(tokens)  # [b, 3, S, S]
        raise NotImplementedError(
            "exercise EncoderStage.forward is not written yet: "
            "see its docstring and notebooks/11_multimodal.ipynb"
        )


def build_multimodal_stage(
    model: MultimodalModel, *, split: Sequence[int], stage: int
) -> nn.Module:
    """Stage ``stage`` of ``split`` (decoder layers per stage, e.g. ``(0, 2, 1, 1)``): for stage 0
    an :class:`EncoderStage` with decoder layers 0..split[0]-1; for s > 0 notebook 05's
    ``StageModule`` over the decoder with the next split[s] layers, ``first=False`` (stage 0
    embedded the caption) and ``last`` on the last stage (norm, head).

    Part: pipeline (an extension).
    """
    split = check_split(split, n_layers=model.cfg.decoder.n_layer)
    if not 0 <= stage < len(split):
        raise ValueError(f"stage={stage} must be in 0..{len(split) - 1}")
    raise NotImplementedError(
        "exercise build_multimodal_stage is not written yet: "
        "see its docstring and notebooks/11_multimodal.ipynb"
    )


def train_step_pp(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    pipe: Pipe,
    microbatches: int,
) -> float | None:
    """One optimizer step of the pipeline on this rank's ``stage``. ``batch``: the global batch
    (images [B, 3, S, S], tokens [B, L], targets [B, L]), which every rank loads. Cut it into
    ``microbatches`` micro-batches along B; the first stage queues the images (``stage.load``); run
    notebook 05's ``train_step_1f1b`` on [(tokens_i, targets_i), ...]; step the optimizer. Returns
    the loss on the last stage (the batch mean), None elsewhere.

    Part: pipeline (an extension).
    """
    images, tokens, targets = batch
    check_divides(tokens.shape[0], "batch_size", microbatches, "microbatches")
    raise NotImplementedError(
        "exercise train_step_pp is not written yet: "
        "see its docstring and notebooks/11_multimodal.ipynb"
    )


# --- (b) data parallel (DDP or ZeRO) over the whole model ---
def model_units(model: MultimodalModel) -> list[tuple[str, list[nn.Module]]]:
    """ZeRO units in forward order, each made of modules the forward calls (ZeRO-3 gathers a unit in
    its first module's pre-forward hook): the encoder, the projector, the decoder's embedding, each
    decoder block, the final norm with the head."""
    encoder_units = [("encoder", [model.encoder]), ("projector", [model.projector])]
    return encoder_units + course_units(model.decoder)


class DataParallelTrainer:
    """The whole model on every rank of ``group``, each training on its share of the batch.
    ``zero=0``: notebook 02's ``BucketedDDP`` (``bucket_mb``) and ``make_optimizer``; ``zero`` 1
    or 2: notebook 03's ``ShardedOptimizer`` (AdamW, one parameter group per ``model_units``
    unit); 3: notebook 03's ``fully_shard`` on each unit, then on the model, and
    ``make_optimizer``. Attributes: ``model`` (what to call), ``optimizer`` (what steps it)."""

    def __init__(
        self,
        model: MultimodalModel,
        *,
        cfg: TrainConfig,
        zero: int = 0,
        bucket_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
    ):
        """Wrap ``model`` for data parallelism or ZeRO (the class docstring).

        Part: core.
        """
        if zero not in ZERO_STAGES:
            raise ValueError(f"zero={zero!r} is not one of {ZERO_STAGES}")
        self.zero = zero
        raise NotImplementedError(
            "exercise DataParallelTrainer.__init__ is not written yet: "
            "see its docstring and notebooks/11_multimodal.ipynb"
        )

    def step(self, images: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this rank's batch (images [b, 3, S, S], tokens and targets [b, L]):
        zero the gradients, forward, backward, the gradients' synchronisation, the update (the
        gradients stay held until the next step, as the memory calculator counts them). Returns this
        rank's loss (a float).

        Part: core.
        """
        raise NotImplementedError(
            "exercise DataParallelTrainer.step is not written yet: "
            "see its docstring and notebooks/11_multimodal.ipynb"
        )


# --- (c) tensor-parallel decoder, replicated encoder ---
class TensorParallelMultimodal(nn.Module):
    """``model`` with its decoder cut by notebook 04's ``apply_tensor_parallel`` on ``group``
    (default WORLD) and copies of its ``encoder`` and ``projector`` (replicated: same weights, same
    inputs on every rank)."""

    def __init__(self, model: MultimodalModel, *, group: dist.ProcessGroup | None = None):
        """Copy the encoder and projector, cut the decoder (the class docstring).

        Part: tensor-parallel (an extension).
        """
        super().__init__()
        self.cfg = model.cfg
        raise NotImplementedError(
            "exercise TensorParallelMultimodal.__init__ is not written yet: "
            "see its docstring and notebooks/11_multimodal.ipynb"
        )

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """images [B, 3, S, S], tokens [B, L] -> this rank's logits [B, L, V/tp]; with targets [B,
        L] also the caption loss on every rank: notebook 04's ``VocabParallelCrossEntropy`` over the
        positions whose target is not ``IGNORE`` ([N, V/tp] logits, N = B·C), on the decoder's
        group.

        Part: tensor-parallel (an extension).
        """
        raise NotImplementedError(
            "exercise TensorParallelMultimodal.forward is not written yet: "
            "see its docstring and notebooks/11_multimodal.ipynb"
        )
