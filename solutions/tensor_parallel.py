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

``apply_async_communication`` turns a model of ``apply_tensor_parallel`` into its overlapped
variant: each region entrance (q/k/v, gate/up, the head) becomes one
``LinearWithAsyncCommunication``, whose backward all-reduces (SP: reduce-scatters) the input's
gradient while it computes the weight gradients. The same parameters, collectives and bytes; less
communication exposed.
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
from labs.models.transformer import (
    MLP,
    Attention,
    Block,
    ModelConfig,
    RMSNorm,
    apply_rotary,
    run_blocks,
)
from labs.runtime.impl import exercise
from labs.runtime.tensor_comm import shard_weight
from labs.theory.dims import ParallelDims, check_divides

# Part 1's communication operators, from the module the switch selects: your
# labs/tensor_parallel_comm.py, or its reference alone under LABS_REFERENCE=tensor_parallel_comm.
_comm = exercise("tensor_parallel_comm")
GatherFromModelParallelRegion = _comm.GatherFromModelParallelRegion
LinearWithAsyncCommunication = _comm.LinearWithAsyncCommunication
ReduceFromModelParallelRegion = _comm.ReduceFromModelParallelRegion
enter_parallel_region = _comm.enter_parallel_region
exit_parallel_region = _comm.exit_parallel_region

NOTEBOOK = "04_tensor_parallel.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
# The "async" part asks for no code here: its function is LinearWithAsyncCommunication.backward,
# in labs/tensor_parallel_comm.py; its tests run the model of apply_async_communication.
PARTS = {"core": 60, "vocab-parallel": 25, "sequence-parallel": 15, "async": 20}


# --- layers: plain modules, each cut from the full layer of the original (``shard_weight``) ---
class ColumnParallelLinear(nn.Module):
    """Y = X A, the weight A [in, out] split by columns (output features; rows of
    ``nn.Linear.weight``): rank r holds A_r [in, out/tp] (``weight`` [out/tp, in], cut from
    ``full``'s) and computes its own columns of Y from the whole X.

        A = [ A_0 | A_1 | ... | A_{N-1} ]            X [B, T, in], the same on every rank

        Y = X A = [ X A_0 | X A_1 | ... | X A_{N-1} ]
                    rank 0  rank 1        rank N-1   Y_r = X A_r [B, T, out/tp]

    Forward: nothing joins the Y_r (the row-parallel layer after it reads them split);
    ``gather_output`` all-gathers them along the last dim, [B, T, out]. Backward: every rank's
    X A_r used all of X, so X's gradient is the sum of the ranks' terms: f (entering the region)
    all-reduces it. With SP, X arrives [B, T/tp, in] and f is an all-gather along T (backward:
    reduce-scatter). ``copy_input``: enter the region here; False when the caller entered it once
    for several linears reading the same input (q, k, v)."""

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
        """x [B, T, in] (SP: [B, T/tp, in]) -> [B, T, out/tp] ([B, T, out] gathered).

        Part: core.
        """
        ### BEGIN SOLUTION
        if self.copy_input:
            x = enter_parallel_region(x, self.group, self.sequence_parallel)  # [B, T, in]
        y = F.linear(x, self.weight)  # [B, T, out/tp]
        if self.gather_output:
            return GatherFromModelParallelRegion.apply(y, self.group)  # [B, T, out]
        return y
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """Y = X A, the weight A [in, out] split by rows (input features; columns of
    ``nn.Linear.weight``): rank r holds A_r [in/tp, out] (``weight`` [out, in/tp], cut from
    ``full``'s). X arrives split by columns, as a column-parallel layer leaves it.

            | A_0     |
        A = | A_1     |        X = [ X_0 | X_1 | ... | X_{N-1} ]      X_r [B, T, in/tp]
            | ...     |
            | A_{N-1} |

        Y = X A = X_0 A_0 + X_1 A_1 + ... + X_{N-1} A_{N-1}
                  rank 0    rank 1          rank N-1                  X_r A_r [B, T, out]

    Forward: rank r computes its term X_r A_r; g (leaving the region) all-reduces the terms into
    Y, [B, T, out] on every rank (SP: reduce-scatter along T, [B, T/tp, out]). Backward: each term
    receives Y's whole gradient, g's identity (SP: all-gather along T)."""

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
        """x [B, T, in/tp] -> [B, T, out] (SP: [B, T/tp, out]), summed over the ranks.

        Part: core.
        """
        ### BEGIN SOLUTION
        y = F.linear(x, self.weight)  # [B, T, out]: this rank's term of the sum
        return exit_parallel_region(y, self.group, self.sequence_parallel)
        ### END SOLUTION


