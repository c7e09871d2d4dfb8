"""Experiment 06: ring attention against full attention, and the context-parallel model against the
reference.

    check = attention_check(nproc=4)          # out, dq, dk, dv vs SDPA; bytes, FLOPs, memory
    print(attention_verdict(check))           # each case's verdict
    summary = run(nproc=4)                    # notebook 06
    scaling = memory_scaling(cps=(1, 2, 4))   # saved activations per rank fall as 1/CP
    python -m labs.run cp --nproc 4 --json

Checks, for every case (causal or not, zig-zag or contiguous):
* correctness: the ring's output and the gradients of q, k and v, reassembled from the ranks,
  equal ``F.scaled_dot_product_attention`` on one process within 1e-5 relative (fp32);
* bytes: the ledger's count of K/V bytes each rank sent equals (CP−1)/CP·KV forward and
  2 (CP−1)/CP·KV backward (``labs.theory.context_parallel.ring_bytes_per_rank``);
* work: ``MatmulFlops`` counts the matmul FLOPs each rank really did in forward; divided by one
  block's FLOPs it gives the blocks computed, which equal the stepper's count (in backward: the
  query × key area handed to ``attention_block_backward``, in blocks);
* memory: bytes saved for backward per rank (saved-tensor hooks) equal the formula, ∝ 1/CP.
The model: the course model with ``apply_context_parallel`` trains ``steps`` steps; every
loss, and every gradient after step 1, equals ``labs.train.train_reference`` within 1e-5.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from labs.experiments.common import RunSummary, course_spec, fill_losses, new_summary
from labs.experiments.spec import Bench, Lab, option
from labs.measure import CommLedger, SavedActivations, state_bytes
from labs.measure.timing import StepTimer, time_steps
from labs.models.transformer import ModelConfig, build_model, count_params
from labs.runtime.device import one_thread, rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import RankResults, launch, report_progress
from labs.theory import context_parallel as theory
from labs.theory import memory
from labs.theory.comm import all_reduce_bytes
from labs.theory.dims import ParallelDims, check_positive
from labs.train import (
    TrainConfig,
    data_for,
    make_optimizer,
    max_rel_diff,
    rule,
    train_reference,
)

CASES = tuple((causal, zigzag) for causal in (True, False) for zigzag in (True, False))


@dataclass(frozen=True)
class AttnShape:
    batch: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query: 2 query heads share each kv head
    seq_len: int = 48  # divisible by 2*cp for cp in 1, 2, 3, 4
    head_dim: int = 8
    seed: int = 0

    def kv_bytes(self) -> int:
        return theory.kv_bytes(
            batch=self.batch, seq_len=self.seq_len, n_kv_head=self.n_kv_head, head_dim=self.head_dim
        )

    def saved_bytes(self, cp: int) -> float:
        return theory.attention_saved_bytes(
            batch=self.batch,
            seq_len=self.seq_len,
            n_head=self.n_head,
            n_kv_head=self.n_kv_head,
            head_dim=self.head_dim,
            cp=cp,
        )


def check_options(nproc: int, seq_len: int) -> None:
    """Raise ValueError before launching anything when the sequence does not split over ``nproc``
    ranks."""
    check_positive(nproc=nproc, seq_len=seq_len)
    ParallelDims(cp=nproc).check_model(seq_len=seq_len, cp_chunks_per_rank=2)


def make_qkv(shape: AttnShape, device: torch.device | str = "cpu"):
    """The global q [B, nh, T, hd], k, v [B, nkv, T, hd] and upstream gradient dout, from the
    seed, on ``device`` (drawn on the CPU, so every device gets the same numbers)."""
    g = torch.Generator().manual_seed(shape.seed)
    b = shape.batch
    t = shape.seq_len
    hd = shape.head_dim
    return tuple(
        torch.randn(*dims, generator=g).to(device)
        for dims in (
            (b, shape.n_head, t, hd),
            (b, shape.n_kv_head, t, hd),
            (b, shape.n_kv_head, t, hd),
            (b, shape.n_head, t, hd),
        )
    )


def reference_attention(shape: AttnShape, causal: bool) -> dict:
    """Full attention on one process (torch SDPA, fp32): out and the gradients of q, k, v."""
    q, k, v, dout = make_qkv(shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


class MatmulFlops(TorchFunctionMode):
    """Counts the FLOPs of every matmul issued while active (2·m·n·k per product, times the batch
    dims). Like ``torch.utils.flop_counter.FlopCounterMode`` for matmuls, but a torch-function mode:
    entering a dispatch mode imports ``torch._dynamo``, ~4 s in every freshly forked rank."""

    MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm)

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS and args[0].dim() >= 2 and args[1].dim() >= 2:
            a = args[0]
            b = args[1]
            batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]).numel()
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting_blocks(module, name: str):
    """Patch ``module.name`` (a block kernel taking (dout, q, k, ...)) to add up query × key
    positions per call, in ``counter["area"]``."""
    counter = {"area": 0}
    kernel = getattr(module, name)

    def counted(dout, q, k, *args, **kwargs):
        counter["area"] += q.shape[-2] * k.shape[-2]
        return kernel(dout, q, k, *args, **kwargs)

    with mock.patch.object(module, name, counted):
        yield counter


def attention_worker(shape: AttnShape, cases, backward: bool = True) -> list[dict]:
    """Ring attention on this rank for each (causal, zigzag) case: the output, and with
    ``backward`` dq, dk, dv (None without: the lab's core, the forward ring, alone)."""
    cpm = exercise("context_parallel")
    group = dist.group.WORLD
    me = dist.get_rank()
    cp = dist.get_world_size()
    results = []
    device = rank_device()
    for causal, zigzag in cases:
        q, k, v, dout = (
            cpm.split_sequence(t, cp=cp, rank=me, zigzag=zigzag, dim=2)
            for t in make_qkv(shape, device)
        )
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with CommLedger() as ledger:
            with ledger.phase("forward"), SavedActivations() as saved, MatmulFlops() as fwd:
                out = cpm.ring_attention(q, k, v, group, causal=causal, zigzag=zigzag)
            # autograd runs backward without torch-function modes: count the kernel's calls instead
            with ledger.phase("backward"), _counting_blocks(cpm, "attention_block_backward") as bwd:
                if backward:
                    out.backward(dout)
        results.append(
            {
                "out": out.detach(),
                "dq": q.grad,
                "dk": k.grad,
                "dv": v.grad,
                "calls": [
                    (phase, op, b)
                    for phase in ("forward", "backward")
                    for op, sent in ledger.calls_by_op(phase).items()
                    for b in sent
                ],
                "sent_forward": ledger.sent_bytes("isend", "forward"),
                "sent_backward": ledger.sent_bytes("isend", "backward"),
                "flops_forward": fwd.flops,
                "block_area_backward": bwd["area"],
                "saved_bytes": saved.bytes,
            }
        )
    return results


def attention_check(
    *,
    nproc: int = 4,
    shape: AttnShape = AttnShape(),
    cases=CASES,
    backend: str = "auto",
    timeout: float = 120.0,
    backward: bool = True,
) -> list[dict]:
    """Run ring attention on ``nproc`` ranks for each (causal, zigzag) case; one dict per case with
    the max relative differences to full attention and, per rank, the measured and theory
    figures, its ``checks`` and, read off them, ``matches_reference``. ``backward=False``: the
    forward alone (notebook 06's core, before ``RingAttention.backward`` is written): the output,
    its messages, blocks and saved bytes."""
    from labs.experiments.checks import matches

    check_options(nproc, shape.seq_len)
    per_rank = launch(
        attention_worker, nproc, shape, list(cases), backward, backend=backend, timeout=timeout
    )
    rows = attention_rows_of(per_rank, shape=shape, cases=cases)
    for i, (row, (causal, zigzag)) in enumerate(zip(rows, cases)):
        row["checks"] = attention_checks(
            per_rank, shape=shape, causal=causal, zigzag=zigzag, row=row, case=i
        )
        row["matches_reference"] = matches(row["checks"], "reference")
    return rows


def attention_verdict(rows: list[dict]) -> str:
    """The verdict of every case of ``attention_check``, one table each."""
    from labs.experiments.checks import verdict_table

    return "\n".join(
        verdict_table(
            row["checks"],
            lab=f"ring attention, {'causal' if row['causal'] else 'no mask'}, {row['layout']}",
        )
        for row in rows
    )


def attention_rows_of(per_rank: RankResults, *, shape: AttnShape, cases) -> list[dict]:
    """``attention_check``'s rows from the ranks' results of ``attention_worker``."""
    nproc = len(per_rank)
    chunk = shape.seq_len // (2 * nproc)
    block_flops = theory.block_flops(
        batch=shape.batch, n_head=shape.n_head, chunk=chunk, head_dim=shape.head_dim
    )
    comm = theory.ring_bytes_per_rank(cp=nproc, kv=shape.kv_bytes())
    rows = []
    for i, (causal, zigzag) in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        ref = reference_attention(shape, causal)
        backward = ranks[0]["dq"] is not None
        diffs = {
            name: max_rel_diff(
                reassemble([r[name] for r in ranks], zigzag=zigzag, dim=2), ref[name]
            )
            for name in (("out", "dq", "dk", "dv") if backward else ("out",))
        }
        work = theory.work_per_rank(nproc, causal=causal, zigzag=zigzag)
        rows.append(
            {
                "cp": nproc,
                "causal": causal,
                "zigzag": zigzag,
                "layout": theory.LAYOUTS[zigzag],
                "max_rel_diff": diffs,
                "kv_bytes": shape.kv_bytes(),
                "sent_forward": [r["sent_forward"] for r in ranks],
                "theory_sent_forward": comm["forward"],
                "sent_backward": [r["sent_backward"] for r in ranks],
                "theory_sent_backward": comm["backward"],
                "blocks_measured_forward": [r["flops_forward"] / block_flops for r in ranks],
                "blocks_measured_backward": [r["block_area_backward"] / chunk**2 for r in ranks]
                if backward
                else None,
                "blocks_theory": [w["computed"] for w in work],
                "blocks_masked_theory": [w["masked"] for w in work],
                "imbalance": theory.imbalance(work),
                "saved_bytes": [r["saved_bytes"] for r in ranks],
                "theory_saved_bytes": shape.saved_bytes(nproc),
            }
        )
    return rows


def train_worker(model_cfg: ModelConfig, cfg: TrainConfig, zigzag: bool) -> dict:
    cpm = exercise("context_parallel")
    group = dist.group.WORLD
    device = rank_device()
    model = cpm.apply_context_parallel(
        build_model(model_cfg, seed=cfg.seed, device=device), group, zigzag=zigzag
    )
    optimizer = make_optimizer(model.parameters(), cfg)
    losses = []
    grads = {}
    ledger = CommLedger()
    timer = StepTimer(device)
    for step, (x, y) in enumerate(data_for(cfg)):
        x = x.to(device)
        y = y.to(device)
        with timer.step():
            # [B, T/cp] twice, [T/cp]
            idx, targets, positions = cpm.shard_inputs(x, y, group, zigzag=zigzag)
            # this rank's share of the tokens: its weight in the global mean
            share = targets.numel() / y.numel()
            with ledger if step == 0 else nullcontext():
                with ledger.phase("forward"), SavedActivations(exclude=model) as saved:
                    _, loss = model(idx, targets, positions)  # mean over this rank's tokens
                with ledger.phase("backward"):
                    (loss * share).backward()
                with ledger.phase("gradients"):
                    cpm.all_reduce_gradients(model, group)
            if step == 0:
                grads = {
                    n: None if p.grad is None else p.grad.clone()
                    for n, p in model.named_parameters()
                }
                first_saved = saved.bytes
                calls = [
                    (phase, op, b)
                    for phase in ("forward", "backward", "gradients")
                    for op, sent in ledger.calls_by_op(phase).items()
                    for b in sent
                    if op not in ("irecv", "recv")  # what a rank sends
                ]
            optimizer.step()
            if step == 0:
                state = state_bytes(model, optimizer)["total"]
            optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach() * share
        # the sum of token-weighted means is the mean over all tokens
        dist.all_reduce(global_loss, group=group)
        losses.append(global_loss.item())
        report_progress()
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "calls": calls,
        "step_time_s": timer.step_time(),
        "saved_bytes": first_saved,
        "sent": {ph: ledger.sent_bytes(phase=ph) for ph in ("forward", "backward", "gradients")},
        "state": state,
    }


