"""Experiment 11: the vision-language model trained three ways, against the reference, the theory
and the clock.

    summary = run(nproc=4, mode="pp", split=(0, 2, 1, 1))      # notebook 11
    python -m labs.run multimodal --mode pp --nproc 4 --split 0,2,1,1 --json
    python -m labs.run multimodal --mode dp --nproc 2 --zero 3 --json
    python -m labs.run multimodal --mode tp --nproc 4 --json

Modes (``labs/multimodal.py``, which reuses notebooks 02-05's exercises):
* ``pp``: the encoder on stage 0 (``split``: decoder layers per stage, stage 0 included), notebook
  05's 1F1B;
* ``dp``: the whole model on every rank, notebook 02's bucketed DDP or (``zero`` 1-3) notebook 03's
  ZeRO;
* ``tp``: notebook 04's tensor-parallel decoder, the encoder and projector replicated.

Checked, every mode: every step's loss (the last stage's, the ranks' mean for dp) against the
single-process run on the same global batches (``labs.train.train_multimodal_reference``, fp32, 1e-5
relative); step 1's gradients by name (replicated ones on every rank); bytes each rank sends (the
ledger) and bytes of state it holds against ``labs.theory``; for tp, that the encoder replicas stay
bit-identical with no communication. ``vs_torch`` (dp only): torch's ``DistributedDataParallel`` on
the same model and data, losses and step time.

The workers that run on the ranks are in ``labs.experiments.multimodal_workers``; the model sizes,
option checks and reference in ``labs.experiments.multimodal_setup``. Measuring the imbalance
(``imbalance``: per-stage times and the bubble, per split) is
``labs.experiments.multimodal_timeline``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from labs.experiments.common import RunSummary, fill_losses, new_summary

# SIZES and specs are imported from here by notebook 11 and labs.widgets.multimodal too
from labs.experiments.multimodal_setup import (
    MODES,
    SIZES,
    check_args,
    reference_run,
    specs,
)
from labs.experiments.multimodal_timeline import measure_timelines
from labs.experiments.multimodal_workers import dp_worker, pp_worker, tp_worker
from labs.experiments.spec import Bench, Lab, ints, option
from labs.models.vision import MultimodalConfig, build_multimodal
from labs.runtime.launcher import launch
from labs.theory import multimodal as theory
from labs.theory import zero as zero_theory
from labs.theory.comm import all_reduce_bytes
from labs.theory.memory import param_counts_per_rank
from labs.theory.memory import state_bytes as theory_state_bytes
from labs.theory.overlap import MiB, bucket_layout
from labs.theory.pipeline import p2p_bytes_per_rank
from labs.theory.tensor_parallel import summarise
from labs.train import ReferenceResult, TrainConfig, max_rel_diff, rule, within

# --- checks in the parent -------------------------------------------------------------------------
# The key projection's bias has a gradient of exactly 0 in exact arithmetic (adding q·b to every
# score of a row leaves the softmax unchanged); what is computed is rounding noise (~1e-11), so it
# is compared in absolute terms, against the largest gradient of the model, instead of relative
# to itself.
ZERO_GRADIENTS = ("self_attn.k_proj.bias",)


def _worst(pairs, reference: dict) -> tuple[float, str]:
    """(largest relative difference, "name") over (name, got, reference tensor) triples."""
    largest = max(g.abs().max().item() for g in reference.values())
    worst = (0.0, "")
    for name, got, ref in pairs:
        diff = (
            max_rel_diff(got.double(), ref.double())
            if not name.split(" (rank")[0].endswith(ZERO_GRADIENTS)
            else (got.double() - ref.double()).abs().max().item() / largest
        )
        worst = max(worst, (diff, name))
    return worst


def _tp_grads(per_rank: list[dict], reference: dict) -> tuple[float, str]:
    """Step 1's gradients: shards concatenated along ``partition_dim``; replicated ones checked on
    every rank."""
    dims = per_rank[0]["partition_dims"]
    pairs = []
    for name, dim in dims.items():
        if any(r["grads"][name] is None for r in per_rank):
            continue  # a gradient that never arrived: the verdict's check names it
        if dim is not None:
            pairs.append(
                (name, torch.cat([r["grads"][name] for r in per_rank], dim=dim), reference[name])
            )
        else:
            pairs += [
                (f"{name} (rank {i})", r["grads"][name], reference[name])
                for i, r in enumerate(per_rank)
            ]
    return _worst(pairs, reference)


@dataclass(frozen=True)
class Options:
    """The multimodal lab's options (``run``'s keywords, ``python -m labs.run multimodal``'s
    flags)."""

    mode: str = option("pp", "pipeline, data or tensor parallel", choices=MODES)
    split: tuple[int, ...] | None = option(
        None,
        "pp: decoder layers per stage, e.g. 0,2,1,1 (stage 0 also holds the encoder)",
        parse=ints,
    )
    microbatches: int = option(4, "pp: micro-batches per step")
    zero: int = option(0, "dp: 0 (DDP) or ZeRO stage 1, 2, 3")
    bucket_mb: float = option(0.1, "dp: DDP bucket size in MiB")
    batch_size: int = option(8, "sequences per step (global)")
    size: str = option("tiny", "tiny (checks) or timing (imbalance)", choices=tuple(SIZES))
    timed_steps: int = option(0, "pp: record the timeline of the last N steps")
    seed: int = option(0)

    def checked_split(self, *, nproc: int, steps: int) -> tuple[int, ...] | None:
        """The pipeline's split (pp; default: the encoder alone on stage 0), every option judged
        on ``nproc`` ranks first (``check_args``)."""
        train = TrainConfig(steps=steps, batch_size=self.batch_size, seed=self.seed)
        return check_args(
            SIZES[self.size],
            nproc=nproc,
            mode=self.mode,
            split=self.split,
            microbatches=self.microbatches,
            zero=self.zero,
            train=train,
        )

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        self.checked_split(nproc=nproc, steps=steps)


LAB = Lab(
    name="multimodal",
    notebook="11_multimodal",
    exercises=("multimodal",),
    builds_on=("ddp", "zero", "tensor_parallel", "pipeline_parallel"),
    reference=("setup.reference_run",),
    options=Options,
    ranks=4,
    small_run={"nproc": 2, "steps": 2, "mode": "pp"},
    bench=(
        Bench(options={"mode": "pp"}),
        Bench(
            options={"mode": "dp", "bucket_mb": 25.0},
            torch="DistributedDataParallel",
            note="25 MiB buckets, torch DDP's default, which the lab's torch run uses: at the "
            "lab's default 0.1 MiB (bucketing made visible on a tiny model) ours makes 9 "
            "all-reduces per step to torch's 1, each a gloo round trip, and was 1.5-1.9x slower "
            "(profiled).",
        ),
    ),
    profiled=True,
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
    """Train the multimodal model in ``mode`` on ``nproc`` ranks (default ``LAB.ranks``) and check
    it (module docstring). The ``options`` (``Options``): ``split``, decoder layers per pipeline
    stage (default: the encoder alone on stage 0); ``microbatches``: per step (pp); ``zero``: 0
    (DDP) or a ZeRO stage (dp); ``size``: "tiny" or "timing"; ``timed_steps``: record the
    pipeline's timeline on the last so many steps."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    split = o.checked_split(nproc=nproc, steps=steps)
    cfg = SIZES[o.size]
    train = TrainConfig(steps=steps, batch_size=o.batch_size, seed=o.seed)
    ref = reference_run(cfg, train, dp=nproc if o.mode == "dp" else 1)
    ticks = steps * (2 if vs_torch and o.mode == "dp" else 1)
    kw = dict(backend=backend, timeout=timeout, progress=ticks)
    if o.mode == "pp":
        timed = min(o.timed_steps, steps)
        launched = launch(
            pp_worker,
            nproc,
            cfg,
            train,
            [split],
            o.microbatches,
            timed,
            desc=f"pp split={split}",
            **kw,
        )
        per_rank = [runs[0] for runs in launched]  # the one split's result on each rank
    elif o.mode == "dp":
        launched = launch(
            dp_worker,
            nproc,
            cfg,
            train,
            o.zero,
            o.bucket_mb,
            vs_torch,
            desc=f"dp zero={o.zero}",
            **kw,
        )
        per_rank = launched
    else:
        launched = launch(tp_worker, nproc, cfg, train, desc="tp", **kw)
        per_rank = launched
    s = new_summary(
        "multimodal",
        nproc=nproc,
        backend=launched.backend,
        steps=steps,
        mode=o.mode,
        size=o.size,
        batch_size=o.batch_size,
        seq_len=cfg.seq_len,
        n_prefix=cfg.n_prefix,
    )
    if o.mode == "pp":
        fill_pp(s, per_rank, ref, cfg, split=split, microbatches=o.microbatches)
    elif o.mode == "dp":
        fill_dp(s, per_rank, ref, cfg, zero=o.zero, vs_torch=vs_torch)
    else:
        fill_tp(s, per_rank, ref, cfg)
    s["step_time_s"] = max(r["step_time_s"] for r in per_rank)
    s["state_bytes_per_rank"] = [r["state"] for r in per_rank]

    def per_rank_figure(value):  # one figure for every rank, or one per rank
        return value if isinstance(value, list) else [value] * nproc

    comm = per_rank_figure(s["theory_comm_bytes_per_rank"])
    state = per_rank_figure(s["theory_state_bytes_per_rank"])
    s.add_checks(
        multimodal_checks(
            s, per_rank, ref, cfg, comm=comm, state=state, bucket_mb=o.bucket_mb, zero=o.zero
        )
    )
    return s