class VocabParallelEmbedding(nn.Module):
    """The token table E [V, H] split by rows (vocabulary): rank r holds E_r, the rows of ids
    [r V/tp, (r+1) V/tp) (``weight`` [V/tp, H], cut from ``full``'s).

            | E_0     |   ids [0, V/tp)
        E = | E_1     |   ids [V/tp, 2 V/tp)
            | ...     |
            | E_{N-1} |

        x = lookup_0(idx) + lookup_1(idx) + ... + lookup_{N-1}(idx)     [B, T, H]

    forward(idx [B, T]): rank r's lookup_r gives E_r's row for each id it holds and zeros for the
    others; ``exit_parallel_region`` (g: all-reduce; SP: reduce-scatter along T) sums the ranks'
    lookups -> [B, T, H] (SP: [B, T/tp, H]). Every id is held by exactly one rank."""

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
        """idx [B, T] -> [B, T, H] (SP: [B, T/tp, H]), summed over the ranks.

        Part: vocab-parallel (an extension).
        """
        ### BEGIN SOLUTION
        per_rank = self.weight.shape[0]
        start = dist.get_rank(self.group) * per_rank
        # [B, T]: ids another rank holds
        elsewhere = (idx < start) | (idx >= start + per_rank)
        x = F.embedding((idx - start).masked_fill(elsewhere, 0), self.weight)  # [B, T, H]
        x = x.masked_fill(elsewhere[..., None], 0.0)
        return exit_parallel_region(x, self.group, self.sequence_parallel)
        ### END SOLUTION


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
        """logits [N, V/tp], targets [N] -> the mean loss (the class docstring).

        Part: vocab-parallel (an extension).
        """
        vocab = logits.shape[-1] * dist.get_world_size(group)  # V: every rank checks every target
        wrong = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))  # [N]
        if wrong.any():
            raise IndexError(
                f"target {int(targets[wrong][0])} is out of bounds: targets are token ids in"
                f" 0..{vocab - 1} (V={vocab}) or ignore_index={ignore_index}"
            )
        ### BEGIN SOLUTION
        per_rank = logits.shape[-1]
        start = dist.get_rank(group) * per_rank
        kept = targets != ignore_index  # [N]: rows that count
        logits_max = logits.max(dim=-1).values  # [N]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max[:, None]  # [N, V/tp]; softmax does not change under a shift
        # [N]: no target logit here (the target is on another rank, or the row is ignored)
        elsewhere = (targets < start) | (targets >= start + per_rank) | ~kept
        local = (targets - start).masked_fill(elsewhere, 0)
        exp = shifted.exp()
        target_logit = shifted.gather(1, local[:, None]).squeeze(1)  # [N]
        target_logit = target_logit.masked_fill(elsewhere, 0.0)
        # [2, N]: both summed over ranks in one all-reduce
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(sums, group=group)
        # softmax [N, V/tp], 0 on ignored rows: they get no gradient
        softmax = (exp / sums[0][:, None]).masked_fill(~kept[:, None], 0.0)
        ctx.save_for_backward(softmax, local, elsewhere)
        ctx.kept = int(kept.sum())
        return (sums[0].log() - sums[1])[kept].mean()  # over the kept rows
        ### END SOLUTION

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        """(softmax - one_hot) / N_kept on this rank's slice: [N, V/tp].

        Part: vocab-parallel (an extension).
        """
        ### BEGIN SOLUTION
        softmax, local, elsewhere = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(len(local), device=local.device)
        grad_logits[rows, local] -= (~elsewhere).to(softmax.dtype)  # - one_hot
        # every row ignored: zeros, as F.cross_entropy gives (its loss is nan)
        return grad_logits * (grad / max(ctx.kept, 1)), None, None, None
        ### END SOLUTION


def sequence_parallel_norm(
    norm: RMSNorm, *, group: dist.ProcessGroup | None, sequence_parallel: bool = False
) -> RMSNorm:
    """A copy of ``norm``. With SP it sees T/tp tokens, so its weight gradient is partial: hook an
    all-reduce on it (``register_hook`` on the copy's weight).

    Part: sequence-parallel (an extension).
    """
    out = copy.deepcopy(norm)
    if sequence_parallel:
        ### BEGIN SOLUTION
        out.weight.register_hook(lambda grad: ReduceFromModelParallelRegion.apply(grad, group))
        ### END SOLUTION
    return out