@dataclass(frozen=True)
class Options:
    """The ring-attention lab's options (``run``'s keywords, ``python -m labs.run cp``'s flags)."""

    causal: bool = option(
        True, "causal mask (default) or none (attention check only)", negatable=True
    )
    zigzag: bool = option(
        True, "zig-zag load balancing (default) or contiguous chunks", negatable=True
    )
    seq: int = option(32, "sequence length T (divisible by 2*nproc)")

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        check_options(nproc, self.seq)
        check_positive(steps=steps)


LAB = Lab(
    name="cp",
    notebook="06_context_parallel",
    exercises=("context_parallel",),
    reference=("reference_attention",),
    options=Options,
    ranks=4,
    small_run={"nproc": 2, "steps": 2},
    bench=(Bench(torch="SDPA, one process (no CPU context_parallel)", like_for_like=False),),
    profiled=True,
)


def run(
    *,
    nproc: int | None = None,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 120.0,
    **options,
) -> RunSummary:
    """The lab summary: the attention check for (``causal``, ``zigzag``) and, for a causal mask,
    the context-parallel course model trained ``steps`` steps against the reference (on ``nproc``
    ranks, default ``LAB.ranks``; the ``options``: ``Options``)."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    shape = AttnShape(seq_len=o.seq)
    cases = [(o.causal, o.zigzag)]
    attention = launch(attention_worker, nproc, shape, cases, backend=backend, timeout=timeout)
    [check] = attention_rows_of(attention, shape=shape, cases=cases)
    summary = new_summary(
        "cp",
        nproc=nproc,
        backend=attention.backend,
        steps=steps,
        causal=o.causal,
        zigzag=o.zigzag,
        seq=o.seq,
        attention=check,
    )
    summary.add_checks(
        attention_checks(attention, shape=shape, causal=o.causal, zigzag=o.zigzag, row=check)
    )
    if not o.causal:  # the course model is a causal language model: no reference to train against
        summary["training"] = (
            "skipped: the course model is causal; --no-causal checks attention only"
        )
        return summary
    model_cfg = ModelConfig()
    cfg = TrainConfig(steps=steps, seq_len=o.seq)
    per_rank = launch(
        train_worker,
        nproc,
        model_cfg,
        cfg,
        o.zigzag,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc="CP training",
    )
    ref = train_reference(model_cfg, cfg, return_grads=True)
    fill_losses(summary, per_rank[0]["losses"], ref.losses)
    grad_diff = max(
        # by name, every rank, after step 1
        max_rel_diff(r["grads"][name].double(), g.double()) if r["grads"][name] is not None else 1
        for r in per_rank
        for name, g in ref.grads.items()
    )
    kv = theory.kv_bytes(
        batch=cfg.batch_size,
        seq_len=o.seq,
        n_kv_head=model_cfg.n_kv_head,
        head_dim=model_cfg.head_dim,
    )
    ring = theory.ring_bytes_per_rank(cp=nproc, kv=kv)
    model = build_model(model_cfg)  # unsharded: its size here, torch's attention time below
    n_params = count_params(model)
    grads_theory = all_reduce_bytes(4 * n_params, nproc)
    summary.update(
        max_rel_grad_diff=grad_diff,
        comm_bytes_per_rank=[sum(r["sent"].values()) for r in per_rank],
        theory_comm_bytes_per_rank=model_cfg.n_layer * ring["total"] + grads_theory,
        comm_bytes_by_phase=per_rank[0]["sent"],
        theory_comm_bytes_by_phase={
            "forward": model_cfg.n_layer * ring["forward"],
            "backward": model_cfg.n_layer * ring["backward"],
            "gradients": grads_theory,
        },
        state_bytes_per_rank=[r["state"] for r in per_rank],
        # fp32 + AdamW: 16 bytes per parameter
        theory_state_bytes_per_rank=memory.state_bytes(n_params)["total_bytes"],
        saved_activation_bytes_per_rank=[r["saved_bytes"] for r in per_rank],
        theory_saved_activation_bytes=calculator_activation_bytes(
            model_cfg, seq=o.seq, batch=cfg.batch_size, cp=nproc
        ),
        step_time_s=max(r["step_time_s"] for r in per_rank),
    )
    if vs_torch:  # torch's context_parallel has no CPU rule: time torch SDPA on one process instead
        x, y = data_for(cfg)[0]

        def torch_step():
            _, loss = model(x, y)
            loss.backward()

        # one thread, as a rank computes: two spinning threads beside 4 ranks make it erratic;
        # a warm-up step and 3 timed ones
        with one_thread():
            summary["torch_step_time_s"] = time_steps(torch_step, 4)
    summary.add_checks(
        model_checks(
            per_rank,
            ref,
            summary,
            kv_per_layer=kv,
            n_layer=model_cfg.n_layer,
            grads_bytes=grads_theory,
        )
    )
    return summary


# --- the verdict ----------------------------------------------------------------------------------
def own_chunks(t: torch.Tensor, *, cp: int, rank: int, zigzag: bool, dim: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of a full tensor, computed here independently of the lab's
    ``split_sequence`` (so the check does not trust the code it checks): chunks r and 2·CP−1−r
    of 2·CP (zig-zag), or 2r and 2r+1."""
    chunks = t.chunk(2 * cp, dim=dim)
    ids = (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)
    return torch.cat([chunks[i] for i in ids], dim=dim)


