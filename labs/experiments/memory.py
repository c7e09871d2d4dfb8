"""Experiment 01: a real model's memory, measured, against the calculator (``labs.theory.memory``).

    summary = run(nproc=2, steps=3)       # notebook 01
    python -m labs.run memory --nproc 2 --json

The views of a summary (``format_comparison``: measured vs predicted, per precision and
recomputation; ``format_regions``, ``format_recompute``, ``plot_comparison``) are in
``labs.experiments.memory_report``.

Each rank trains the course model (data parallel: gradients averaged with ``dist.all_reduce``,
so per-rank memory is that of one replica) for ``steps`` steps in every configuration
(fp32 or bf16-mixed) x (recompute none, selective or full), and counts at the last step:

* parameters, gradients and optimizer state: ``numel * element_size`` of the real tensors;
* activations: every tensor autograd saves for backward (``labs.measure.SavedActivations``,
  saved-tensor hooks), per region (embedding, each layer, final norm, loss). ``full``
  checkpoints each block with ``torch.utils.checkpoint`` (it saves the block's input through
  our hook); ``selective`` uses torch's selective checkpointing with a policy that keeps matmul
  and attention-kernel outputs, which :class:`SaveMatmuls` counts as it keeps them.

bf16-mixed, by hand (Micikevicius et al. 2018): a bf16 copy of the model (the fp32 weights rounded
once) computes forward and backward; the optimizer owns fp32 master weights (fp32 copies of it),
steps on them with the bf16 gradients cast to fp32, and the bf16 copy is refreshed from them.
With ``fp32_grad_accum`` each master weight keeps a persistent fp32 gradient buffer the bf16
gradients are added into (Megatron's main_grad).

Checks: bytes equal the calculator's exactly on CPU (tolerance 0: the formula lists every saved
tensor, so any other tolerance would hide a missed one; a 4-byte scalar is visible); each
precision against the single-process reference under the same precision (``reference_run``:
fp32, or ``train_reference(mixed=...)`` with this lab's bf16-mixed policy): the losses, the
gradients the optimizer is handed at every step (a gradient left over from the step before, such
as an fp32 accumulation buffer never zeroed, shows from step 2 on), the parameters (the fp32
masters) after the last step, by the tolerance table's rules (bit for bit on one rank in fp32);
recomputation changes no loss (bit for bit); the gradient all-reduce sends 2(N-1)/N x grad bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from labs.data import rank_batches
from labs.experiments.common import RunSummary, course_spec, fill_losses, new_summary
from labs.experiments.spec import Bench, Lab, option
from labs.measure.ledger import CommLedger
from labs.measure.memory import SavedActivations, grad_bytes, optimizer_bytes, param_bytes
from labs.measure.timing import StepTimer
from labs.models.transformer import ModelConfig, build_model, rotary_cos_sin
from labs.runtime.device import deterministic_algorithms, rank_device
from labs.runtime.launcher import launch, report_progress
from labs.theory.activations import RECOMPUTE, playbook_layer_bytes
from labs.theory.comm import all_reduce_bytes
from labs.theory.memory import memory_per_rank
from labs.train import (
    MixedPrecision,
    TrainConfig,
    compare_losses,
    data_for,
    make_optimizer,
    rule,
    train_reference,
)

PRECISIONS = ("fp32", "bf16-mixed")
DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16}
STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")
BYTE_KEYS = (*STATE_KEYS, "activation_bytes")
# Ops whose outputs selective recomputation keeps: matmuls and the attention kernels (CPU, then
# CUDA).
KEEP_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


class SaveMatmuls:
    """Selective-checkpointing policy: keep matmul and attention-kernel outputs, recompute the rest
    (norms, rotary, SwiGLU's pointwise ops). Counts the bytes it keeps, by ``region``."""

    def __init__(self):
        self.bytes = 0
        self.by_region = {}
        self.region = "other"
        self._seen = set()

    def __call__(self, ctx, op, *args, **kwargs):
        if op not in KEEP_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
        for t in outputs if not ctx.is_recompute else []:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                if key not in self._seen:
                    self._seen.add(key)
                    self.bytes += key[1]
                    self.by_region[self.region] = self.by_region.get(self.region, 0) + key[1]
        return CheckpointPolicy.MUST_SAVE

    def contexts(self):
        return create_selective_checkpoint_contexts(self)


def run_block(block, x, cos, sin, recompute: str, policy: SaveMatmuls | None = None):
    """One transformer block with the chosen recomputation."""
    if recompute == "none":
        return block(x, cos, sin)
    if recompute == "full":  # keep only the block's input; rerun the block in backward
        return checkpoint(block, x, cos, sin, use_reentrant=False)
    return checkpoint(
        block, x, cos, sin, use_reentrant=False, context_fn=(policy or SaveMatmuls()).contexts
    )


def forward_loss(
    model,
    idx,
    targets,
    *,
    recompute: str = "none",
    meter: SavedActivations | None = None,
    policy: SaveMatmuls | None = None,
):
    """The course model's forward and loss (``Transformer.forward``, block by block) with
    recomputation and measurement regions. The rotary tables are cast to the model's dtype,
    as ``transformers``' Llama does, so a bf16 copy of the model runs end to end."""
    cfg = model.cfg
    dtype = model.tok_emb.weight.dtype
    region = meter.region if meter is not None else (lambda name: contextlib.nullcontext())
    cos, sin = rotary_cos_sin(
        torch.arange(idx.shape[1], device=idx.device), cfg.head_dim, cfg.rope_theta
    )
    cos, sin = cos.to(dtype), sin.to(dtype)  # [T, hd]
    with region("embedding"):
        x = model.tok_emb(idx)  # [B, T, H]
    for i, block in enumerate(model.layers):
        if policy is not None:
            policy.region = f"layer{i}"
        with region(f"layer{i}"):
            x = run_block(block, x, cos, sin, recompute, policy)  # [B, T, H]
    with region("final_norm"):
        logits = model.lm_head(model.norm(x))  # [B, T, V]
    with region("loss"):
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def saved_activations(model, idx, targets, *, recompute: str = "none") -> tuple:
    """Run forward once and count what autograd saves for backward: ``(loss, bytes, by_region)``.
    Single process; ``measure_rank`` calls it on every rank."""
    policy = SaveMatmuls() if recompute == "selective" else None
    with SavedActivations(exclude=model) as meter:
        loss = forward_loss(model, idx, targets, recompute=recompute, meter=meter, policy=policy)
    regions = Counter(meter.by_region) + Counter(policy.by_region if policy else {})
    return loss, meter.bytes + (policy.bytes if policy else 0), dict(regions)


def measure_rank(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    precision: str,
    recompute: str,
    fp32_grad_accum: bool = False,
) -> dict:
    """Train on this rank's share of the data; count bytes at the last step."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = rank_device()
    # recomputation must change no loss, bit for bit (the table's "rerun" rule): on a GPU that
    # takes deterministic kernels
    deterministic_algorithms()
    model = build_model(model_cfg, seed=train_cfg.seed, device=device)
    master = None
    if precision == "bf16-mixed":
        # a bf16 copy computes (the fp32 weights rounded once); the optimizer steps fp32 masters of
        # it, as the mixed-precision reference does (labs.train.reference)
        model = model.to(torch.bfloat16)
        master = [p.detach().float() for p in model.parameters()]
        if fp32_grad_accum:
            for p in master:
                p.grad = torch.zeros_like(p)
    optimizer = make_optimizer(master or model.parameters(), train_cfg)
    names = [n for n, _ in model.named_parameters()]
    holders = master if master is not None else list(model.parameters())  # what the optimizer steps
    step_grads = []  # per step: the gradients the optimizer is handed, by name
    step_weights = []  # per step: the weights its forward computes with, by name
    losses = []
    out = {}
    timer = StepTimer(device)
    batches = rank_batches(
        steps=train_cfg.steps,
        batch_size=train_cfg.per_rank_batch(world),
        seq_len=train_cfg.seq_len,
        rank=rank,
        world_size=world,
        seed=train_cfg.data_seed,
    )  # this rank's share
    for step, (x, y) in enumerate(batches):
        x = x.to(device)
        y = y.to(device)
        last = step == train_cfg.steps - 1
        step_weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        with timer.step():
            loss, act_bytes, regions = saved_activations(model, x, y, recompute=recompute)
            loss.backward()
            with CommLedger() as ledger:
                for p in model.parameters():  # data parallel: average the gradients over the ranks
                    dist.all_reduce(p.grad)
                    p.grad /= world
            if master is not None and fp32_grad_accum:
                for p32, p in zip(master, model.parameters()):
                    p32.grad.add_(p.grad)
            if last:  # the peak: gradients and (from earlier steps) optimizer state all exist
                extra_opt = param_bytes(master) if master is not None else 0
                extra_grad = grad_bytes(master) if master is not None else 0
                out = {
                    "param_bytes": param_bytes(model.parameters()),
                    "grad_bytes": grad_bytes(model.parameters()) + extra_grad,
                    "optimizer_bytes": optimizer_bytes(optimizer) + extra_opt,
                    "activation_bytes": act_bytes,
                    "regions": regions,
                    "comm_bytes": ledger.sent_bytes(),
                    "comm_per_call": ledger.calls_by_op().get("all_reduce", []),
                    "expected_per_call": [
                        all_reduce_bytes(p.numel() * p.element_size(), world)
                        for p in model.parameters()
                    ],
                }
            if master is not None:
                for p32, p in zip(master, model.parameters()):
                    if not fp32_grad_accum:
                        p32.grad = p.grad.float()  # transient fp32 gradient for the optimizer step
            step_grads.append({n: q.grad.float().clone() for n, q in zip(names, holders)})
            optimizer.step()
            if master is not None:
                with torch.no_grad():
                    for p32, p in zip(master, model.parameters()):
                        p.copy_(p32)  # refresh the bf16 compute copy
                        if fp32_grad_accum:
                            p32.grad.zero_()
                        else:
                            p32.grad = None
            model.zero_grad(set_to_none=True)  # the master's gradients were handled above
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        report_progress()
    return {
        **out,
        "losses": losses,
        "first_grads": step_grads[0],  # the averaged gradients of step 1
        "step_grads": step_grads,
        "step_weights": step_weights,
        # the fp32 masters, if any
        "params": {n: p.detach().float().clone() for n, p in zip(names, holders)},
        "step_time_s": timer.step_time(),
        "device": device.type,
    }


def memory_worker(model_cfg, train_cfg, configs, fp32_grad_accum) -> list[dict]:
    return [measure_rank(model_cfg, train_cfg, p, r, fp32_grad_accum) for p, r in configs]


def predict(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    precision: str,
    recompute: str,
    dp: int,
    fp32_grad_accum: bool = False,
) -> dict:
    """The calculator's figures for one rank of this experiment."""
    return memory_per_rank(
        course_spec(model_cfg),
        seq=train_cfg.seq_len,
        mbs=train_cfg.per_rank_batch(dp),
        precision=precision,
        optimizer="adamw",
        dp=dp,
        recompute=recompute,
        fp32_grad_accum=fp32_grad_accum,
    )


@dataclasses.dataclass(frozen=True)
class Options:
    """The memory lab's options (``run``'s keywords, ``python -m labs.run memory``'s flags)."""

    precisions: tuple[str, ...] = option(PRECISIONS, "fp32 and/or bf16-mixed")
    recomputes: tuple[str, ...] = option(RECOMPUTE, "none, selective and/or full")
    fp32_grad_accum: bool = option(False, "bf16-mixed: persistent fp32 gradient buffers")
    seq_len: int = option(32)
    batch_size: int = option(8, "global batch (sequences per step, all ranks)")
    model_cfg: ModelConfig | None = option(None, command_line=False)  # default: ModelConfig()

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        if steps < 2:
            raise ValueError(
                "steps must be >= 2 (optimizer state exists only after the first step), got "
                f"{steps}"
            )
        for name, values, valid in (
            ("precisions", self.precisions, PRECISIONS),
            ("recomputes", self.recomputes, RECOMPUTE),
        ):
            bad = [v for v in values if v not in valid]
            if bad or not values:
                raise ValueError(f"{name}={tuple(values)!r}: choose one or more of {valid}")
        if self.fp32_grad_accum and "fp32" in self.precisions:
            raise ValueError(
                "fp32_grad_accum applies to bf16-mixed only; use precisions=('bf16-mixed',)"
            )
        # raises if the batch does not split over the ranks
        TrainConfig(batch_size=self.batch_size, seq_len=self.seq_len).per_rank_batch(nproc)


LAB = Lab(
    name="memory",
    notebook="01_memory_anatomy",
    exercises=("activations",),
    reference=("reference_run", "reference_step_grads"),
    options=Options,
    ranks=1,
    small_run={"nproc": 2, "steps": 2},
    bench=(
        Bench(
            options={"precisions": ("fp32",), "recomputes": ("none",)}, label="fp32, no recompute"
        ),
    ),
)


def run(
    *,
    nproc: int | None = None,
    steps: int = 3,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 120.0,
    **options,
) -> RunSummary:
    """Measure every (precision, recompute) configuration on ``nproc`` data-parallel ranks
    (default ``LAB.ranks``; ``options``: ``Options``) and compare with the calculator. ``vs_torch``
    has no counterpart here (PyTorch has no memory calculator) and is accepted for the common CLI.
    Returns the lab summary with ``rows``."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    model_cfg = o.model_cfg or ModelConfig()
    train_cfg = TrainConfig(steps=steps, batch_size=o.batch_size, seq_len=o.seq_len)
    configs = [(p, r) for p in o.precisions for r in o.recomputes]
    per_rank = launch(
        memory_worker,
        nproc,
        model_cfg,
        train_cfg,
        configs,
        o.fp32_grad_accum,
        backend=backend,
        timeout=timeout,
        progress=steps * len(configs),
        desc="steps",
    )
    refs = {p: reference_run(model_cfg, train_cfg, p, dp=nproc) for p in o.precisions}
    # per precision, the reference's gradients at the run's own weights of every step
    step_refs = {
        p: reference_step_grads(
            model_cfg, train_cfg, p, per_rank[0][configs.index((p, o.recomputes[0]))], dp=nproc
        )
        for p in o.precisions
    }
    spec = course_spec(model_cfg)
    b = train_cfg.per_rank_batch(nproc)
    # bytes to the byte on gloo; 5% on GPUs (the table's "activation_bytes" rule says why)
    act_tol = rule("activation_bytes", None, per_rank.backend).rel
    rows = []
    for i, (precision, recompute) in enumerate(configs):
        measured = [r[i] for r in per_rank]
        theory = predict(model_cfg, train_cfg, precision, recompute, nproc, o.fp32_grad_accum)
        e = 4 if precision == "fp32" else 2
        row = {
            "precision": precision,
            "recompute": recompute,
            "measured": {k: measured[0][k] for k in BYTE_KEYS},
            "predicted": {k: theory[k] for k in BYTE_KEYS},
            "same_on_every_rank": all(
                {k: m[k] for k in BYTE_KEYS} == {k: measured[0][k] for k in BYTE_KEYS}
                for m in measured
            ),
            "regions": measured[0]["regions"],
            "parts": theory["activations_per_microbatch"],
            "playbook_activation_bytes": spec.n_layers
            * e
            / 2
            * playbook_layer_bytes(
                seq=train_cfg.seq_len, mbs=b, hidden=spec.hidden, heads=spec.n_heads
            )
            if recompute == "none"
            else None,
            "losses": measured[0]["losses"],
            "step_time_s": max(m["step_time_s"] for m in measured),
            "comm_bytes_per_rank": [m["comm_bytes"] for m in measured],
            # the all-reduce carries the model's own gradients (bf16 ones in bf16-mixed)
            "theory_comm_bytes_per_rank": all_reduce_bytes(theory["params"] * e, nproc),
        }
        row["activation_rel_diff"] = abs(
            row["measured"]["activation_bytes"] / row["predicted"]["activation_bytes"] - 1
        )
        row["reference_losses"] = refs[precision].losses
        row["max_rel_loss_diff"] = compare_losses(row["losses"], row["reference_losses"])[
            "max_rel_loss_diff"
        ]
        rows.append(row)
    first = rows[0]
    summary = new_summary(
        "memory",
        nproc=nproc,
        backend=per_rank.backend,
        steps=steps,
        rows=rows,
        seq_len=o.seq_len,
        batch_size=o.batch_size,
        fp32_grad_accum=o.fp32_grad_accum,
        model=dataclasses.asdict(model_cfg),
        activation_tolerance=act_tol,
    )
    fill_losses(summary, first["losses"], first["reference_losses"])
    summary.update(
        state_bytes_per_rank=[sum(r[0][k] for k in STATE_KEYS) for r in per_rank],
        theory_state_bytes_per_rank=sum(first["predicted"][k] for k in STATE_KEYS),
        comm_bytes_per_rank=first["comm_bytes_per_rank"],
        theory_comm_bytes_per_rank=first["theory_comm_bytes_per_rank"],
        step_time_s=first["step_time_s"],
        torch_step_time_s=None,
        recompute_changes_loss=any(
            r["losses"] != next(q for q in rows if q["precision"] == r["precision"])["losses"]
            for r in rows
        ),
    )
    summary.add_checks(
        memory_checks(
            per_rank,
            configs,
            rows,
            refs,
            summary,
            act_tol=act_tol,
            accum=o.fp32_grad_accum,
            step_refs=step_refs,
        )
    )
    return summary


# bf16-mixed here: a bf16 copy computes, its gradients are all-reduced in bf16 (the all-reduce bytes
# check counts 2 bytes per element), the fp32 masters step
BF16_MIXED = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def reference_run(model_cfg: ModelConfig, train_cfg: TrainConfig, precision: str, *, dp: int):
    """The reference of one precision: single-process training on the same global batches, fp32,
    or under this lab's bf16-mixed policy (``BF16_MIXED``: ``train_reference(mixed=...)``, one
    backward per rank's slice, the slices' bf16 gradients summed, fp32 masters and AdamW), with
    every step's gradients (``every_step_grads``)."""
    mixed = BF16_MIXED if precision == "bf16-mixed" else None
    return train_reference(model_cfg, train_cfg, dp=dp, return_grads=True, mixed=mixed)