class ParallelBlock(nn.Module):
    """The course's pre-norm residual block over ``full``'s children, whose linears
    ``apply_tensor_parallel``'s plan then cuts: each rank holds nh/tp query and nkv/tp key/value
    heads and F/tp columns of the MLP.

        x -> attn_norm -> f -> q, k, v (nh/tp, nkv/tp heads) -> attention -> o_proj -> g -> + x
          -> mlp_norm  -> f -> gate, up (F/tp columns) -> silu(gate) * up -> down_proj -> g -> + x

    f (``enter_parallel_region``; SP: all-gather along T) enters each region once, for the three
    (two) linears reading its output; g leaves it inside the row-parallel o_proj and down_proj
    (SP: reduce-scatter along T). Norms and residual adds run on x: [B, T, H], the same on every
    rank (SP: [B, T/tp, H], each rank its share of the tokens)."""

    def __init__(
        self, full: Block, *, group: dist.ProcessGroup | None, sequence_parallel: bool = False
    ):
        super().__init__()
        self.attn_norm = full.attn_norm
        self.attn = full.attn
        self.mlp_norm = full.mlp_norm
        self.mlp = full.mlp
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (SP: [B, T/tp, H]) -> the same shape (the class docstring).

        Part: core.
        """
        ### BEGIN SOLUTION
        h = enter_parallel_region(self.attn_norm(x), self.group, self.sequence_parallel)
        x = x + self.attn(h, cos, sin)
        h = enter_parallel_region(self.mlp_norm(x), self.group, self.sequence_parallel)
        return x + self.mlp(h)
        ### END SOLUTION


class TensorParallelTransformer(nn.Module):
    """The course model, tensor-parallel: the same parameter names, each rank holding its shards
    (``tok_emb`` vocab-parallel, the ``ParallelBlock`` layers, ``norm``, ``lm_head`` column-parallel
    over V); filled by ``apply_tensor_parallel``. The forward is the course model's; the logits stay
    split over V and so does the loss (``VocabParallelCrossEntropy``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
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
        if positions is None:
            # from the ids: under sequence parallelism the embedding returns T/tp tokens
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = run_blocks(self.layers, self.tok_emb(idx), self.cfg, positions)  # [B, T, H] (SP: T/tp)
        logits = self.lm_head(self.norm(x))  # [B, T, V/tp]: the vocabulary stays split
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
    nkv, H, F, V.

    Part: core.
    """
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
    ### BEGIN SOLUTION
    column = partial(ColumnParallelLinear, copy_input=False, **kw)
    row = partial(RowParallelLinear, **kw)
    norm = partial(sequence_parallel_norm, **kw)
    plan = {
        "attn_norm": norm,
        "attn.q_proj": column,
        "attn.k_proj": column,
        "attn.v_proj": column,
        "attn.o_proj": row,
        "mlp_norm": norm,
        "mlp.gate_proj": column,
        "mlp.up_proj": column,
        "mlp.down_proj": row,
    }
    tp_model = TensorParallelTransformer(cfg, **kw)
    tp_model.tok_emb = VocabParallelEmbedding(full.tok_emb, **kw)
    for full_block in full.layers:
        block = ParallelBlock(full_block, **kw)
        for name, make in plan.items():
            block.set_submodule(name, make(block.get_submodule(name)))
        block.attn.n_head = cfg.n_head // tp
        block.attn.n_kv_head = cfg.n_kv_head // tp
        tp_model.layers.append(block)
    tp_model.norm = norm(full.norm)
    tp_model.lm_head = ColumnParallelLinear(full.lm_head, **kw)  # logits [B, T, V/tp]
    if cfg.tie_embeddings:
        tp_model.lm_head.weight = tp_model.tok_emb.weight
    return tp_model
    ### END SOLUTION


# --- the overlapped variant (notebook 04, §11): the same shards, each region entered inside one
# LinearWithAsyncCommunication, whose backward overlaps its collective with the weight gradients --
class AsyncColumnParallelLinear(nn.Module):
    """``column`` (a ``ColumnParallelLinear`` that enters its region, as the head does) through
    ``LinearWithAsyncCommunication``: X [B, T, in] (SP: [B, T/tp, in]) -> [B, T, out/tp]; its
    backward's all-reduce (SP: reduce-scatter) of X's gradient overlaps with the weight-gradient
    matmul. Holds ``column``'s own weight (a tied one stays tied)."""

    def __init__(self, column: ColumnParallelLinear):
        super().__init__()
        if column.gather_output or not column.copy_input:
            raise ValueError(
                "AsyncColumnParallelLinear takes a ColumnParallelLinear with copy_input=True and "
                "gather_output=False (it enters the region and leaves the output split)"
            )
        self.group = column.group
        self.sequence_parallel = column.sequence_parallel
        self.weight = column.weight  # [out/tp, in], the same Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = LinearWithAsyncCommunication.apply(
            x, self.group, self.sequence_parallel, self.weight
        )  # [B, T, out/tp]
        return y


