"""Experiment 04: tensor (and sequence) parallelism on the course model or a ``transformers`` Llama.

    summary = run(nproc=4, sp=True, model="hf-llama", vs_torch=True)
    python -m labs.run tp --nproc 4 --sp --model hf-llama --vs-torch --json
    python -m labs.run tp --nproc 4 --async-linear --json   # the overlapped backward (§11)

Every rank (the TP group is WORLD) cuts the model built from the seed with
``apply_tensor_parallel``, runs the first step under the communication ledger (phases "forward" and
"backward") and the saved-tensor meter, then trains ``steps`` AdamW steps (foreach=False) on the
reference's global batches (all TP ranks read the same batch). Checked three ways:

* reference (single process, same seed and data, fp32, within 1e-5 relative): step 1's logits and
  every gradient (the ranks' shards concatenated along ``partition_dim``, replicated tensors
  compared on every rank), every loss, every parameter after the last step;
* theory (``labs.theory.tensor_parallel``): collectives per phase and op (calls, payload, bytes
  sent) on every rank, parameter bytes per rank, saved activation bytes per rank;
* PyTorch (``vs_torch``): DTensor ``parallelize_module`` (ColwiseParallel / RowwiseParallel, with SP
  SequenceParallel and PrepareModuleInput) and ``loss_parallel`` on the same weights and data:
  logits and losses against ours and the reference, and the median step time of both.

With ``async_linear`` the model is ``apply_async_communication``'s overlapped variant, held to the
same checks (the same collectives and bytes, call for call), plus three of its own from step 1's
backward (``labs.measure.async_collectives``): one async collective per region entrance, each
waited on, each with the weight gradients computed while it was in flight.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labs.experiments.checks import (
    Check,
    collectives_checks,
    compare_values,
    find,
    ranks_check,
    training_checks,
)
from labs.experiments.common import (
    COMM_HEADER,
    RunSummary,
    comm_row,
    course_spec,
    fill_losses,
    new_summary,
)
from labs.experiments.spec import Bench, Lab, option
from labs.experiments.tp_overlap import padded
from labs.measure import CommLedger, SavedActivations, state_bytes
from labs.measure.async_collectives import AsyncCollectives
from labs.measure.timing import StepTimer
from labs.models.transformer import ModelConfig, build_model
from labs.runtime.device import one_thread, rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.theory import memory as memory_theory
from labs.theory import tensor_parallel as theory
from labs.theory.dims import check_positive
from labs.train import (
    TrainConfig,
    compare_losses,
    data_for,
    make_optimizer,
    max_rel_diff,
    rule,
    train_reference,
)

MODELS = ("course", "hf-llama")


class LlamaWithLoss(nn.Module):
    """A ``LlamaForCausalLM`` called like the course model: ``(idx, targets) -> (logits, mean
    cross-entropy)`` on already shifted targets (HF's own ``labels=`` shifts them once more)."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, idx, targets=None):
        logits = self.hf(input_ids=idx).logits  # [B, T, V]
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def full_model(cfg: ModelConfig, model: str, seed: int) -> nn.Module:
    """The unsharded model: the course ``Transformer`` or a ``LlamaForCausalLM`` with the same
    weights."""
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not one of {MODELS}")
    course = build_model(cfg, seed)
    if model == "course":
        return course
    from labs.models.hf import to_hf_llama

    return to_hf_llama(course).train()


def reference_name(name: str, model: str) -> str:
    """The parameter name in the reference model (course names, or HF's behind
    ``LlamaWithLoss``)."""
    if model == "course":
        return name
    from labs.models.hf import hf_llama_name

    return "hf." + hf_llama_name(name)


@dataclasses.dataclass(frozen=True)
class Options:
    """The TP lab's options (``run``'s keywords, ``python -m labs.run tp``'s flags)."""

    sp: bool = option(False, "sequence parallelism too")
    async_linear: bool = option(
        False,
        "the overlapped variant: each region entrance's backward collective runs while its "
        "weight gradients are computed (apply_async_communication)",
    )
    op_time: float = option(
        0.0,
        "pad each matrix product to S seconds (sleep), as if compute were that long: leaves "
        "the cores to gloo, so an overlap shows in a --profile trace (notebook 04 §11)",
        metavar="S",
    )
    model: str = option("course", "the course model or a transformers Llama", choices=MODELS)
    seed: int = option(0)
    batch_size: int = option(8, "sequences per step (every TP rank reads all)")
    seq_len: int = option(32)
    model_cfg: ModelConfig | None = option(None, command_line=False)  # default: ModelConfig()

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        train = TrainConfig(steps=steps, batch_size=self.batch_size, seq_len=self.seq_len)
        check_args(
            self.model_cfg or ModelConfig(), nproc=nproc, sp=self.sp, model=self.model, train=train
        )
        if self.op_time < 0:
            raise ValueError(f"op_time={self.op_time} must be >= 0 (seconds; 0: no padding)")


LAB = Lab(
    name="tp",
    notebook="04_tensor_parallel",
    exercises=("tensor_parallel_comm", "tensor_parallel"),
    reference=("full_model", "LlamaWithLoss"),
    options=Options,
    ranks=4,
    small_run={"nproc": 2, "steps": 2},
    bench=(Bench(options={"sp": False}, torch="DTensor parallelize_module"),),
    profiled=True,
)


def check_args(cfg: ModelConfig, *, nproc: int, sp: bool, model: str, train: TrainConfig) -> None:
    """Every ValueError ``run`` can raise, before any process starts."""
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not one of {MODELS}")
    check_positive(nproc=nproc)
    theory.check(course_spec(cfg), tp=nproc, sp=sp, batch=train.batch_size, seq=train.seq_len)
    if train.seq_len > cfg.seq_len:
        raise ValueError(
            f"seq_len={train.seq_len} is longer than the model's rotary table ({cfg.seq_len})"
        )


# --- DTensor: torch's own tensor parallelism on the same model ------------------------------------
def torch_tensor_parallel(model: nn.Module, *, sp: bool) -> nn.Module:
    """A copy of the course model parallelised by ``torch.distributed.tensor.parallel`` over WORLD,
    the plan torchtitan uses for Llama: q/k/v, gate/up ColwiseParallel; o, down RowwiseParallel; the
    embedding RowwiseParallel; the head ColwiseParallel with its output left sharded over V (for
    ``loss_parallel``); with SP the norms SequenceParallel and the attention/MLP inputs
    redistributed from Shard(1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    model = copy.deepcopy(model)
    x_layout = Shard(1) if sp else Replicate()
    top = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=x_layout),
        "lm_head": ColwiseParallel(
            input_layouts=x_layout, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    parallelize_module(model, mesh, {**top, **({"norm": SequenceParallel()} if sp else {})})
    if model.cfg.tie_embeddings:
        # parallelize_module gave each module its own DTensor: tie them again (both are Shard(0)
        # over V, so one sharded tensor serves the lookup and the head, as in the reference)
        model.lm_head.weight = model.tok_emb.weight
    for block in model.layers:
        plan = {
            name: ColwiseParallel()
            for name in (
                "attn.q_proj",
                "attn.k_proj",
                "attn.v_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
            )
        }
        plan.update(
            {
                "attn.o_proj": RowwiseParallel(output_layouts=x_layout),
                "mlp.down_proj": RowwiseParallel(output_layouts=x_layout),
            }
        )
        if sp:
            plan.update(
                {
                    "attn_norm": SequenceParallel(),
                    "mlp_norm": SequenceParallel(),
                    "attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(block, mesh, plan)
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _scalar(t) -> float:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).item()


# --- the worker -----------------------------------------------------------------------------------
def _train(
    model, batches, cfg: TrainConfig, loss_context=None, measure: bool = False, op_time: float = 0.0
) -> dict:
    """Train ``model`` on ``batches``; step 1 measured (ledger, saved tensors, async collectives)
    when ``measure``; every matrix product padded to ``op_time`` seconds (``PaddedMatmuls``)."""
    ctx = loss_context or contextlib.nullcontext
    optimizer = make_optimizer(model.parameters(), cfg)
    out = {}
    losses = []
    timer = StepTimer()
    for step, (x, y) in enumerate(batches):
        with timer.step(), padded(op_time):
            if step == 0 and measure:
                with CommLedger() as ledger:
                    with ledger.phase("forward"), SavedActivations(exclude=model) as saved, ctx():
                        logits, loss = model(x, y)
                    with ledger.phase("backward"), ctx(), AsyncCollectives() as overlap:
                        loss.backward()
                out["comm"] = [
                    (r.op.replace("_single", ""), r.phase, r.payload_bytes, r.sent_bytes)
                    for r in ledger.records
                ]
                out["saved_bytes"] = saved.bytes
                out["async_collectives"] = overlap.summary()
            else:
                with ctx():
                    logits, loss = model(x, y)
                    loss.backward()
            if step == 0:
                out["logits"] = _local(logits).detach().clone()
                out["grads"] = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
            optimizer.step()
            if step == len(batches) - 1:
                # held at the end of a step: parameters, gradients, AdamW's moments
                out["state"] = state_bytes(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            losses.append(_scalar(loss.detach()))
        report_progress()
    out.update(
        losses=losses,
        step_time_s=timer.step_time(),
        params={n: _local(p).detach().clone() for n, p in model.named_parameters()},
    )
    return out


def tp_worker(
    full,
    cfg: TrainConfig,
    sp: bool,
    vs_torch: bool,
    async_linear: bool = False,
    op_time: float = 0.0,
) -> dict:
    """One rank: our tensor parallelism (and torch's, with ``vs_torch``) trained on the reference's
    batches; with ``async_linear`` its overlapped variant, with ``op_time`` its matrix products
    padded."""
    device = rank_device()
    full = full.to(device)  # this rank's own copy (forked, or its own process under torchrun)
    lab = exercise("tensor_parallel")
    tp_model = lab.apply_tensor_parallel(full, sequence_parallel=sp)
    if async_linear:
        tp_model = lab.apply_async_communication(tp_model)
    batches = [(x.to(device), y.to(device)) for x, y in data_for(cfg)]
    ours = _train(tp_model, batches, cfg, measure=True, op_time=op_time)
    ours["partition_dims"] = {
        n: getattr(p, "partition_dim", None) for n, p in tp_model.named_parameters()
    }
    if vs_torch:
        from torch.distributed.tensor.parallel import loss_parallel

        from labs.models.hf_convert import course_model_from

        theirs = _train(
            torch_tensor_parallel(course_model_from(full), sp=sp),
            batches,
            cfg,
            loss_context=loss_parallel,
        )
        ours["torch"] = {k: theirs[k] for k in ("logits", "losses", "step_time_s")}
    return ours


# --- comparing in the parent ----------------------------------------------------------------------
def assemble(per_rank: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Full tensors from the ranks' shards: concatenated along ``partition_dim``, rank 0's if
    replicated."""
    dims = per_rank[0]["partition_dims"]
    return {
        n: torch.cat([r[key][n] for r in per_rank], dim=d) if d is not None else per_rank[0][key][n]
        for n, d in dims.items()
    }


def worst_difference(
    per_rank: list[dict], key: str, reference: dict, model: str
) -> tuple[float, str]:
    """Largest relative difference to ``reference`` of the assembled tensors, replicated ones
    checked on every rank; returns (difference, "name (rank r)")."""
    full = assemble(per_rank, key)
    dims = per_rank[0]["partition_dims"]
    worst = (0.0, "")
    for name, tensor in full.items():
        ref = reference[reference_name(name, model)]
        candidates = (
            [(tensor, "")]
            if dims[name] is not None
            else [(r[key][name], f" (rank {i})") for i, r in enumerate(per_rank)]
        )
        for got, where in candidates:
            worst = max(worst, (max_rel_diff(got.double(), ref.double()), name + where))
    return worst


def measured_comm(records: list[tuple]) -> dict:
    return theory.summarise(
        [
            {"op": op, "phase": phase, "payload_bytes": k, "sent_bytes": sent}
            for op, phase, k, sent in records
        ]
    )


def run(
    *,
    nproc: int | None = None,
    steps: int = 5,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    **options,
) -> RunSummary:
    """Train the ``model`` ("course" or "hf-llama") tensor-parallel on ``nproc`` ranks (default
    ``LAB.ranks``; with sequence parallelism when ``sp``; overlapped,
    ``apply_async_communication``, when ``async_linear``; every matrix product of ours padded to
    ``op_time`` seconds, notebook 04 §11; the ``options``: ``Options``) and check it against the
    reference, the theory and (``vs_torch``) DTensor."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    cfg = o.model_cfg or ModelConfig()
    train = TrainConfig(steps=steps, batch_size=o.batch_size, seq_len=o.seq_len, seed=o.seed)
    full = full_model(cfg, o.model, o.seed)
    reference_model = full if o.model == "course" else LlamaWithLoss(full)
    x, _ = data_for(train)[0]
    with one_thread(), torch.no_grad():
        ref_logits = reference_model(x)
    ref = train_reference(cfg, train, model=copy.deepcopy(reference_model), return_grads=True)
    per_rank = launch(
        tp_worker,
        nproc,
        full,
        train,
        o.sp,
        vs_torch,
        o.async_linear,
        o.op_time,
        backend=backend,
        timeout=timeout,
        progress=steps * (2 if vs_torch else 1),
        desc=f"tp={nproc}{' +sp' if o.sp else ''}{' async' if o.async_linear else ''}",
    )

    spec = course_spec(cfg)
    s = new_summary(
        "tp",
        nproc=nproc,
        backend=per_rank.backend,
        steps=steps,
        model=o.model,
        sp=o.sp,
        tp=nproc,
        batch_size=o.batch_size,
        seq_len=o.seq_len,
        async_linear=o.async_linear,
        op_time_s=o.op_time,
    )
    fill_losses(s, per_rank[0]["losses"], ref.losses)
    logits = torch.cat([r["logits"] for r in per_rank], dim=-1)
    s["max_rel_logit_diff"] = max_rel_diff(logits, ref_logits)
    s["max_rel_grad_diff"], s["worst_grad"] = worst_difference(
        per_rank, "grads", ref.grads, o.model
    )
    s["max_rel_param_diff"], s["worst_param"] = worst_difference(
        per_rank, "params", ref.params, o.model
    )
    s["logits_shape_per_rank"] = list(per_rank[0]["logits"].shape)

    size = dict(tp=nproc, sp=o.sp, batch=o.batch_size, seq=o.seq_len, dtype_bytes=4)
    expected = theory.comm_summary(spec, **size)
    s["comm"] = measured_comm(per_rank[0]["comm"])
    s["theory_comm"] = expected["model"]
    s["comm_bytes_per_rank"] = [sum(c[3] for c in r["comm"]) for r in per_rank]
    s["theory_comm_bytes_per_rank"] = expected["sent_bytes_per_step"]
    params = theory.param_bytes_per_rank(spec, tp=nproc)
    s["param_bytes_per_rank"] = [r["state"]["params"] for r in per_rank]
    s["theory_param_bytes_per_rank"] = params["bytes"]
    s["state_bytes_per_rank"] = [r["state"]["total"] for r in per_rank]
    s["theory_state_bytes_per_rank"] = memory_theory.state_bytes(params["params"])["total_bytes"]
    s["saved_activation_bytes"] = [r["saved_bytes"] for r in per_rank]
    s["theory_saved_activation_bytes"] = theory.saved_activation_bytes(spec, **size)["total"]
    s["step_time_s"] = max(r["step_time_s"] for r in per_rank)
    s.add_checks(
        tp_checks(
            per_rank,
            ref,
            ref_logits,
            model=o.model,
            sp=o.sp,
            backend=per_rank.backend,
            calls=theory.collectives(spec, **size),
            tokens=o.batch_size * o.seq_len,
            async_linear=o.async_linear,
        )
    )
    if o.async_linear:
        s["async_collectives"] = per_rank[0]["async_collectives"]
        s.add_checks(async_checks(per_rank, n_layer=cfg.n_layer))
    s.add_checks(
        [
            compare_values(
                "parameter bytes per rank",
                s["param_bytes_per_rank"],
                [s["theory_param_bytes_per_rank"]] * nproc,
                world_size=nproc,
                what="parameter bytes",
                hint="each rank holds 1/tp of every sharded weight and all of the replicated ones "
                "(the norms): check which dimension each layer cuts",
            ),
            compare_values(
                "saved activation bytes per rank",
                s["saved_activation_bytes"],
                [s["theory_saved_activation_bytes"]] * nproc,
                world_size=nproc,
                what="saved bytes",
                hint="what a rank saves for backward: inside the regions its shards' activations, "
                "outside them whole ones (with SP, T/tp of them)",
            ),
        ]
    )
    if vs_torch:
        theirs = [r["torch"] for r in per_rank]
        s["torch_step_time_s"] = max(t["step_time_s"] for t in theirs)
        s["torch_losses"] = theirs[0]["losses"]
        torch_loss_diff = compare_losses(theirs[0]["losses"], ref.losses)
        s["torch_max_rel_loss_diff"] = torch_loss_diff["max_rel_loss_diff"]
        s["torch_max_rel_logit_diff_vs_ours"] = max_rel_diff(
            torch.cat([t["logits"] for t in theirs], -1), logits
        )
    return s


# --- the verdict ----------------------------------------------------------------------------------
def shards_of(per_rank: list[dict], reference: dict, model: str) -> list[dict]:
    """Each rank's expected tensors: the reference's block along ``partition_dim`` (rank r's r-th
    of tp), or the whole tensor where it is replicated, under the TP model's names."""
    n = len(per_rank)
    dims = per_rank[0]["partition_dims"]
    return [
        {
            name: reference[reference_name(name, model)]
            if d is None
            else reference[reference_name(name, model)].chunk(n, d)[r]
            for name, d in dims.items()
        }
        for r in range(n)
    ]


COMM_COUNT_HINT = (
    "the {phase} pass issued another number of {op} calls than the theory counts. Per block, "
    "attention and the MLP are each entered once (f: identity forward, all-reduce backward; with "
    "SP an all-gather forward, a reduce-scatter backward) and left once through a row-parallel "
    "layer (g: all-reduce forward, identity backward; with SP a reduce-scatter forward, an "
    "all-gather backward); outside the blocks the embedding's g, the head's f and the loss's two "
    "all-reduces (max, then the sums); with SP each norm weight's gradient is all-reduced"
)


def tp_checks(
    per_rank: list[dict],
    ref,
    ref_logits: torch.Tensor,
    *,
    model: str,
    sp: bool,
    backend: str,
    calls: list[dict],
    tokens: int,
    async_linear: bool = False,
) -> list[Check]:
    """Every rank's step-1 logits (its V/tp slice), losses, gradients after step 1 and parameters
    after the last step (its shards, by name), the collectives call by call per phase and op."""
    n = len(per_rank)
    checks = [
        ranks_check(
            "logits of step 1",
            [{"logits": r["logits"]} for r in per_rank],
            [{"logits": ref_logits.chunk(n, -1)[r]} for r in range(n)],
            tolerance=rule("value", backend=backend).rel,
            what="logits",
            hint="rank r's logits are the reference's vocabulary slice r: the forward differs "
            "(a layer cut along the wrong dim, a missing g after a row-parallel layer, or the "
            "vocab-parallel embedding looking up the wrong ids)",
        )
    ]
    checks += training_checks(
        losses=per_rank[0]["losses"],
        reference_losses=ref.losses,
        grads=[r["grads"] for r in per_rank],
        reference_grads=shards_of(per_rank, ref.grads, model),
        params=[r["params"] for r in per_rank],
        reference_params=shards_of(per_rank, ref.params, model),
        backend=backend,
        world_size=n,
        known_scales={
            float(tokens): "the vocab-parallel loss is a mean over its N = B·T tokens: its backward"
            " must divide (softmax - one_hot) by N"
        },
        first_step_hint="the loss differs at step 1: the tensor-parallel forward differs (see the "
        "logits: a shard cut along the wrong dim, a missing g, or the vocab-parallel embedding's "
        "or loss's mask of the ids a rank holds, [r·V/tp, (r+1)·V/tp))",
    )
    grads = find(checks, "gradients after step 1")
    diagnosis = grad_hint(grads.tensor, sp=sp, async_linear=async_linear)
    if not grads.ok and diagnosis:  # what this lab knows of that tensor outranks a scale's guess
        checks[checks.index(grads)] = dataclasses.replace(grads, hint=diagnosis)
    checks.append(
        Check(
            "losses equal on every rank",
            all(r["losses"] == per_rank[0]["losses"] for r in per_rank),
            "equal" if all(r["losses"] == per_rank[0]["losses"] for r in per_rank) else "differ",
            "equal",
            where=f"{n} ranks",
            hint="every rank must compute the same global loss: the vocab-parallel loss "
            "all-reduces the max, then the sums of exp and of the target logits",
        )
    )
    expected = [(c["phase"], c["op"], c["sent_bytes"]) for c in calls]
    checks += collectives_checks(
        [[(phase, op, sent) for op, phase, _, sent in r["comm"]] for r in per_rank],
        [expected] * n,
        world_size=n,
        count_hint=COMM_COUNT_HINT,
    )
    return checks


def grad_hint(name: str, *, sp: bool, async_linear: bool) -> str:
    """What a wrong gradient of ``name`` most likely means in this run ("" when nothing)."""
    if sp and name.endswith("norm.weight"):
        return (
            f"{name}: with SP a norm sees T/tp tokens, so its weight's gradient is partial and "
            "must be all-reduced over the group (sequence_parallel_norm's hook)"
        )
    if async_linear and name.endswith(COLUMN_WEIGHTS):
        return ASYNC_WEIGHT_GRAD_HINT.format(name=name)
    return ""


# The column-parallel weights, whose gradients LinearWithAsyncCommunication computes (overlapped).
COLUMN_WEIGHTS = tuple(
    f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
)
ASYNC_WEIGHT_GRAD_HINT = (
    "{name}: LinearWithAsyncCommunication's weight gradient is grad_Y_iᵀ X, from the input X "
    "saved in forward (gathered along T with SP), flattened to [B·T, in]: not from grad_X, the "
    "tensor the collective is reducing meanwhile"
)


def async_checks(per_rank: list[dict], *, n_layer: int) -> list[Check]:
    """The overlapped backward of step 1 on every rank (``labs.measure.async_collectives``): one
    async collective per region entrance (2 per block, 1 for the head), each waited on, each with
    at least one matrix product (the weight gradients) run between its launch and its wait."""
    n = len(per_rank)
    logs = [r["async_collectives"] for r in per_rank]
    entrances = 2 * n_layer + 1
    return [
        compare_values(
            "async collectives in backward",
            [len(log) for log in logs],
            [entrances] * n,
            world_size=n,
            hint="LinearWithAsyncCommunication's backward launches the all-reduce (SP: the "
            "reduce-scatter along T) of grad_X with async_op=True, once per region entrance: "
            f"2 per block and the head's, {entrances}",
        ),
        compare_values(
            "async collectives waited on",
            [sum(c["waited"] for c in log) for log in logs],
            [len(log) for log in logs],
            world_size=n,
            hint="wait on the handle (work.wait()) before returning grad_X: until then the "
            "collective may still be writing it, and the next layer would read a partial sum "
            "(on a small gloo run it usually finishes in time, so the numbers alone rarely show "
            "it)",
        ),
        compare_values(
            "weight gradients computed in flight",
            [sum(bool(c["matmuls_in_flight"]) for c in log) for log in logs],
            [len(log) for log in logs],
            world_size=n,
            hint="compute the weight gradients after launching the collective and before "
            "waiting on it: waiting first gives the same numbers, but nothing hides the "
            "collective's time (notebook 04 §11's exposed communication shows it)",
        ),
    ]


def comm_table(summary: RunSummary) -> str:
    """The step's collectives per phase and op, measured on rank 0 beside the theory's figures, as a
    table."""
    lines = [f"{'phase':9} {'op':15}{COMM_HEADER}"]
    for phase in ("forward", "backward"):
        measured = summary["comm"].get(phase, {})
        expected = summary["theory_comm"].get(phase, {})
        for op in sorted(set(measured) | set(expected)):
            lines.append(
                f"{phase:9} {op:15}" + comm_row(measured.get(op, {}), expected.get(op, {}))
            )
    return "\n".join(lines)


def headline(summary: RunSummary) -> dict:
    """A run at a glance: its options, its differences from the reference, its verdict."""
    keys = (
        "model",
        "tp",
        "sp",
        "async_linear",
        "matches_reference",
        "max_rel_logit_diff",
        "max_rel_grad_diff",
        "max_rel_loss_diff",
        "logits_shape_per_rank",
    )
    return {**{k: summary[k] for k in keys}, "passed": summary.passed}


def memory_vs_calculator(summary: RunSummary) -> dict:
    """Bytes per rank of a run (B·T tokens of the course model, fp32): measured, this lab's theory,
    and the course's memory calculator (``labs.theory.memory.memory_per_rank``, which models
    Megatron's SP: column-parallel inputs saved sequence-sharded and gathered again in backward)."""
    calc = memory_theory.memory_per_rank(
        course_spec(ModelConfig()),
        seq=summary["seq_len"],
        mbs=summary["batch_size"],
        precision="fp32",
        tp=summary["tp"],
        sp=summary["sp"],
    )
    return {
        "params": {
            "measured": summary["param_bytes_per_rank"][0],
            "theory": summary["theory_param_bytes_per_rank"],
            "calculator": calc["param_bytes"],
        },
        "saved activations": {
            "measured": summary["saved_activation_bytes"][0],
            "theory": summary["theory_saved_activation_bytes"],
            "calculator": calc["activation_bytes"],
        },
    }