def reassemble(parts: list[torch.Tensor], *, zigzag: bool, dim: int) -> torch.Tensor:
    """The full tensor from the ranks' shares (``own_chunks``'s inverse, independent of the lab's
    ``unsplit_sequence``)."""
    cp = len(parts)
    pieces = {}
    for rank, part in enumerate(parts):
        ids = (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)
        pieces.update(zip(ids, part.chunk(2, dim=dim)))
    return torch.cat([pieces[i] for i in range(2 * cp)], dim=dim)


RING_HINTS = {
    "out": "the merged output differs: at step s a rank holds the K/V of rank (r − s) mod CP; it "
    "skips the chunk pairs a causal mask hides entirely, masks only the diagonal ones "
    "(block_kind), and merges the partial results by their log-sum-exp (merge_partials). Its "
    "tokens are the chunks chunk_ids names (zig-zag: r and 2·CP−1−r)",
    "dq": "dq adds up, locally, every step's contribution of each chunk pair (computed with the "
    "saved global out and lse): accumulate, do not overwrite",
    "dkv": "each K/V block's gradient accumulator travels one hop behind its block: a rank adds "
    "its own contribution to what arrives from r−1 before passing it on to r+1, and the "
    "accumulator ends at the block's owner",
}


def attention_checks(
    per_rank, *, shape: AttnShape, causal: bool, zigzag: bool, row: dict, case: int = 0
) -> list:
    """Ring attention on every rank: its share of the output and of dq, dk, dv against full
    attention's (SDPA), the K/V bytes of every message, the blocks computed, the bytes saved."""
    from labs.experiments.checks import calls_check, collectives_checks, compare_values, ranks_check

    n = len(per_rank)
    ref = reference_attention(shape, causal)
    mine = [
        {k: own_chunks(v, cp=n, rank=r, zigzag=zigzag, dim=2) for k, v in ref.items()}
        for r in range(n)
    ]
    tol = rule("value", torch.float32, per_rank.backend).rel
    results = [r[case] for r in per_rank]
    backward = results[0]["dq"] is not None  # False: the forward alone was run
    checks = [
        ranks_check(
            "ring attention output",
            [{"out": r["out"]} for r in results],
            [{"out": m["out"]} for m in mine],
            tolerance=tol,
            what="outputs",
            hint=RING_HINTS["out"],
        ),
    ]
    checks += [
        ranks_check(
            "ring attention dq",
            [{"dq": r["dq"]} for r in results],
            [{"dq": m["dq"]} for m in mine],
            tolerance=tol,
            what="gradients",
            hint=RING_HINTS["dq"],
        ),
        ranks_check(
            "ring attention dk, dv",
            [{"dk": r["dk"], "dv": r["dv"]} for r in results],
            [{"dk": m["dk"], "dv": m["dv"]} for m in mine],
            tolerance=tol,
            what="gradients",
            hint=RING_HINTS["dkv"],
        ),
    ][: 2 * backward]
    message = shape.kv_bytes() / n  # this rank's K and V, stacked
    expected = [("forward", "isend", message)] * (n - 1) + [("backward", "isend", message)] * (
        2 * (n - 1) * backward
    )
    checks += collectives_checks(
        [[c for c in r["calls"] if c[1] in ("isend", "send")] for r in results],
        [expected] * n,
        world_size=n,
        count_hint="the {phase} pass sent another number of messages than the ring's: forward, "
        "CP−1 hops of the local K/V; backward, CP−1 hops of K/V and CP−1 of their gradients",
        hint="a message is this rank's K and V, stacked, unrepeated (nkv heads): "
        "[2, B, nkv, T/cp, hd]",
    )
    measured = [row["blocks_measured_forward"]] + [row["blocks_measured_backward"]] * backward
    checks.append(
        calls_check(
            "blocks computed per rank (forward, backward)"
            if backward
            else "blocks computed per rank (forward)",
            [[m[r] for m in measured] for r in range(n)],
            [[row["blocks_theory"][r]] * len(measured) for r in range(n)],
            what="blocks",
            hint="a causal mask hides the chunk pairs whose keys all come after the queries: skip "
            "them (block_kind 'masked') and compute the others once each",
        )
    )
    checks.append(
        compare_values(
            "bytes saved for backward per rank",
            row["saved_bytes"],
            [row["theory_saved_bytes"]] * n,
            hint="ring attention saves its local q, k, v, out and lse, never a T×T matrix "
            "(the backward recomputes each block's scores)",
        )
    )
    return checks


