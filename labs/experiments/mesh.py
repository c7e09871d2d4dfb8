"""Experiment 08: the 4D mesh and the composed training step, checked against the single-process
reference.

    summary = run(nproc=8, dp=2, tp=2, pp=2)     # notebook 08
    summary = run(nproc=8, dp=2, tp=2, cp=2, zero=3)
    python -m labs.run mesh --nproc 8 --dp 2 --tp 2 --pp 2 --json
    groups_table(dp=2, tp=2, pp=2)                # which ranks share which group, without processes

Checks, on ``nproc`` ranks (a tiny course model, a few steps, fp32 on gloo):
* groups: the lab's ``dist.new_group`` groups equal torch's ``init_device_mesh("cpu", (dp, pp, cp,
  tp))`` groups (and its flattened ("dp", "cp") group), on every rank;
* losses: every step's global loss (mean over the last stage's dp·cp ranks) within 1e-5 relative of
  ``labs.train.train_reference`` on the same seed and global batches;
* gradients after step 1: what ZeRO averaged over dp·cp, reassembled from the TP shards and the PP
  stages, equals the reference's gradient by name (AdamW divides each gradient by its own size, so a
  gradient off by a constant factor would leave the losses unchanged: only this check sees it);
* positions (with CP): the rotary positions each CP rank's model is called with are those of its
  zig-zag tokens (chunks c and 2·cp−1−c of 0..T−1, notebook 06);
* bytes: each rank's ledger, split by the group each collective ran on, equals each lab's theory:
  tp ``labs.theory.tensor_parallel.collectives``, cp
  ``labs.theory.context_parallel.ring_bytes_per_rank``, pp one activation [B/dp/M, T, H] per
  micro-batch per direction a stage feeds, dp_cp ``labs.theory.zero.comm_bytes``; state bytes held
  equal ``labs.theory.zero.held_bytes``.
"""

from __future__ import annotations

import importlib
import statistics
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.experiments.common import RunSummary, course_spec, fill_losses, new_summary
from labs.experiments.spec import Bench, Lab, option
from labs.measure import CommLedger, SavedActivations
from labs.measure.timing import StepTimer
from labs.models.transformer import ModelConfig
from labs.runtime.device import rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress
from labs.runtime.rank import lower_gloo_loop_priority
from labs.theory import context_parallel as cp_theory
from labs.theory import tensor_parallel as tp_theory
from labs.theory import zero as zero_theory
from labs.theory.comm import all_gather_bytes
from labs.theory.dims import AXES, ParallelDims, check_positive
from labs.theory.pipeline import p2p_bytes_per_rank
from labs.train import TrainConfig, data_for, max_rel_diff, train_reference

AXIS_NAMES = ("tp", "cp", "pp", "dp_cp")


def model_config(layers: int = 2) -> ModelConfig:
    """The composed lab's model: 8 query / 4 key-value heads of 4 dims (TP up to 4), F = 64, V =
    256."""
    return ModelConfig(n_layer=layers, n_embd=32, n_head=8, n_kv_head=4, ffn_hidden=64, seq_len=32)


def groups_table(**degrees) -> dict[str, list[list[int]]]:
    """Every group of the mesh by name (tp, cp, pp, dp, dp_cp), from the lab's ``group_ranks``."""
    lab = exercise("mesh")
    dims = ParallelDims(**degrees)
    return {name: lab.group_ranks(dims, axes) for name, axes in lab.GROUPS.items()}


def axis_of(group, mesh) -> str:
    """The mesh axis (tp, cp, pp, dp_cp; "dp" for the drawn dp group) a process group is, else
    "world"."""
    return next((name for name, g in mesh.groups.items() if g is not None and g is group), "world")


def calls_by_axis(ledger: CommLedger, mesh) -> list[tuple[str, str, float]]:
    """(axis, op, bytes sent) of every collective and send this rank issued (receives left out)."""
    return [
        (
            axis_of(group, mesh),
            r.op.replace("_single", "").replace("_into_tensor", ""),
            r.sent_bytes,
        )
        for group, r in zip(ledger.groups, ledger.records)
        if r.op not in ("recv", "irecv")
    ]