def reference_step_grads(
    model_cfg: ModelConfig, train_cfg: TrainConfig, precision: str, run: dict, *, dp: int
) -> list[dict]:
    """Per step k, the gradients the reference of ``precision`` is handed at the weights the run
    computed step k with (``run["step_weights"][k]``, one rank's) on step k's global batch: one
    step of ``train_reference`` from those weights. A drift of the weights (AdamW, rounding) then
    cannot hide or fake a wrong gradient at a later step: only the gradient's own computation,
    averaging and handing over are compared, step after step."""
    mixed = BF16_MIXED if precision == "bf16-mixed" else None
    one_step = dataclasses.replace(train_cfg, steps=1)
    out = []
    for weights, batch in zip(run["step_weights"], data_for(train_cfg, dp)):
        model = build_model(model_cfg, dtype=DTYPES[precision])
        model.load_state_dict(weights)
        ref = train_reference(
            model_cfg,
            one_step,
            dp=dp,
            model=model,
            batches=[batch],
            return_grads=True,
            mixed=mixed,
        )
        out.append(ref.grads)
    return out


# --- the verdict ----------------------------------------------------------------------------------
RECOMPUTE_HINTS = {
    "none": "every tensor autograd saves for backward counts, except the parameters (state, "
    "counted apart): the calculator lists each one",
    "selective": "selective recomputation keeps the matmuls' and attention's outputs only "
    "(SaveMatmuls says MUST_SAVE for them) and recomputes the rest",
    "full": "full recomputation keeps only each block's input (torch.utils.checkpoint around the "
    "block) and reruns the block in backward",
}


