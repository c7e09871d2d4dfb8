# Your exercise module, generated from solutions/tensor_parallel.py by `python -m labs.stubs`.
# Replace each `raise NotImplementedError(...)` with your code; run the notebook's checks.
"""Exercise 04, part 2 (notebooks/04_tensor_parallel.ipynb): tensor and sequence parallelism,
Megatron style.

Sharded over the N = tp ranks of ``group`` (rank r holds the r-th contiguous block):

    q/k/v_proj, gate/up_proj, lm_head   column-parallel: output features, [out/tp, in];
                                        nh/tp query and nkv/tp kv heads per rank
    o_proj, down_proj                   row-parallel: input features, [out, in/tp]
    tok_emb                             vocab-parallel: rows, [V/tp, H]
    RMSNorm weights                     replicated, [H]

Collectives, all on ``group``: the conjugate operators of ``tensor_parallel_comm`` (part 1 of the
lab; Shoeybi et al. 2019, Megatron-LM §3; Korthikanti et al. 2022, §4.2.2). Each block enters its
attention and its MLP once (f, or SP's all-gather along T) and leaves each through a row-parallel
layer (g, or SP's reduce-scatter along T).

Bytes per rank per step, K = B·T·H·bytes, c = 2(N-1)/N (every collective:
``labs.theory.tensor_parallel``): per block 4·c·K, as 2 all-reduces each way or, with SP, 2
all-gathers + 2 reduce-scatters each way, plus c·H·bytes per norm weight; outside the blocks
tok_emb's g, lm_head's f and the loss's all-reduces of B·T and 2·B·T fp32 numbers.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from labs.models.hf_convert import course_model_from
from labs.models.transformer import Block, ModelConfig, RMSNorm, Transformer
from labs.runtime.tensor_comm import shard_weight
from labs.theory.dims import ParallelDims, check_divides

from .tensor_parallel_comm import (
    GatherFromModelParallelRegion,
    ReduceFromModelParallelRegion,
    enter_parallel_region,
    exit_parallel_region,
)

NOTEBOOK = "04_tensor_parallel.ipynb"


# --- layers, each cut from the full layer of the original model (``shard_weight``) ---
class ColumnParallelLinear(nn.Module):
    """Y = X A, A split by columns (output features; rows of ``nn.Linear.weight``): rank r computes
    X A_r.

        X [B, T, in] --f--> X A_0 | X A_1 | ... | X A_{N-1}
        Y_r [B, T, out/tp]   (gather_output: [B, T, out])

    ``copy_input``: enter the region first (f; with SP the all-gather from [B, T/tp, in]); False
    when the caller entered it once for several linears reading the same input (q, k, v)."""

    def __init__(
        self,
        full: nn.Linear,
        *,
        group: dist.ProcessGroup | None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        copy_input: bool = True,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        self.copy_input = copy_input
        self.weight = shard_weight(full, 0, group)  # [out/tp, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "exercise ColumnParallelLinear.forward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class RowParallelLinear(nn.Module):
    """Y = X A, A split by rows (input features; columns of ``nn.Linear.weight``); the input arrives
    split.

        X_0 | X_1 | ... [B, T, in/tp]
        Y = X_0 A_0 + X_1 A_1 + ...  --g-->  [B, T, out]   (SP: [B, T/tp, out])
    """

    def __init__(
        self,
        full: nn.Linear,
        *,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = shard_weight(full, 1, group)  # [out, in/tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "exercise RowParallelLinear.forward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class VocabParallelEmbedding(nn.Module):
    """The token table split by vocabulary rows: rank r holds ids [r V/tp, (r+1) V/tp). forward(idx
    [B, T]): its rows, zeros for ids held elsewhere, then ``exit_parallel_region`` -> [B, T, H] (SP:
    [B, T/tp, H])."""

    def __init__(
        self,
        full: nn.Embedding,
        *,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = shard_weight(full, 0, group)  # [V/tp, H]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "exercise VocabParallelEmbedding.forward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class VocabParallelCrossEntropy(torch.autograd.Function):
    """fwd: mean cross-entropy of vocab-split logits [N, V/tp] (N = B·T) over the rows whose target
    is not ``ignore_index`` (as ``F.cross_entropy``: -100 by default; nan if every row is ignored),
    from 2 all-reduces (max, N numbers; sum of exp and target logit, 2N), on every rank. bwd:
    (softmax - one_hot) / N_kept on the local slice, 0 on ignored rows. Saves [N, V/tp]. A target
    outside [0, V) that is not ``ignore_index`` raises IndexError, as ``F.cross_entropy`` does."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        vocab = logits.shape[-1] * dist.get_world_size(group)  # V: every rank checks every target
        wrong = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))  # [N]
        if wrong.any():
            raise IndexError(
                f"target {int(targets[wrong][0])} is out of bounds: targets are token ids in"
                f" 0..{vocab - 1} (V={vocab}) or ignore_index={ignore_index}"
            )
        raise NotImplementedError(
            "exercise VocabParallelCrossEntropy.forward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        raise NotImplementedError(
            "exercise VocabParallelCrossEntropy.backward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


def sequence_parallel_norm(
    norm: RMSNorm, *, group: dist.ProcessGroup | None, sequence_parallel: bool = False
) -> RMSNorm:
    """A copy of ``norm``. With SP it sees T/tp tokens, so its weight gradient is partial: hook an
    all-reduce on it."""
    raise NotImplementedError(
        "exercise sequence_parallel_norm is not written yet: "
        "see its docstring and notebooks/04_tensor_parallel.ipynb"
    )


class ParallelBlock(Block):
    """The course's Block on ``full``'s children (cut by ``apply_tensor_parallel``'s plan): norms,
    residual adds (and dropout, if any) on x, [B, T/tp, H] with SP; attention and MLP entered once
    each, outputs back in x's shape."""

    def __init__(
        self, full: Block, *, group: dist.ProcessGroup | None, sequence_parallel: bool = False
    ):
        nn.Module.__init__(self)
        self.attn_norm = full.attn_norm
        self.attn = full.attn
        self.mlp_norm = full.mlp_norm
        self.mlp = full.mlp
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "exercise ParallelBlock.forward is not written yet: "
            "see its docstring and notebooks/04_tensor_parallel.ipynb"
        )