def sent_by_axis(ledger: CommLedger, mesh) -> dict[str, float]:
    """Bytes this rank sent on each mesh axis (tp, cp, pp, dp_cp), from the group of each
    collective."""
    named = [(g, name) for name, g in mesh.groups.items() if g is not None and name != "dp"]
    out = dict.fromkeys(AXIS_NAMES, 0.0)
    for group, sent in ledger.sent_bytes_by_group():
        axis = next((name for g, name in named if g is group), "world")
        out[axis] = out.get(axis, 0.0) + sent
    return out


class GradProbe:
    """Stands in for the composed optimizer: after its first ``step`` keeps the gradient it
    averaged, this rank's shard of every unit (ZeRO) or every ``.grad`` (plain AdamW); ``gathered``
    rebuilds whole (TP-local) gradients by name from the shards with an all-gather over dp_cp
    (harness traffic, run after the ledger closes). ``held``: the training state's bytes at the last
    step's peak, with the gradients complete, just before the optimizer runs."""

    def __init__(self, inner, module):
        self.inner = inner
        self.module = module
        self.shards = None
        self.grads = None
        self.held = None

    def step(self):
        from labs.experiments.zero import grad_shards, held_bytes

        self.held = held_bytes(self.module, self.inner)["total"]
        sharded = bool(grad_shards(self.module, self.inner))
        if not sharded and self.grads is None:
            self.grads = {
                n: p.grad.detach().clone()
                for n, p in self.module.named_parameters()
                if p.grad is not None
            }
        self.inner.step()
        if sharded and self.shards is None:
            self.shards = [(u, g.detach().clone()) for u, g in grad_shards(self.module, self.inner)]

    def zero_grad(self):
        self.inner.zero_grad()

    def gathered(self, group) -> dict[str, torch.Tensor]:
        if self.grads is not None:
            return self.grads
        return self._whole(self.shards, group)

    def gathered_params(self, *, zero3: bool) -> dict[str, torch.Tensor]:
        """Whole (TP-local) parameters by name, now: under ZeRO-3 (``zero3``) gathered over the
        units' group with the ZeRO module's public ``summon_full_params``, else the module's own
        (whole on every rank)."""
        if not zero3:
            return {n: p.detach().clone() for n, p in self.module.named_parameters()}
        with exercise("zero").summon_full_params(self.module):
            return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def _whole(self, shards, group) -> dict[str, torch.Tensor]:
        # the group the sharded optimizer averaged over (dp_cp, unless the composition chose
        # another)
        group = getattr(self.inner, "group", group)
        names = {p: n for n, p in self.module.named_parameters()}
        out = {}
        for u, shard in shards:
            flat = torch.empty(u.padded, dtype=shard.dtype, device=shard.device)
            dist.all_gather_single(flat, shard.contiguous(), group=group)
            out.update({names[p]: v.clone() for p, v in zip(u.params, u.views(flat))})
        return out


def torch_mesh_ranks(dims: ParallelDims) -> dict[str, list[int]]:
    """This rank's groups in torch's own ``init_device_mesh`` with the same (dp, pp, cp, tp)
    order."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        rank_device().type, tuple(dims.degrees[a] for a in AXES), mesh_dim_names=AXES
    )
    out = {a: dist.get_process_group_ranks(mesh.get_group(a)) for a in AXES if dims.degrees[a] > 1}
    if dims.dp * dims.cp > 1:
        out["dp_cp"] = dist.get_process_group_ranks(mesh["dp", "cp"]._flatten("dp_cp").get_group())
    return out


def zigzag_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The rotary positions of CP rank ``rank``'s tokens under the zig-zag split: chunks ``rank``
    and 2·cp−1−``rank`` of the 2·cp chunks of 0..T−1 (notebook 06), in that order."""
    size = seq_len // (2 * cp)
    return [i for c in (rank, 2 * cp - 1 - rank) for i in range(c * size, (c + 1) * size)]


def record_positions(module: torch.nn.Module) -> tuple[list, object]:
    """(a list that collects the ``positions`` of each call of ``module``, as a list of ints or
    None when the call passed none; the hook's handle): what the learner's step fed the model."""
    seen = []

    def hook(_, args, kwargs):
        positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
        seen.append(None if positions is None else positions.tolist())

    return seen, module.register_forward_pre_hook(hook, with_kwargs=True)