def model_checks(per_rank, ref, summary, *, kv_per_layer, n_layer, grads_bytes) -> list:
    """The context-parallel course model on every rank: losses, gradients after step 1 and
    parameters after the last step by name, every message and the gradients' all-reduce, state."""
    from labs.experiments.checks import collectives_checks, compare_values, training_checks

    n = len(per_rank)
    checks = training_checks(
        losses=per_rank[0]["losses"],
        reference_losses=ref.losses,
        grads=[r["grads"] for r in per_rank],
        reference_grads=ref.grads,
        params=[r["params"] for r in per_rank],
        reference_params=ref.params,
        backend=summary["backend"],
        world_size=n,
        known_scales={
            float(n): "each rank's loss is a mean over its T/CP tokens: weight it by its token "
            "share before backward, then sum the gradients over the CP group (or divide the sum "
            "by CP)"
        },
        first_step_hint="the context-parallel model's loss differs at step 1: its attention "
        "must be causal over the whole sequence, each rank's tokens at their own (zig-zag) "
        "positions (shard_inputs)",
    )
    message = kv_per_layer / n
    expected = (
        [("forward", "isend", message)] * (n_layer * (n - 1))
        + [("backward", "isend", message)] * (n_layer * 2 * (n - 1))
        + [("gradients", "all_reduce", grads_bytes)]
    )
    checks += collectives_checks(
        [r["calls"] for r in per_rank],
        [expected] * n,
        world_size=n,
        count_hint="the {phase} phase issued another number of {op} calls than the theory: per "
        "layer CP−1 K/V hops forward, 2 (CP−1) backward (K/V and their gradients), then one "
        "all-reduce of every gradient",
    )
    checks.append(
        compare_values(
            "state bytes per rank",
            summary["state_bytes_per_rank"],
            [summary["theory_state_bytes_per_rank"]] * n,
            hint="weights are replicated over the CP group: every rank holds the whole model",
        )
    )
    checks.append(
        compare_values(
            "saved activation bytes per rank",
            summary["saved_activation_bytes_per_rank"],
            [summary["theory_saved_activation_bytes"]] * n,
            hint="each rank saves its own T/CP tokens' activations, and ring attention no T×T "
            "matrix: the memory calculator's figure with cp",
        )
    )
    return checks


