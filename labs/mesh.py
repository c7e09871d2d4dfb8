# Your exercise module, generated from solutions/mesh.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 08 (notebooks/08_composing_4d.ipynb): the DP x PP x CP x TP device mesh, and one
training step of the course model that composes the earlier labs on it.

Rank order (``labs.theory.dims.ParallelDims``): ranks fill a (dp, pp, cp, tp) grid, tp innermost, so
rank = ((d·PP + p)·CP + c)·TP + t. A TP group is TP consecutive ranks, which on a machine with K
GPUs per node (TP <= K, K % TP == 0) is one node: TP's per-layer collectives stay on the fast link.
The groups, each built with ``dist.new_group`` on every rank in the same order:

    tp     ranks that differ only in t     tensor (+ sequence) parallelism   (lab 04)
    cp     ... only in c                    ring attention                    (lab 06)
    pp     ... only in p                    pipeline stages, 1F1B             (lab 05)
    dp     ... only in d                    (drawn; gradients use dp_cp)
    dp_cp  ... only in d and c: the ranks that hold the same weights. Each computes the gradient of
           the mean loss over its own tokens; the average over dp·cp ranks is the gradient of the
           global mean (equal token counts), so ZeRO (lab 03) shards and averages over dp_cp, as
           Megatron's distributed optimizer and torchtitan's FSDP over ``dp_shard_cp`` do.

The step, per rank: take this DP rank's rows of the global batch [B/dp, T]; CP keeps its zig-zag
T/cp tokens and their positions; TP ranks share them (SP splits T/cp by tp inside the blocks when
there is no PP); PP splits the rows into M micro-batches and runs 1F1B; then ZeRO averages the
gradients over dp_cp and steps. Bytes per rank per step (``labs.theory.planner.comm_per_step`` is
the layer-level formula, each lab's theory module the exact one): tp 4·ℓ·M·2(tp-1)/tp·K_a (+
embedding, head and loss collectives); cp 3·ℓ·M·(cp-1)/cp·KV; pp M·K_a per direction a stage feeds;
dp_cp ZeRO-1 2(N-1)/N·Ψ_r·4, ZeRO-3 3(N-1)/N·Ψ_r·4 (N = dp·cp), K_a = (B/dp/M)·(T/cp)·H·4 bytes.

What the earlier labs' APIs allow (and what they do not): TP and CP take their group; CP's attention
replaces TP's in place, so TP x CP composes as is. PP's ``StageModule`` builds rotary tables from
``arange(x.shape[1])`` and its ``forward_step`` applies ``F.cross_entropy`` to whole logits: with PP
we keep TP's activations whole (no SP) and gather the head's logits (Megatron's
``parallel_output=False``); PP with CP (a stage needs its tokens' zig-zag positions) is refused.
ZeRO-2/3 reduce gradients inside backward, once per step: with PP's micro-batches only ZeRO-1.

References: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC 2021), §3 (PTD-P, rank order); Dubey et al., "The Llama 3 Herd of Models" (2024),
§3.3 (4D parallelism, TP x CP x PP x DP); picotron's ``process_group_manager.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labs.models.transformer import ModelConfig, build_model
from labs.runtime.device import rank_device
from labs.runtime.flat import course_units
from labs.runtime.impl import exercise
from labs.runtime.pipe import Pipe, pipe_group
from labs.theory.dims import AXES, ParallelDims, check_divides, divisors
from labs.train import TrainConfig, make_optimizer

NOTEBOOK = "08_composing_4d.ipynb"
# The lab has one part, its core, and the minutes it takes at the notebook's pace
# (labs.check.parts); each function's docstring names its part.
PARTS = {"core": 90}

GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}