def worker(
    degrees: dict, model_cfg: ModelConfig, cfg: TrainConfig, zero: int, microbatches: int | None
) -> dict:
    lab = exercise("mesh")
    dims = lab.check_mesh(world_size=dist.get_world_size(), **degrees)
    mesh = lab.build_mesh(dims)
    torch_ranks = torch_mesh_ranks(dims)
    lower_gloo_loop_priority()  # the groups just built each have a gloo loop thread
    c = lab.compose(model_cfg, mesh, cfg, zero=zero, microbatches=microbatches)
    inner = c.optimizer
    probe = GradProbe(inner, c.module)
    c.optimizer = probe
    ledger = CommLedger()
    losses = []
    timer = StepTimer()
    # saved activations: one peak per step without PP (1F1B's changes with the schedule)
    saved = SavedActivations(exclude=c.module) if dims.pp == 1 else nullcontext()
    positions, hook = record_positions(c.module) if dims.pp == 1 else ([], None)
    for step, (x, y) in enumerate(data_for(cfg, dims.dp)):
        measured = ledger if step == 0 else nullcontext()
        meter = saved if step == 0 else nullcontext()
        with timer.step(), measured, meter:
            losses.append(lab.train_step(c, x, y))
        report_progress()
    if hook is not None:
        hook.remove()
    units = [u for u, _ in probe.shards or []]
    if units:
        numels = [u.numel for u in units]
        theory_held = zero_theory.held_bytes(numels, stage=zero, dp=mesh.size("dp_cp"))["total"]
    else:
        numels = [sum(p.numel() for p in c.module.parameters())]
        theory_held = 16 * numels[0]  # fp32 parameters and gradients, AdamW's two moments
    grads = probe.gathered(mesh.groups["dp_cp"])  # collective over dp_cp: every rank takes part
    params = probe.gathered_params(zero3=zero == 3 and mesh.size("dp_cp") > 1)
    # the others hold the same averaged gradient
    keep = mesh.coords["dp"] == 0 and mesh.coords["cp"] == 0
    return {
        "rank": mesh.rank,
        "coords": mesh.coords,
        "ranks": mesh.ranks,
        "torch_ranks": torch_ranks,
        "losses": losses,
        "grads": grads if keep else None,
        "params": params if keep else None,
        "sent_by_axis": sent_by_axis(ledger, mesh),
        "calls": calls_by_axis(ledger, mesh),
        "unit_numels": numels,
        "layers": [int(k) for k in getattr(c.module, "layers", {}).keys()] if dims.pp > 1 else None,
        "microbatches": c.microbatches,
        "held": probe.held,
        "theory_held": theory_held,
        "activation_bytes": getattr(saved, "bytes", None),
        "positions": positions[0] if positions else "no forward seen",
        "step_time_s": timer.step_time(),
    }