def calculator_activation_bytes(model_cfg: ModelConfig, *, seq: int, batch: int, cp: int) -> float:
    """Notebook 01's memory calculator's activations per rank for the course model in fp32
    (``labs.theory.memory.memory_per_rank``)."""
    per_rank = memory.memory_per_rank(
        course_spec(model_cfg), seq=seq, mbs=batch, precision="fp32", cp=cp
    )
    return per_rank["activation_bytes"]


def memory_worker(model_cfg: ModelConfig, shape: AttnShape, batch: int, seq: int) -> dict:
    cpm = exercise("context_parallel")
    group = dist.group.WORLD
    device = rank_device()
    model = cpm.apply_context_parallel(build_model(model_cfg, device=device), group)
    x = torch.randint(
        0, model_cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
    ).to(device)
    idx, targets, positions = cpm.shard_inputs(x, x, group)
    with SavedActivations(exclude=model) as saved:
        _, loss = model(idx, targets, positions)
        loss.backward()
    return {
        "model": saved.bytes,
        "attention": attention_worker(shape, [(True, True)])[0]["saved_bytes"],
    }


def memory_scaling(
    *,
    cps=(1, 2, 4),
    batch: int = 2,
    seq: int = 48,
    model_cfg: ModelConfig = ModelConfig(),
    shape: AttnShape = AttnShape(),
    timeout: float = 120.0,
) -> list[dict]:
    """Bytes saved for backward per rank at each CP degree: one ring-attention call (measured and
    formula) and the whole CP course model (measured), with their ratio to CP = 1."""
    rows = []
    for cp in cps:
        check_options(cp, seq)
        check_options(cp, shape.seq_len)
        per_rank = launch(memory_worker, cp, model_cfg, shape, batch, seq, timeout=timeout)
        rows.append(
            {
                "cp": cp,
                "attention_saved": max(r["attention"] for r in per_rank),
                "attention_theory": shape.saved_bytes(cp),
                "model_saved": max(r["model"] for r in per_rank),
                "calculator": calculator_activation_bytes(model_cfg, seq=seq, batch=batch, cp=cp),
            }
        )
    for row in rows:  # 1/CP scaling: each fraction equals cps[0] / cp
        row["attention_fraction"] = row["attention_saved"] / rows[0]["attention_saved"]
        row["model_fraction"] = row["model_saved"] / rows[0]["model_saved"]
    return rows