def memory_checks(
    per_rank,
    configs,
    rows,
    refs,
    summary,
    *,
    act_tol: float,
    accum: bool = False,
    step_refs: dict,
) -> list:
    """Per precision, against that precision's reference (``refs[precision]``: ``reference_run``):
    losses, every rank's gradients after step 1, the parameters (fp32 masters) after the last step,
    and the gradients handed to the optimizer at every step against the reference's at the same
    weights (``step_refs[precision]``: ``reference_step_grads``); per configuration: the state
    bytes and the saved activations against the calculator (on every rank), the gradients'
    all-reduces call by call; recomputation changes no loss. ``accum``: the run kept fp32
    gradient-accumulation buffers (bf16-mixed)."""
    from labs.experiments.checks import Check, calls_check, compare_values, training_checks

    backend = summary["backend"]
    n = len(per_rank)
    checks = []
    seen = set()
    for i, ((precision, recompute), row) in enumerate(zip(configs, rows)):
        measured = [r[i] for r in per_rank]
        prefix = f"{precision}/{recompute}: "
        if precision not in seen:
            seen.add(precision)
            ref = refs[precision]
            mixed = precision != "fp32"
            checks += training_checks(
                losses=row["losses"],
                reference_losses=ref.losses,
                grads=[m["first_grads"] for m in measured],
                reference_grads=ref.grads,
                params=[m["params"] for m in measured],
                reference_params=ref.params,
                dtype=DTYPES[precision],
                backend=backend,
                world_size=n,
                prefix=prefix,
                first_step_hint="the loss differs at step 1: the forward (and its bf16 copy of "
                "the weights) is not the reference's",
                mixed=mixed,
            )
            grad_rule = rule("mixed_grad" if mixed else "value", DTYPES[precision], backend)
            checks.append(
                step_grads_check(
                    f"{prefix}gradients at every step",
                    [m["step_grads"] for m in measured],
                    step_refs[precision],
                    tolerance=grad_rule.rel,
                    world_size=n,
                    accum=accum and mixed,
                )
            )
        checks.append(
            _list_check(
                f"{prefix}state bytes (params, grads, optimizer)",
                [[m[k] for k in STATE_KEYS] for m in measured],
                [row["predicted"][k] for k in STATE_KEYS],
                hint="parameters, gradients and optimizer state are counted from the real "
                "tensors: bf16-mixed holds bf16 weights and gradients, fp32 masters and AdamW's "
                "two fp32 moments",
            )
        )
        acts = [m["activation_bytes"] for m in measured]
        want = row["predicted"]["activation_bytes"]
        checks.append(
            compare_values(
                f"{prefix}activation bytes",
                acts,
                [want] * n,
                tolerance=act_tol or None,
                hint=RECOMPUTE_HINTS[recompute],
            )
        )
        checks.append(
            calls_check(
                f"{prefix}all_reduce bytes per call",
                [m["comm_per_call"] for m in measured],
                [m["expected_per_call"] for m in measured],
                world_size=n,
                count_hint="data parallelism all-reduces every gradient once per step",
            )
        )
    changed = summary["recompute_changes_loss"]
    checks.append(
        Check(
            "recomputation changes no loss",
            not changed,
            "changed" if changed else "unchanged",
            "unchanged",
            where="every recompute setting, per precision",
            hint="recomputation reruns the same ops on the same inputs: the losses must be bit "
            "for bit those without it",
        )
    )
    return checks