# --- the verdict ----------------------------------------------------------------------------------
FIRST_STEP_HINTS = {
    "pp": "the loss differs at step 1: stage 0 runs the encoder on each micro-batch's own images "
    "(queued in order with stage.load), projects them, fuses the prefix before the embedded "
    "caption and runs its decoder layers; the other stages are notebook 05's",
    "dp": "the loss (the mean of the ranks') differs at step 1: each rank trains the whole model "
    "on its own share of the batch",
    "tp": "the loss differs at step 1: the encoder and projector run whole on every rank, the "
    "decoder is notebook 04's, and the loss covers the caption positions only",
}
GRAD_HINTS = {
    "dp": "the data-parallel ranks' gradients must be averaged before the optimizer steps "
    "(finish_gradient_synchronization, after backward)",
}


def _shards(per_rank: list[dict], reference: dict, key: str) -> list[dict]:
    """Each TP rank's expected tensors: its block along ``partition_dim``, or the whole."""
    n = len(per_rank)
    dims = per_rank[0]["partition_dims"]
    return [
        {
            name: reference[name] if d is None else reference[name].chunk(n, d)[r]
            for name, d in dims.items()
            if name in per_rank[r][key]
        }
        for r in range(n)
    ]


def multimodal_checks(s: RunSummary, per_rank, ref, cfg, *, comm, state, bucket_mb, zero) -> list:
    """Every mode: losses, every rank's gradients after step 1 and parameters after the last step
    by name (not under ZeRO, which keeps shards), bytes (per message for pp, per bucket for DDP, per
    phase and op for tp, in total for ZeRO), state; tp: the encoder replicas."""
    from labs.experiments.checks import (
        Check,
        calls_check,
        collectives_checks,
        compare_values,
        training_checks,
    )

    mode = s["mode"]
    n = len(per_rank)
    grads = [r["grads"] for r in per_rank] if not zero else None
    params = [r["final_params"] for r in per_rank] if not zero else None
    if mode == "tp":
        expected_grads = _shards(per_rank, ref.grads, "grads")
        expected_params = _shards(per_rank, ref.params, "final_params")
    elif mode == "pp":
        expected_grads = [{k: ref.grads[k] for k in r["grads"]} for r in per_rank]
        expected_params = [{k: ref.params[k] for k in r["final_params"]} for r in per_rank]
    else:
        expected_grads = ref.grads
        expected_params = ref.params
    checks = training_checks(
        losses=s["losses"],
        reference_losses=ref.losses,
        grads=grads,
        reference_grads=expected_grads,
        params=params,
        reference_params=expected_params,
        backend=s["backend"],
        world_size=n if mode == "dp" else None,
        absolute=ZERO_GRADIENTS,
        first_step_hint=FIRST_STEP_HINTS[mode],
        grad_hint=GRAD_HINTS.get(mode, ""),
    )
    if mode == "pp":
        B = s["batch_size"]
        message = B // s["microbatches"] * cfg.seq_len * cfg.decoder.n_embd * 4
        checks.append(
            calls_check(
                "p2p bytes per send",
                [r["sent_per_call"] for r in per_rank],
                [[message] * int(t // message) for t in comm],
                world_size=n,
                count_hint="a stage sends one fused activation [B/M, L, H] per micro-batch to the "
                "next stage and one gradient back to the previous",
            )
        )
    elif mode == "dp" and not zero:
        model = build_multimodal(cfg, seed=0)  # its parameters' sizes
        trainable = [
            p.numel() * p.element_size()
            for p in reversed(list(model.parameters()))
            if p.requires_grad
        ]
        per_call = [
            all_reduce_bytes(sum(trainable[i] for i in bucket), n)
            for bucket in bucket_layout(trainable, bucket_mb * MiB)
        ]
        checks.append(
            calls_check(
                "all_reduce bytes per call",
                [sorted(r["sent_per_call"]) for r in per_rank],
                [sorted(per_call)] * n,
                world_size=n,
                count_hint="notebook 02's BucketedDDP all-reduces each bucket once per step, after "
                "backward (finish_gradient_synchronization)",
            )
        )
    elif mode == "tp":
        calls = theory.tp_collectives(
            specs(cfg)[0],
            tp=n,
            batch=s["batch_size"],
            n_prefix=cfg.n_prefix,
            caption_len=cfg.caption_len,
        )
        expected = [(c["phase"], c["op"], c["sent_bytes"]) for c in calls]
        checks += collectives_checks(
            [[(c["phase"], c["op"], c["sent_bytes"]) for c in r["comm"]] for r in per_rank],
            [expected] * n,
            world_size=n,
            count_hint="the {phase} pass issued another number of {op} calls than notebook 04's "
            "theory with T = L: the encoder and projector are replicated and send nothing",
        )
        # bit for bit on both backends (the table's "replicas" rule; GPUs run deterministic kernels)
        checks.append(
            Check(
                "encoder replicas identical",
                within("replicas", s["max_rel_replica_diff"], backend=s["backend"]),
                s["max_rel_replica_diff"],
                0.0,
                rule("replicas", None, s["backend"]).rel,
                where=f"{n} ranks",
                hint="the replicas get the same complete gradient on every rank (f's all-reduce "
                "in each block's backward): they must not be synchronised again, nor updated "
                "from a rank's partial gradient",
            )
        )
        same = all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
        checks.append(
            Check(
                "losses equal on every rank",
                same,
                "equal" if same else "differ",
                "equal",
                where=f"{n} ranks",
                hint="every rank must compute the same global loss: the decoder's vocab-parallel "
                "loss all-reduces the max, then the sums of exp and of the target logits",
            )
        )
    if mode == "dp" and zero:
        checks.append(
            compare_values(
                "bytes sent per rank",
                s["comm_bytes_per_rank"],
                comm,
                tolerance=1e-9,
                world_size=n,
                what="bytes",
                hint="ZeRO sends 2 (N-1)/N Ψ per step in stages 1-2, 3 (N-1)/N Ψ in stage 3",
            )
        )
    checks.append(
        compare_values(
            "state bytes per rank",
            s["state_bytes_per_rank"],
            state,
            hint="pp: a stage's own parameters; dp: everything, or ZeRO's shards; tp: the "
            "decoder's shards and the whole encoder",
        )
    )
    return checks


def fill_pp(
    s: RunSummary,
    runs: list[dict],
    ref: ReferenceResult,
    cfg: MultimodalConfig,
    *,
    split,
    microbatches: int,
) -> None:
    """The pipeline's losses (last stage), gradients (by name, each on its stage), bytes and state
    vs theory."""
    spec, enc = specs(cfg)
    B = s["batch_size"]
    nproc = len(runs)
    grads = {n: g for r in runs for n, g in r["grads"].items() if g is not None}
    s["max_rel_grad_diff"], s["worst_grad"] = _worst(
        ((n, g, ref.grads[n]) for n, g in grads.items()), ref.grads
    )
    s["grads_checked"] = f"{len(grads)} of {len(ref.grads)}"
    fill_losses(s, runs[-1]["losses"], ref.losses)
    costs = theory.stage_costs(
        spec, enc, split=split, text_tokens=cfg.caption_len, mbs=B // microbatches
    )
    s.update(
        split=list(split),
        microbatches=microbatches,
        params_per_rank=[r["params"] for r in runs],
        theory_params_per_rank=[c["params"] for c in costs],
        comm_bytes_per_rank=[r["sent"] for r in runs],
        theory_comm_bytes_per_rank=[
            p2p_bytes_per_rank("1f1b", nproc, r, batch=B, seq_len=cfg.seq_len, hidden=spec.hidden)
            for r in range(nproc)
        ],
        theory_state_bytes_per_rank=[
            theory_state_bytes(c["params"], precision="fp32")["total_bytes"] for c in costs
        ],
    )
    if runs[0]["timelines"]:
        s.update(
            measure_timelines(runs, split=split, microbatches=microbatches, cfg=cfg, batch_size=B)
        )


def dp_units(cfg: MultimodalConfig) -> list[int]:
    """Trainable parameters of each ZeRO unit (``model_units``: encoder, projector, embedding,
    blocks, norm + head)."""
    spec, enc = specs(cfg)
    counts = theory.encoder_param_counts(enc, text_hidden=spec.hidden)
    c = param_counts_per_rank(spec)
    return (
        [counts["encoder"], counts["projector"], c["embedding"]]
        + [c["per_layer"]] * spec.n_layers
        + [c["final_norm"] + c["head"]]
    )


def fill_dp(
    s: RunSummary,
    per_rank: list[dict],
    ref: ReferenceResult,
    cfg: MultimodalConfig,
    *,
    zero: int,
    vs_torch: bool,
) -> None:
    """The ranks' mean loss, every rank's gradients (DDP), bytes sent and state held vs theory."""
    nproc = len(per_rank)
    units = dp_units(cfg)
    grads = [
        (f"{n} (rank {i})", g, ref.grads[n])
        for i, r in enumerate(per_rank)
        for n, g in r["grads"].items()
        if g is not None
    ]
    s["max_rel_grad_diff"], s["worst_grad"] = _worst(grads, ref.grads) if not zero else (None, None)
    # ZeRO keeps gradient shards, not .grad: its losses are compared
    s["grads_checked"] = len(grads)
    fill_losses(
        s,
        [statistics.fmean(r["losses"][i] for r in per_rank) for i in range(s["steps"])],
        ref.losses,
    )
    s.update(zero=zero, unit_numels=units, comm_bytes_per_rank=[r["sent"] for r in per_rank])
    # DDP is ZeRO stage 0: every rank all-reduces every gradient and holds the whole state
    s["theory_comm_bytes_per_rank"] = zero_theory.comm_bytes(units, stage=zero, dp=nproc)["total"]
    if zero == 3:  # rank r's own: its optimizer's moments cover its shard's parameters only
        s["theory_state_bytes_per_rank"] = [
            zero_theory.held_bytes(units, stage=3, dp=nproc, rank=r)["total"] for r in range(nproc)
        ]
    else:
        s["theory_state_bytes_per_rank"] = zero_theory.held_bytes(units, stage=zero, dp=nproc)[
            "total"
        ]
    if vs_torch:
        s["torch_step_time_s"] = max(r["torch"]["step_time_s"] for r in per_rank)
        s["torch_losses"] = [
            statistics.fmean(r["torch"]["losses"][i] for r in per_rank) for i in range(s["steps"])
        ]


def fill_tp(
    s: RunSummary, per_rank: list[dict], ref: ReferenceResult, cfg: MultimodalConfig
) -> None:
    """Losses (equal on every rank), gradients (shards assembled), collectives vs theory, replicas
    identical."""
    spec, enc = specs(cfg)
    nproc = len(per_rank)
    s["max_rel_grad_diff"], s["worst_grad"] = _tp_grads(per_rank, ref.grads)
    fill_losses(s, per_rank[0]["losses"], ref.losses)
    calls = theory.tp_collectives(
        spec, tp=nproc, batch=s["batch_size"], n_prefix=cfg.n_prefix, caption_len=cfg.caption_len
    )
    s["comm"] = summarise(per_rank[0]["comm"])
    s["theory_comm"] = summarise(calls)
    s["comm_bytes_per_rank"] = [sum(c["sent_bytes"] for c in r["comm"]) for r in per_rank]
    s["theory_comm_bytes_per_rank"] = sum(c["sent_bytes"] for c in calls)
    n_params = (
        param_counts_per_rank(spec, tp=nproc)["total"]
        + theory.encoder_param_counts(enc, text_hidden=spec.hidden)["total"]
    )
    s["theory_state_bytes_per_rank"] = theory_state_bytes(n_params, precision="fp32")["total_bytes"]
    rep = [r["replicated"] for r in per_rank]
    s["max_rel_replica_diff"] = max(
        max_rel_diff(r[n].double(), rep[0][n].double()) for r in rep for n in rep[0]
    )


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1e3:,.1f} kB"


def _per_rank_kb(value) -> str:
    """One figure, or one per rank joined by " / "."""
    return " / ".join(_kb(x) for x in value) if isinstance(value, list) else _kb(value)


def report(s: RunSummary) -> str:
    """A run's checks in a few lines: the reference, bytes sent and held against the theory, step
    time."""
    ddp_or_zero = f"ZeRO-{s.get('zero')}" if s.get("zero") else "bucketed DDP"
    what = {
        "pp": f"pipeline, split {tuple(s.get('split') or ())}, M={s.get('microbatches')}",
        "dp": f"data parallel, {ddp_or_zero}",
        "tp": "tensor-parallel decoder, replicated encoder",
    }[s["mode"]]
    if s["max_rel_grad_diff"] is not None:
        grads = f"{s['max_rel_grad_diff']:.1e} ({s['worst_grad']})"
    else:
        grads = "not compared (ZeRO keeps gradient shards)"
    # pp: every stage's figure (they differ); dp and tp: rank 0's
    pp = s["mode"] == "pp"
    sent = s["comm_bytes_per_rank"] if pp else s["comm_bytes_per_rank"][0]
    held = s["state_bytes_per_rank"] if pp else s["state_bytes_per_rank"][0]
    caption = s["seq_len"] - s["n_prefix"]
    lines = [
        f"{what} on {s['nproc']} ranks ({s['backend']}), {s['steps']} AdamW steps,"
        f" batch {s['batch_size']} of {s['n_prefix']} image + {caption} caption tokens",
        f"  losses     {' '.join(f'{x:.4f}' for x in s['losses'])}",
        f"  reference  {' '.join(f'{x:.4f}' for x in s['reference_losses'])}"
        f"   max relative difference {s['max_rel_loss_diff']:.1e}; step-1 gradients {grads}",
        f"  sent/rank  {_per_rank_kb(sent)} per step measured,"
        f" {_per_rank_kb(s['theory_comm_bytes_per_rank'])} theory",
        f"  held/rank  {_per_rank_kb(held)} measured,"
        f" {_per_rank_kb(s['theory_state_bytes_per_rank'])} theory (parameters, gradients, AdamW)",
    ]
    if s["mode"] == "tp":
        identical = s.check("encoder replicas identical").ok
        lines.append(f"  encoder    replicas identical on every rank: {identical}")
    if s.get("torch_step_time_s"):
        lines.append(
            f"  step time  ours {s['step_time_s'] * 1e3:.0f} ms, "
            f"torch DDP {s['torch_step_time_s'] * 1e3:.0f} ms"
        )
    else:
        lines.append(f"  step time  {s['step_time_s'] * 1e3:.0f} ms (median)")
    return "\n".join(lines)