def merge_example() -> dict:
    """Notebook 06's worked example: one query, four keys split into two blocks of two, merged by
    ``merge_partials`` and compared with the softmax over all four keys at once."""
    cpm = exercise("context_parallel")
    scores = torch.tensor([1.0, 2.0, 0.5, 3.0])
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]])
    # q·k_j = scores[j]
    q = scores.view(1, 1, 1, 4)
    k = torch.eye(4).view(1, 1, 4, 4)
    v = values.view(1, 1, 4, 2)
    a = cpm.attention_block(q, k[:, :, :2], v[:, :, :2], causal=False, scale=1.0)  # keys 0, 1
    b = cpm.attention_block(q, k[:, :, 2:], v[:, :, 2:], causal=False, scale=1.0)  # keys 2, 3
    out_a, lse_a = a
    out_b, lse_b = b
    out, lse = cpm.merge_partials(out_a, lse_a, out_b, lse_b)
    direct = torch.softmax(scores, 0) @ values
    return {
        "lse_A": lse_a.item(),
        "lse_B": lse_b.item(),
        "out_A": out_a.flatten().tolist(),
        "out_B": out_b.flatten().tolist(),
        "merged_lse": lse.item(),
        "logsumexp_all": scores.logsumexp(0).item(),
        "merged_out": out.flatten().tolist(),
        "softmax_out": direct.tolist(),
        "max_abs_diff": (out.flatten() - direct).abs().max().item(),
    }