def step_grads_check(
    name: str,
    per_rank: list[list[dict]],
    reference: list[dict],
    *,
    tolerance: float,
    world_size: int,
    accum: bool = False,
):
    """The gradients the optimizer was handed at every step, on every rank (``per_rank[r][k]``, by
    name), against the reference's at the same weights (``reference[k]``:
    ``reference_step_grads``). A first difference at step k > 1 where this run's step-k gradient
    is the reference's plus its own step k-1 gradient is a gradient left over from the step
    before, and the hint says so (``accum``: the fp32 gradient-accumulation buffer)."""
    from labs.experiments.checks import Check, compare_tensors

    worst = None
    for rank, steps in enumerate(per_rank):
        for k, (got, want) in enumerate(zip(steps, reference)):
            c = compare_tensors(
                name,
                got,
                want,
                tolerance=tolerance,
                where=f"rank {rank}, step {k + 1}",
                world_size=world_size,
                what="gradients",
            )
            if c.ok:
                worst = c if worst is None or c.measured > worst.measured else worst
                continue
            if k == 0:
                return c  # the scale-read hint of a wrong step 1 (the check after step 1's too)
            left_over = {n: steps[k][n] - steps[k - 1][n] for n in want}
            if compare_tensors(name, left_over, want, tolerance=tolerance).ok:
                what = (
                    "the fp32 gradient-accumulation buffer (Megatron's main_grad) was never zeroed"
                    " after the optimizer step: zero it (p32.grad.zero_()) once the step is taken,"
                    " so that each step's buffer holds that step's gradients only"
                    if accum
                    else "the gradients are not zeroed between steps"
                )
                hint = (
                    f"step {k + 1}'s gradients are the reference's plus this run's step {k}"
                    f" gradients: {what}"
                )
            else:
                hint = (
                    f"step 1's gradients match and step {k + 1}'s do not, at the same weights:"
                    " what reaches the optimizer at a later step is not that step's averaged"
                    " gradient (zeroed, summed over the ranks, divided by the world size, cast to"
                    " fp32 for the masters)"
                )
            return dataclasses.replace(c, hint=hint)
    if worst is None:
        return Check(name, False, "none", "every step's", hint="no gradients were recorded")
    return dataclasses.replace(worst, where=f"{len(per_rank)} ranks, {len(reference)} steps")


def _list_check(name: str, per_rank: list[list[int]], expected: list[int], *, hint: str):
    """Every rank's figures equal ``expected`` exactly; the first rank that differs is named."""
    from labs.experiments.checks import Check

    for rank, got in enumerate(per_rank):
        if got != expected:
            return Check(
                name, False, got, expected, where=f"rank {rank}", hint=hint, against="theory"
            )
    return Check(
        name, True, per_rank[0], expected, where=f"{len(per_rank)} ranks", against="theory"
    )