class AsyncParallelAttention(nn.Module):
    """``attention`` (a ``ParallelBlock``'s: q/k/v column-parallel, o row-parallel) entering the TP
    region itself: q, k and v come from one ``LinearWithAsyncCommunication`` on x [B, T, H] (SP:
    [B, T/tp, H]), so the all-reduce (SP: reduce-scatter) of x's gradient overlaps with their three
    weight-gradient matmuls. Returns o_proj's output (after g: [B, T, H]; SP: [B, T/tp, H])."""

    def __init__(
        self, attention: Attention, *, group: dist.ProcessGroup | None, sequence_parallel: bool
    ):
        super().__init__()
        self.n_head = attention.n_head
        self.n_kv_head = attention.n_kv_head
        self.head_dim = attention.head_dim
        self.q_proj = attention.q_proj  # the same shards, under the same names
        self.k_proj = attention.k_proj
        self.v_proj = attention.v_proj
        self.o_proj = attention.o_proj
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        q, k, v = LinearWithAsyncCommunication.apply(
            x, self.group, self.sequence_parallel, *weights
        )
        B, T, _ = q.shape  # T: the whole sequence, also with SP
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, nh/tp, T, hd]
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, nkv/tp, T, hd]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, nkv/tp, T, hd]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # [B, T, H/tp]
        return self.o_proj(y)


class AsyncParallelMLP(nn.Module):
    """``mlp`` (a ``ParallelBlock``'s: gate/up column-parallel, down row-parallel) entering the TP
    region itself: gate and up from one ``LinearWithAsyncCommunication`` on x [B, T, H] (SP:
    [B, T/tp, H]), their weight gradients computed while x's gradient is all-reduced
    (SP: reduce-scattered)."""

    def __init__(self, mlp: MLP, *, group: dist.ProcessGroup | None, sequence_parallel: bool):
        super().__init__()
        self.gate_proj = mlp.gate_proj
        self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.gate_proj.weight, self.up_proj.weight)
        gate, up = LinearWithAsyncCommunication.apply(
            x, self.group, self.sequence_parallel, *weights
        )  # [B, T, F/tp] each
        return self.down_proj(F.silu(gate) * up)  # row-parallel, then g (SP: reduce-scatter)


class AsyncParallelBlock(nn.Module):
    """``block`` (a ``ParallelBlock``) with ``AsyncParallelAttention`` and ``AsyncParallelMLP``:
    they enter the region themselves, so the forward is the course block's (norms and residuals
    on x, [B, T/tp, H] with SP)."""

    def __init__(self, block: ParallelBlock):
        super().__init__()
        kw = dict(group=block.group, sequence_parallel=block.sequence_parallel)
        self.attn_norm = block.attn_norm
        self.attn = AsyncParallelAttention(block.attn, **kw)
        self.mlp_norm = block.mlp_norm
        self.mlp = AsyncParallelMLP(block.mlp, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # [B, T, H] (SP: [B, T/tp, H])
        return x + self.mlp(self.mlp_norm(x))


def apply_async_communication(model: TensorParallelTransformer) -> TensorParallelTransformer:
    """``model`` (from ``apply_tensor_parallel``) with every region entrance overlapped: each block
    an ``AsyncParallelBlock``, the head an ``AsyncColumnParallelLinear``. The same Parameters under
    the same names (nothing is copied), the same collectives and bytes, in the same order; in the
    backward each all-reduce (SP: reduce-scatter) of an entrance's input gradient runs while that
    entrance's weight gradients are computed. Changes ``model`` in place and returns it."""
    for i, block in enumerate(model.layers):
        model.layers[i] = AsyncParallelBlock(block)
    model.lm_head = AsyncColumnParallelLinear(model.lm_head)
    return model