def long_context_rows(
    *,
    seq_lens=(4096, 16384, 32768, 65536, 131072),
    cps=(1, 2, 4, 8, 16),
    flash: bool = True,
    **model,
) -> list[dict]:
    """Activation GiB per rank (Llama-3 8B, bf16, batch 1, no recomputation) by length and CP:
    ``labs.theory.context_parallel.long_context_table``."""
    return theory.long_context_table(seq_lens=list(seq_lens), cps=cps, flash=flash, **model)


def format_rows(rows: list[dict], digits: int = 3) -> str:
    """A plain aligned table of a list of dicts (floats to ``digits`` significant digits)."""
    keys = list(rows[0])
    cells = [
        [f"{r[k]:.{digits}g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows
    ]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells])


def attention_rows(checks: list[dict]) -> list[dict]:
    """One printable row per case of ``attention_check``: differences, bytes and work, measured vs
    theory (no backward bytes for a forward-only check)."""
    rows = []
    for c in checks:
        row = {
            "mask": "causal" if c["causal"] else "none",
            "layout": c["layout"],
            "max rel diff": max(c["max_rel_diff"].values()),
            "fwd bytes/rank": (
                f"{c['sent_forward'][0]:.0f} (theory {c['theory_sent_forward']:.0f})"
            ),
        }
        if c["blocks_measured_backward"] is not None:
            row["bwd bytes/rank"] = (
                f"{c['sent_backward'][0]:.0f} (theory {c['theory_sent_backward']:.0f})"
            )
        row["blocks/rank (FLOPs)"] = str([int(b) for b in c["blocks_measured_forward"]])
        row["theory"] = str(c["blocks_theory"])
        row["max/mean"] = round(c["imbalance"], 3)
        rows.append(row)
    return rows