class TensorParallelTransformer(Transformer):
    """The course model, tensor-parallel: the same parameter names, each rank holding its shards;
    ``Transformer.forward`` runs unchanged, the loss is vocab-parallel. Filled by
    ``apply_tensor_parallel``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
    ):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.layers = nn.ModuleList()

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """idx [B, T] -> this rank's logits [B, T, V/tp]; with targets also the mean cross-entropy
        (every rank)."""
        if self.sequence_parallel:
            check_divides(idx.shape[1], "sequence length T", dist.get_world_size(self.group), "tp")
        # [B, T, V/tp]: the vocabulary stays split
        logits = super().forward(idx, positions=positions)
        if targets is None:
            return logits  # the loss never gathers them either: ``VocabParallelCrossEntropy``
        loss = VocabParallelCrossEntropy.apply(
            logits.float().flatten(0, 1), targets.flatten(), self.group
        )
        return logits, loss


def apply_tensor_parallel(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> TensorParallelTransformer:
    """The tensor-parallel version of ``model`` (the course ``Transformer`` or a ``transformers``
    ``LlamaForCausalLM``, left unchanged) on ``group`` (default WORLD), every weight cut from the
    original's. The plan: ``tok_emb`` vocab-parallel; per ``ParallelBlock`` q/k/v, gate/up
    column-parallel (``copy_input=False``), o/down row-parallel, ``sequence_parallel_norm`` norms,
    head counts / tp (rank r: query heads [r nh/tp, (r+1) nh/tp), kv heads [r nkv/tp, ...), which
    SDPA's ``enable_gqa`` pairs right: query head j uses kv head j // (nh/nkv)); ``lm_head``
    column-parallel, output split over V. ValueError (before any collective) unless tp divides nh,
    nkv, H, F, V."""
    group = group if group is not None else dist.group.WORLD
    full = copy.deepcopy(course_model_from(model))  # HF names -> the course's
    tp = dist.get_world_size(group)
    cfg = full.cfg
    ParallelDims(tp=tp).check_model(
        n_head=cfg.n_head,
        n_kv_head=cfg.n_kv_head,
        n_embd=cfg.n_embd,
        ffn_hidden=cfg.ffn_hidden,
        vocab_size=cfg.vocab_size,
    )
    kw = dict(group=group, sequence_parallel=sequence_parallel)
    raise NotImplementedError(
        "exercise apply_tensor_parallel is not written yet: "
        "see its docstring and notebooks/04_tensor_parallel.ipynb"
    )