def check_mesh(
    *, world_size: int, gpus_per_node: int | None = None, **degrees: int
) -> ParallelDims:
    """The validated degrees: ValueError (before any group exists) when their product is not
    ``world_size`` or when a TP group cannot sit inside one node of ``gpus_per_node`` GPUs."""
    unknown = sorted(set(degrees) - set(AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown}; the axes are {AXES}")
    dims = ParallelDims(**degrees, world_size=world_size)
    if gpus_per_node is not None and (dims.tp > gpus_per_node or gpus_per_node % dims.tp):
        choices = ",".join(str(tp) for tp in divisors(gpus_per_node))
        raise ValueError(
            f"tp={dims.tp} cannot be placed on nodes of gpus_per_node={gpus_per_node}: a TP group "
            f"must sit inside one node; use tp in {{{choices}}}"
        )
    return dims


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh: its coordinates, and for each group name in ``GROUPS`` the
    global ranks of its group (``ranks``) and the process group (``groups``; None for size 1)."""

    dims: ParallelDims
    rank: int
    coords: dict[str, int] = field(default_factory=dict)  # axis -> this rank's coordinate
    ranks: dict[str, list[int]] = field(default_factory=dict)  # group name -> its global ranks
    # group name -> its process group (None for a group of one rank)
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)

    def size(self, name: str) -> int:
        return len(self.ranks[name])


def group_ranks(dims: ParallelDims, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of ranks that differ only in the coordinates ``axes`` (e.g. ("tp",) or ("dp",
    "cp")), each listed in increasing rank, the groups ordered by their first rank. Use
    ``dims.coords(rank)``: two ranks share a group when all their other coordinates agree.

    Part: core.
    """
    raise NotImplementedError(
        "exercise group_ranks is not written yet: "
        "see its docstring and notebooks/08_composing_4d.ipynb"
    )


def build_mesh(dims: ParallelDims) -> Mesh:
    """Create every group of ``GROUPS`` on the default (WORLD) group and keep this rank's.

    ``dist.new_group(ranks)`` is collective over the whole world: every rank must call it for every
    group, its own or not, in the same order (here: ``GROUPS`` order, then ``group_ranks`` order).
    Groups of one rank are not created (``groups[name] = None``); ``ranks[name]`` is always set.

    Part: core.
    """
    rank = dist.get_rank()
    if dims.world_size != dist.get_world_size():
        raise ValueError(
            f"the mesh has {dims.world_size} ranks but the job has {dist.get_world_size()}"
        )
    ranks = {}
    groups = {}
    raise NotImplementedError(
        "exercise build_mesh is not written yet: "
        "see its docstring and notebooks/08_composing_4d.ipynb"
    )
    return Mesh(dims, rank, dims.coords(rank), ranks, groups)


@dataclass
class Composed:
    """What one rank trains: ``module`` (the model, or its pipeline stage), ``optimizer`` (lab 03's
    ``ShardedOptimizer``, or AdamW on the module, sharded or not), ``pipe`` (the PP lab's ``Pipe``
    or None) and the ``mesh`` and settings it was built for."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer  # lab 03's ShardedOptimizer, or AdamW
    pipe: Pipe | None
    mesh: Mesh
    microbatches: int
    zero: int


def check_composition(
    mesh: Mesh, model_cfg: ModelConfig, cfg: TrainConfig, *, zero: int, microbatches: int
) -> None:
    """ValueError for what the composed step cannot do, naming the fix (called before building)."""
    d = mesh.dims
    d.check_model(
        n_head=model_cfg.n_head,
        n_kv_head=model_cfg.n_kv_head,
        n_embd=model_cfg.n_embd,
        vocab_size=model_cfg.vocab_size,
        ffn_hidden=model_cfg.ffn_hidden,
        n_layer=model_cfg.n_layer,
        seq_len=cfg.seq_len,
        cp_chunks_per_rank=2,
    )
    # equal stages: plan [n_layer // pp] * pp
    check_divides(model_cfg.n_layer, "n_layer", d.pp, "pp")
    if d.pp > 1 and d.cp > 1:
        raise ValueError(
            f"pp={d.pp} with cp={d.cp}: the pipeline lab's StageModule builds rotary positions "
            f"from arange(T), not the zig-zag positions of a CP rank; use pp=1 or cp=1"
        )
    if zero not in (1, 2, 3) or (d.pp > 1 and zero != 1):
        raise ValueError(
            f"zero={zero} with pp={d.pp}: use zero in {{1,2,3}} (only 1 with pp > 1: ZeRO-2/3 "
            f"reduce gradients inside backward, once, not after all micro-batches)"
        )
    b = cfg.per_rank_batch(d.dp)
    if b % microbatches or microbatches < d.pp:
        choices = [m for m in divisors(b) if m >= d.pp]
        raise ValueError(
            f"microbatches={microbatches} must divide the {b} sequences of a DP rank and be >= "
            f"pp={d.pp}; use one of {choices}"
        )
    if d.tp > 1 and d.pp == 1 and (cfg.seq_len // d.cp) % d.tp:
        raise ValueError(
            f"seq_len/cp={cfg.seq_len // d.cp} tokens must split over tp={d.tp} "
            f"(sequence parallelism)"
        )


def compose(
    model_cfg: ModelConfig,
    mesh: Mesh,
    cfg: TrainConfig,
    *,
    zero: int = 1,
    microbatches: int | None = None,
) -> Composed:
    """The course model (``build_model(model_cfg, seed=cfg.seed)`` on this rank's device: the
    reference's weights) made parallel along every axis of ``mesh`` of degree > 1, with the labs,
    through ``exercise(...)``, in this order:

    1. TP: ``apply_tensor_parallel(model, group=tp, sequence_parallel=pp == 1)``; with PP, the head
       becomes ``ColumnParallelLinear(model.lm_head, group=tp, gather_output=True)`` (whole logits).
    2. CP: ``apply_context_parallel(model, cp)`` (zig-zag).
    3. PP: ``build_stage(model, plan=[n_layer // pp] * pp, stage=p)``, and ``pipe_group(pp)`` of
       ``labs.runtime.pipe``.
    4. DP, when dp·cp > 1, over ``course_units(module)`` on group dp_cp: ZeRO-1/2 a
       ``ShardedOptimizer`` (AdamW, ``cfg``'s settings, one parameter group per unit), ZeRO-3
       ``fully_shard`` on each unit and then on ``module``; otherwise (and for ZeRO-3)
       ``make_optimizer(module.parameters(), cfg)``.
    ``microbatches`` defaults to 2·pp (1 without PP).

    Part: core.
    """
    d = mesh.dims
    microbatches = microbatches or (2 * d.pp if d.pp > 1 else 1)
    check_composition(mesh, model_cfg, cfg, zero=zero, microbatches=microbatches)
    g = mesh.groups
    model = build_model(model_cfg, seed=cfg.seed, device=rank_device())  # the GPU under NCCL
    raise NotImplementedError(
        "exercise compose is not written yet: see its docstring and notebooks/08_composing_4d.ipynb"
    )
    return Composed(module, optimizer, pipe, mesh, microbatches, zero)


def train_step(c: Composed, x: torch.Tensor, y: torch.Tensor) -> float | None:
    """One optimizer step on the global batch ``x``, ``y`` [B, T] (laid out as
    ``labs.train.data_for(cfg, dp)`` gives it: DP rank d's sequences are rows [d·B/dp, (d+1)·B/dp)).
    Returns this rank's loss, the mean cross-entropy over its tokens (the last stage's, summed over
    micro-batches / M, with PP), or None on other stages; the global loss is the mean over the dp·cp
    ranks of the last stage.

    Rows: ``x.chunk(dp)[d]``; CP: ``shard_inputs(rows_x, rows_y, cp)`` -> tokens, targets,
    positions; no PP: ``_, loss = module(tokens, targets, positions)``, ``loss.backward()``; PP: M
    micro-batches (``chunk(M)`` of the rows) through ``train_step_1f1b(stage, microbatches,
    pipe=pipe)``. Then ``optimizer.step()`` and ``optimizer.zero_grad()``.

    Part: core.
    """
    mesh = c.mesh
    d = c.mesh.dims
    x = x.to(rank_device())
    y = y.to(rank_device())
    raise NotImplementedError(
        "exercise train_step is not written yet: "
        "see its docstring and notebooks/08_composing_4d.ipynb"
    )