def theory_bytes(
    r: dict, dims: ParallelDims, model_cfg: ModelConfig, cfg: TrainConfig, zero: int
) -> dict:
    """Bytes rank ``r`` should send per step along each axis, from each lab's own theory."""
    spec = course_spec(model_cfg)
    b = cfg.batch_size // dims.dp
    T = cfg.seq_len
    m = r["microbatches"]
    out = dict.fromkeys(AXIS_NAMES, 0.0)
    p = r["coords"]["pp"]
    first = p == 0
    last = p == dims.pp - 1
    if dims.tp > 1 and dims.pp == 1:
        # every collective of the tensor-parallel model, SP, T/cp tokens
        out["tp"] = sum(
            x["sent_bytes"]
            for x in tp_theory.collectives(spec, tp=dims.tp, sp=True, batch=b, seq=T // dims.cp)
        )
    elif dims.tp > 1:
        # a stage's share, no SP; the head gathers whole logits instead of the vocab-parallel loss
        calls = tp_theory.collectives(spec, tp=dims.tp, sp=False, batch=b // m, seq=T)
        mine = [
            x
            for x in calls
            if any(x["where"].startswith(f"layers.{i}.") for i in r["layers"])
            or (first and x["where"] == "tok_emb")
            or (last and x["where"] == "lm_head input")
        ]
        gather = all_gather_bytes(b // m * T * model_cfg.vocab_size * 4, dims.tp) if last else 0.0
        out["tp"] = m * (sum(x["sent_bytes"] for x in mine) + gather)
    if dims.cp > 1:
        kv = cp_theory.kv_bytes(
            batch=b,
            seq_len=T,
            n_kv_head=model_cfg.n_kv_head // dims.tp,
            head_dim=model_cfg.head_dim,
        )
        out["cp"] = model_cfg.n_layer * cp_theory.ring_bytes_per_rank(cp=dims.cp, kv=kv)["total"]
    if dims.pp > 1:  # activations on, gradients back: [B/dp, T, H] per direction a stage feeds
        out["pp"] = p2p_bytes_per_rank(
            "1f1b", dims.pp, p, batch=b, seq_len=T, hidden=model_cfg.n_embd
        )
    if dims.dp * dims.cp > 1:
        zero_comm = zero_theory.comm_bytes(r["unit_numels"], stage=zero, dp=dims.dp * dims.cp)
        out["dp_cp"] = zero_comm["total"]
    return out


def assemble_grads(per_rank: list[dict], reference: dict) -> dict[str, torch.Tensor]:
    """Whole gradients by name from the ranks with dp = cp = 0: TP shards joined along the dimension
    where their shape differs from the reference's, in tp order; replicated ones taken from tp =
    0."""
    out = {}
    for name, ref in reference.items():
        shards = sorted(
            (
                (r["coords"]["tp"], r["grads"][name])
                for r in per_rank
                if r["grads"] is not None and name in r["grads"]
            ),
            key=lambda t: t[0],
        )
        if not shards:
            continue
        local = shards[0][1]
        dims = [i for i, (a, b) in enumerate(zip(local.shape, ref.shape)) if a != b]
        out[name] = torch.cat([g for _, g in shards], dim=dims[0]) if dims else local
    return out


def warm_imports() -> None:
    """Import here, once, what every forked rank would otherwise import by itself (seconds each on 2
    cores): the labs and torch's device mesh. (``launch`` itself preloads ``torch._dynamo``.)"""
    for name in ("tensor_parallel", "context_parallel", "pipeline_parallel", "zero"):
        exercise(name)
    for module in ("torch.distributed.device_mesh", "labs.experiments.zero"):
        importlib.import_module(module)


@dataclass(frozen=True)
class Options:
    """The composed lab's options (``run``'s keywords, ``python -m labs.run mesh``'s flags)."""

    dp: int = option(1, "dp degree (the product is --nproc)")
    tp: int = option(1, "tp degree (the product is --nproc)")
    pp: int = option(1, "pp degree (the product is --nproc)")
    cp: int = option(1, "cp degree (the product is --nproc)")
    zero: int = option(1, "ZeRO stage over dp x cp (1 with PP)", choices=(1, 2, 3))
    microbatches: int | None = option(None, "PP micro-batches per step (default 2*pp)")
    layers: int = option(2, "transformer blocks (pp must not exceed it)")
    gpus_per_node: int | None = option(None, "refuse a TP group wider than a node")

    def mesh(self, nproc: int, steps: int):
        """The mesh's ``ParallelDims``, judged by the exercise (``check_mesh``, then
        ``check_composition`` with the lab's model and batch)."""
        lab = exercise("mesh")
        dims = lab.check_mesh(
            world_size=nproc,
            gpus_per_node=self.gpus_per_node,
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
        )
        lab.check_composition(
            lab.Mesh(dims, 0),
            model_config(self.layers),
            TrainConfig(steps=steps, batch_size=8, seq_len=32),
            zero=self.zero,
            microbatches=self.microbatches or (2 * self.pp if self.pp > 1 else 1),
        )
        return dims

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        check_positive(steps=steps, layers=self.layers)
        self.mesh(nproc, steps)


def bench_mesh(nproc: int) -> dict:
    """The bench's mesh on ``nproc`` ranks: DP x TP2 when it can, else DP alone."""
    return {"dp": nproc // 2, "tp": 2} if nproc % 2 == 0 else {"dp": nproc}


LAB = Lab(
    name="mesh",
    notebook="08_composing_4d",
    exercises=("mesh",),
    builds_on=("zero", "tensor_parallel", "pipeline_parallel", "context_parallel"),
    options=Options,
    ranks=8,
    small_run={"nproc": 2, "steps": 2, "tp": 2},
    bench=(Bench(options=bench_mesh),),
    profiled=True,
)


def run(
    *,
    nproc: int | None = None,
    steps: int = 3,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    **options,
) -> RunSummary:
    """Train the composed model ``steps`` steps on a dp x tp x pp x cp mesh of ``nproc`` ranks
    (default ``LAB.ranks``; the ``options``: ``Options``) and check it (see the module docstring).
    ``gpus_per_node`` checks that TP groups can be placed inside nodes. ``vs_torch`` is accepted
    for the common interface: torch's ``init_device_mesh`` is always compared."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    dims = o.mesh(nproc, steps)
    model_cfg = model_config(o.layers)
    cfg = TrainConfig(steps=steps, batch_size=8, seq_len=32)
    warm_imports()
    per_rank = launch(
        worker,
        nproc,
        dims.degrees,
        model_cfg,
        cfg,
        o.zero,
        o.microbatches,
        backend=backend,
        timeout=timeout,
        progress=steps,
        desc=f"mesh dp{o.dp} tp{o.tp} pp{o.pp} cp{o.cp}",
    )
    ref = train_reference(model_cfg, cfg, dp=o.dp, return_grads=True)
    s = new_summary(
        "mesh",
        nproc=nproc,
        backend=per_rank.backend,
        steps=steps,
        degrees=dims.degrees,
        zero=o.zero,
        microbatches=per_rank[0]["microbatches"],
        layers=o.layers,
    )
    last = [r for r in per_rank if r["coords"]["pp"] == o.pp - 1 and r["coords"]["tp"] == 0]
    fill_losses(
        s, [statistics.fmean(r["losses"][i] for r in last) for i in range(steps)], ref.losses
    )
    grads = assemble_grads(per_rank, ref.grads)
    diffs = {n: max_rel_diff(g.double(), ref.grads[n].double()) for n, g in grads.items()}
    worst = max(diffs, key=diffs.get)
    theory = [theory_bytes(r, dims, model_cfg, cfg, o.zero) for r in per_rank]
    s.update(
        groups=groups_table(**dims.degrees),
        rank_coords=[r["coords"] for r in per_rank],
        grads_compared=len(grads),
        max_rel_grad_diff=diffs[worst],
        worst_grad=worst,
        comm_bytes_by_axis=[r["sent_by_axis"] for r in per_rank],
        theory_comm_bytes_by_axis=theory,
        comm_bytes_per_rank=[sum(r["sent_by_axis"].values()) for r in per_rank],
        theory_comm_bytes_per_rank=[sum(t.values()) for t in theory],
        state_bytes_per_rank=[r["held"] for r in per_rank],
        theory_state_bytes_per_rank=[r["theory_held"] for r in per_rank],
        activation_bytes_per_rank=[r["activation_bytes"] for r in per_rank],
        step_time_s=max(r["step_time_s"] for r in per_rank),
    )
    s.add_checks(mesh_checks(per_rank, ref, s, dims=dims, model_cfg=model_cfg, cfg=cfg))
    return s


# --- the verdict ----------------------------------------------------------------------------------
def local_reference(reference: dict, local: dict | None, tp: int, t: int) -> dict | None:
    """The reference's tensors as rank (tp coordinate ``t``) holds them: its TP block where the
    shapes differ (along that dimension, tp order), the whole tensor where replicated."""
    if local is None:
        return None
    out = {}
    for name, got in local.items():
        ref = reference[name]
        dims = [i for i, (a, b) in enumerate(zip(got.shape, ref.shape)) if a != b]
        out[name] = ref.chunk(tp, dims[0])[t] if dims else ref
    return out


MESH_GROUP_HINT = (
    "a group holds the ranks whose coordinates differ only along its own axes: two ranks share the "
    "tp group when their dp, pp and cp coordinates agree (ParallelDims.coords), listed in "
    "increasing rank"
)


def mesh_checks(per_rank, ref, s: RunSummary, *, dims, model_cfg, cfg) -> list:
    """Groups against torch's device mesh, losses, gradients after step 1 and parameters after the
    last step (every rank with dp = cp = 0, its TP shard and its stage, by name), bytes on every
    axis (per call for tp, cp and pp), nothing on the world group, state."""
    from labs.experiments.checks import Check, collectives_checks, compare_values, training_checks

    n = len(per_rank)
    bad = [
        r["rank"]
        for r in per_rank
        if {k: r["ranks"][k] for k in r["torch_ranks"]} != r["torch_ranks"]
    ]
    checks = [
        Check(
            "groups equal torch's init_device_mesh",
            not bad,
            "differ on rank " + str(bad[0]) if bad else "equal",
            "equal",
            where=f"{n} ranks" + (f": {per_rank[bad[0]]['ranks']}" if bad else ""),
            hint=MESH_GROUP_HINT,
            against="torch",
        )
    ]
    positions = positions_check(per_rank, dims, cfg.seq_len)
    # the cause the run measured, when there is one: the positions a CP rank's model was given
    cause = positions.hint if positions is not None and not positions.ok else ""
    checks += training_checks(
        losses=s["losses"],
        reference_losses=ref.losses,
        grads=[r["grads"] for r in per_rank],
        reference_grads=[
            local_reference(ref.grads, r["grads"], dims.tp, r["coords"]["tp"]) or {}
            for r in per_rank
        ],
        params=[r["params"] for r in per_rank],
        reference_params=[
            local_reference(ref.params, r["params"], dims.tp, r["coords"]["tp"]) or {}
            for r in per_rank
        ],
        backend=s["backend"],
        world_size=dims.dp * dims.cp,
        known_scales={
            float(dims.dp * dims.cp): "ZeRO must average (not sum) the gradients over dp_cp",
        }
        if dims.dp * dims.cp > 1
        else None,
        first_step_hint=cause
        or "the composed model's loss differs at step 1: each DP rank takes its own "
        "B/dp rows of the global batch, CP its zig-zag tokens, and the layers are the earlier "
        "labs' (TP with SP without PP; with PP, whole logits from the head)",
        grad_hint=cause
        or "the gradients of the composed model differ: ZeRO averages them over dp_cp, the "
        "ranks that hold the same weights (dp and cp), and only there",
    )
    if positions is not None:
        checks.append(positions)
    holders = {n_ for r in per_rank if r["grads"] is not None for n_ in r["grads"]}
    checks.append(
        Check(
            "every gradient assembled",
            holders == set(ref.grads),
            len(holders),
            len(ref.grads),
            where="dp = cp = 0 ranks",
            hint="some parameters are on no stage or got no gradient",
            against="reference",
        )
    )
    theory = s["theory_comm_bytes_by_axis"]
    for axis in AXIS_NAMES:
        checks.append(
            compare_values(
                f"bytes sent on the {axis} group",
                [m.get(axis, 0.0) for m in s["comm_bytes_by_axis"]],
                [t[axis] for t in theory],
                tolerance=1e-9,
                world_size=n,
                what="bytes",
                hint=f"the {axis} axis carries another volume than its lab's theory: is each "
                "collective issued on its own group (tp, cp, pp, dp_cp)?",
            )
        )
    checks.append(
        compare_values(
            "bytes sent on the world group",
            [m.get("world", 0.0) for m in s["comm_bytes_by_axis"]],
            [0.0] * n,
            hint="every collective of the composed step runs on one axis's group, none on the "
            "default (world) group or the drawn dp group: gradients over dp_cp",
        )
    )
    expected = [expected_calls(r, dims, model_cfg, cfg) for r in per_rank]
    measured = [
        [(axis, op, b) for axis, op, b in r["calls"] if axis in ("tp", "cp", "pp")]
        for r in per_rank
    ]
    checks += collectives_checks(
        measured,
        expected,
        world_size=n,
        count_hint="the {phase} group carries another number of {op} calls than its lab's "
        "theory (tp: SP's all-gathers and reduce-scatters without PP, all-reduces with PP)",
    )
    checks.append(
        compare_values(
            "state bytes per rank",
            s["state_bytes_per_rank"],
            s["theory_state_bytes_per_rank"],
            hint="ZeRO's shards over dp_cp of the rank's TP shard of its stage",
        )
    )
    return checks


def positions_check(per_rank: list[dict], dims, seq_len: int):
    """With CP (and no PP): the rotary positions each rank's model was called with at step 1
    against its zig-zag tokens' (``zigzag_positions``); None without CP. A failure names what the
    model got: no positions (it then numbers its T/cp tokens from 0), or others."""
    from labs.experiments.checks import Check

    if dims.cp == 1 or dims.pp > 1:
        return None
    name = "CP positions fed to the model"
    for r in per_rank:
        c = r["coords"]["cp"]
        want = zigzag_positions(seq_len, dims.cp, c)
        got = r["positions"]
        if got == want:
            continue
        if got is None or got == list(range(len(want))):
            hint = (
                f"rank {r['rank']} (cp {c}) called its model without its tokens' positions, so the"
                f" rotary embedding numbered its T/cp tokens 0..{len(want) - 1} as if they opened"
                f" the sequence; they are zig-zag chunks {c} and {2 * dims.cp - 1 - c}, at"
                f" positions {want[0]}.. and {want[len(want) // 2]}..: pass shard_inputs'"
                " positions on (module(tokens, targets, positions))"
            )
        elif isinstance(got, list) and sorted(got) == sorted(want):
            hint = (
                f"rank {r['rank']} (cp {c}) gave its model its tokens' positions in another order"
                " than the tokens: split the positions exactly as the tokens (shard_inputs)"
            )
        else:
            hint = (
                f"rank {r['rank']} (cp {c}) gave its model the positions of other tokens than it"
                f" holds: its tokens are zig-zag chunks {c} and {2 * dims.cp - 1 - c} of the"
                " sequence (shard_inputs splits tokens, targets and positions alike)"
            )
        shown = got if not isinstance(got, list) else got[:4] + (["..."] if len(got) > 4 else [])
        return Check(
            name,
            False,
            shown,
            want[:4] + ["..."],
            where=f"rank {r['rank']} (cp {c}), step 1",
            hint=hint,
            against="theory",
        )
    return Check(name, True, "zig-zag", "zig-zag", where=f"{len(per_rank)} ranks", against="theory")


def expected_calls(r: dict, dims, model_cfg, cfg) -> list[tuple[str, str, float]]:
    """(axis, op, bytes) of every tp, cp and pp call rank ``r`` should issue in a step."""
    spec = course_spec(model_cfg)
    b = cfg.batch_size // dims.dp
    T = cfg.seq_len
    m = r["microbatches"]
    out = []
    p = r["coords"]["pp"]
    if dims.tp > 1 and dims.pp == 1:
        calls = tp_theory.collectives(spec, tp=dims.tp, sp=True, batch=b, seq=T // dims.cp)
        out += [("tp", x["op"], x["sent_bytes"]) for x in calls]
    elif dims.tp > 1:
        calls = tp_theory.collectives(spec, tp=dims.tp, sp=False, batch=b // m, seq=T)
        mine = [
            x
            for x in calls
            if any(x["where"].startswith(f"layers.{i}.") for i in r["layers"])
            or (p == 0 and x["where"] == "tok_emb")
            or (p == dims.pp - 1 and x["where"] == "lm_head input")
        ]
        out += [("tp", x["op"], x["sent_bytes"]) for x in mine] * m
        if p == dims.pp - 1:  # the head's whole logits
            gather = all_gather_bytes(b // m * T * model_cfg.vocab_size * 4, dims.tp)
            out += [("tp", "all_gather", gather)] * m
    if dims.cp > 1:
        kv = cp_theory.kv_bytes(
            batch=b,
            seq_len=T,
            n_kv_head=model_cfg.n_kv_head // dims.tp,
            head_dim=model_cfg.head_dim,
        )
        out += [("cp", "isend", kv / dims.cp)] * (3 * (dims.cp - 1) * model_cfg.n_layer)
    if dims.pp > 1:
        message = b // m * T * model_cfg.n_embd * 4
        directions = (p < dims.pp - 1) + (p > 0)
        out += [("pp", "isend", float(message))] * (directions * m)
    return out


# The rule of thumb, one row per parallelism: what it splits, what that saves, what it costs, when
# to use it.
RULES = {
    "dp": (
        "the batch; ZeRO-3/FSDP also shards params, grads, optimizer",
        "state / N (ZeRO-3); activations / N",
        "3·Ψ per step (ZeRO-3), 2·Ψ (DDP, ZeRO-1/2): overlaps backward",
        "always first: any model that fits",
    ),
    "tp": (
        "each layer's weights and (with SP) activations",
        "weights and activations / N",
        "4 collectives of B·T·H per layer per micro-batch: needs NVLink",
        "a layer too big for a GPU; in a node",
    ),
    "pp": (
        "the layers",
        "weights / N (activations: 1F1B holds N micro-batches)",
        "one B·T·H activation per micro-batch per boundary; idle bubble",
        "a model too big for a node; across nodes",
    ),
    "cp": (
        "the sequence",
        "activations / N",
        "K/V around a ring per layer: overlaps attention",
        "long sequences (32K and up)",
    ),
}


def compare_axes(*, steps: int = 2, timeout: float = 120.0) -> list[dict]:
    """Each parallelism alone at degree 2 (DP with ZeRO-3), and one rank for reference, on the
    composed lab's model: per rank the training state at its peak, the activations one step saves
    (not with PP: 1F1B holds a varying number of micro-batches), bytes sent per step by axis, step
    time, and whether it matched the reference."""
    rows = []
    for axis in ("none", "dp", "tp", "pp", "cp"):
        kw = {} if axis == "none" else {axis: 2}
        s = run(
            nproc=1 if axis == "none" else 2,
            steps=steps,
            timeout=timeout,
            zero=3 if axis == "dp" else 1,
            **kw,
        )
        rows.append(
            {
                "axis": axis,
                "state_bytes": max(s["state_bytes_per_rank"]),
                "activation_bytes": max(a or 0 for a in s["activation_bytes_per_rank"]) or None,
                "sent_bytes": {k: v for k, v in s["comm_bytes_by_axis"][0].items() if v},
                "step_time_s": s["step_time_s"],
                "correct": s.passed,  # every check of the run's verdict
            }
        )
    return rows


def which_parallelism_table(rows: list[dict]) -> str:
    """The "which parallelism should I use" table (Markdown): ``RULES`` beside what ``compare_axes``
    measured (memory per rank as a share of one rank's, kB sent per rank per step, on which
    group)."""
    base = rows[0]
    names = {
        "dp": "DP (ZeRO-3 / FSDP)",
        "tp": "TP (+ SP)",
        "pp": "PP (1F1B)",
        "cp": "CP (ring attention)",
    }
    header = (
        "parallelism",
        "splits",
        "memory saving",
        "communication cost",
        "best for",
        "measured here: 2 ranks vs 1",
    )
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---|---|---|"]
    for r in rows[1:]:
        splits, saves, costs, best = RULES[r["axis"]]
        act = (
            f"activations {r['activation_bytes'] / base['activation_bytes']:.2f}x"
            if r["activation_bytes"]
            else "activations n/a (1F1B)"
        )
        sent = ", ".join(f"{v / 1e3:.0f} kB on {k}" for k, v in r["sent_bytes"].items())
        measured = (
            f"state {r['state_bytes'] / base['state_bytes']:.2f}x, {act}; sends {sent} per step"
        )
        lines.append(f"| {names[r['axis']]} | {splits} | {saves} | {costs} | {best} | {measured} |")
    return "\n".join(lines)


def report(s: RunSummary) -> str:
    """A mesh run in words: the layout, losses against the reference step by step, the gradient
    check, the groups against torch's, and bytes sent per rank per step by group (measured, then
    theory)."""
    d = s["degrees"]
    ok = s["matches_reference"]
    groups_ok = s.check("groups equal torch's init_device_mesh").ok
    bytes_ok = all(s.check(f"bytes sent on the {a} group").ok for a in (*AXIS_NAMES, "world"))
    lines = [
        f"DP={d['dp']} TP={d['tp']} PP={d['pp']} CP={d['cp']} (ZeRO-{s['zero']},"
        f" {s['microbatches']} micro-batch(es) per DP rank) on {s['nproc']} {s['backend']} ranks:"
        f" {'matches' if ok else 'DOES NOT MATCH'} the reference",
        f"{'step':>4}  {'loss':>10}  {'reference':>10}  {'rel. diff':>9}",
    ]
    for i, (a, b) in enumerate(zip(s["losses"], s["reference_losses"]), 1):
        lines.append(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b) / abs(b):>9.1e}")
    lines += [
        f"gradients after step 1: {s['grads_compared']} tensors by name, max relative difference "
        f"{s['max_rel_grad_diff']:.1e} ({s['worst_grad']})",
        f"groups equal torch's init_device_mesh on every rank: {groups_ok}",
        f"bytes sent per rank per step, measured (theory), equal: {bytes_ok}",
        f"{'rank':>4}  {'dp pp cp tp':<12}" + "".join(f"{a:>20}" for a in AXIS_NAMES),
    ]
    for rank, (c, m, t) in enumerate(
        zip(s["rank_coords"], s["comm_bytes_by_axis"], s["theory_comm_bytes_by_axis"])
    ):
        cells = "".join(f"{f'{m[a]:,.0f} ({t[a]:,.0f})':>20}" for a in AXIS_NAMES)
        lines.append(f"{rank:>4}  {c['dp']:>2} {c['pp']:>2} {c['cp']:>2} {c['tp']:>2}  {cells}")
    lines.append(
        f"state bytes per rank {s['state_bytes_per_rank']},"
        f" theory equal: {s.check('state bytes per rank').ok}"
    )
    return "\n".join(lines)
