"""Experiment 11: the vision-language model trained three ways, against the reference, the theory
and the clock.

    summary = run(nproc=4, mode="pp", split=(0, 2, 1, 1))      # notebook 11, or:
    python -m labs.run multimodal --mode pp --nproc 4 --split 0,2,1,1 --json
    python -m labs.run multimodal --mode dp --nproc 2 --zero 3 --json
    python -m labs.run multimodal --mode tp --nproc 4 --json
    rows = multimodal_timeline.imbalance(splits=[(0, 4), (2, 2)])   # measured per-stage times and bubble, per split

Modes (``labs/multimodal.py``, which reuses notebooks 02-05's exercises):
* ``pp``: the encoder on stage 0 (``split``: decoder layers per stage, stage 0 included), notebook
  05's 1F1B;
* ``dp``: the whole model on every rank, notebook 02's bucketed DDP or (``zero`` 1-3) notebook 03's
  ZeRO;
* ``tp``: notebook 04's tensor-parallel decoder, the encoder and projector replicated.

Checked, every mode: every step's loss (the last stage's, the ranks' mean for dp) against the
single-process run on the same global batches (``labs.models.vision.train_reference``, fp32, 1e-5
relative); step 1's gradients by name (replicated ones on every rank); bytes each rank sends (the
ledger) and bytes of state it holds against ``labs.theory``; for tp, that the encoder replicas stay
bit-identical with no communication. ``vs_torch`` (dp only): torch's ``DistributedDataParallel`` on
the same model and data, losses and step time.

Measuring the imbalance: ``labs.experiments.multimodal_timeline``.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from labs.data import shapes
from labs.experiments.common import course_spec, fill_losses, median_step_time, new_summary
from labs.measure import CommLedger, Timeline, state_bytes
from labs.models.transformer import ModelConfig
from labs.models.vision import (
    MultimodalConfig,
    VisionConfig,
    build_multimodal,
    data_for,
    train_reference,
)
from labs.runtime.device import rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import choose_backend, launch, report_progress
from labs.runtime.pipe import pipe_group
from labs.theory import multimodal as theory
from labs.theory import zero as zero_theory
from labs.theory.dims import check_divides, check_positive
from labs.theory.memory import ModelSpec, param_counts_per_rank
from labs.theory.memory import state_bytes as theory_state_bytes
from labs.theory.pipeline import p2p_bytes_per_rank
from labs.theory.tensor_parallel import summarise
from labs.train import TOLERANCES, ReferenceResult, TrainConfig, make_optimizer, max_rel_diff

MODES = ("pp", "dp", "tp")
SIZES = {
    # the tests' and the labs' model: 16 patches of width 64, a 4-layer decoder of 64
    "tiny": MultimodalConfig(),
    "timing": MultimodalConfig(
        vision=VisionConfig(n_embd=128, mlp_hidden=256),
        decoder=ModelConfig(n_layer=4, n_embd=128, n_head=8, n_kv_head=4, ffn_hidden=384),
    ),
}


def specs(cfg: MultimodalConfig) -> tuple[ModelSpec, theory.EncoderSpec]:
    """The theory's description of the decoder and of the encoder."""
    d = cfg.decoder
    v = cfg.vision
    return (
        course_spec(d),
        theory.EncoderSpec(
            tokens=v.n_patches,
            hidden=v.n_embd,
            n_layers=v.n_layer,
            n_heads=v.n_head,
            ffn_hidden=v.mlp_hidden,
            patch_dim=v.patch_dim,
        ),
    )


def reference_name(name: str) -> str:
    """A pipeline stage's parameter name in the whole model (``layers.3.…`` ->
    ``decoder.layers.3.…``)."""
    return name if name.startswith(("encoder.", "projector.")) else "decoder." + name


def _grads(module, rename=lambda n: n) -> dict:
    """Gradients by name, on the CPU (results travel to the parent by pickle)."""
    return {
        rename(n): p.grad.detach().cpu().clone()
        for n, p in module.named_parameters()
        if p.grad is not None
    }


def _on(device, batches) -> list[tuple]:
    """Every tensor of every batch on ``device`` (the rank's GPU under NCCL; a no-op on the CPU)."""
    return [tuple(t.to(device) for t in batch) for batch in batches]


# --- the workers, one per mode
# -----------------------------------------------------------------------
def pp_worker(
    cfg: MultimodalConfig, train: TrainConfig, splits: list, microbatches: int, timed: int
) -> list[dict]:
    """One pipeline stage per split in ``splits`` (each its own model, optimizer and data), trained
    with the splits' steps interleaved (so every split meets the same machine load); the last
    ``timed`` steps of each are recorded on a timeline. Returns one result per split."""
    mm = exercise("multimodal")
    pipe = pipe_group()
    batches = _on(pipe.device, data_for(cfg, train))
    runs = []
    for split in splits:
        model = build_multimodal(cfg, seed=train.seed, device=pipe.device)
        stage = mm.build_multimodal_stage(model, split=split, stage=pipe.rank)
        optimizer = make_optimizer(stage.parameters(), train)
        runs.append(
            {
                "stage": stage,
                "optimizer": optimizer,
                "losses": [],
                "timelines": [],
                "step_times": [],
            }
        )
    for step, batch in enumerate(batches):
        for run in runs:
            timeline = (
                Timeline() if step >= train.steps - timed else None
            )  # a barrier lines the clocks up
            t0 = time.perf_counter()
            with CommLedger() if step == 0 else contextlib.nullcontext() as ledger:
                loss = mm.train_step_pp(
                    run["stage"],
                    run["optimizer"],
                    batch,
                    pipe=pipe,
                    microbatches=microbatches,
                    timeline=timeline,
                )
            run["step_times"].append(time.perf_counter() - t0)
            if step == 0:
                run["sent"] = ledger.sent_bytes()
                run["grads"] = _grads(run["stage"], reference_name)
            if loss is not None:
                run["losses"].append(float(loss))
            if timeline is not None:
                run["timelines"].append(timeline.events)
        report_progress()
    for run in runs:
        run["state"] = state_bytes(run["stage"], run.pop("optimizer"))["total"]
        run["params"] = sum(p.numel() for p in run.pop("stage").parameters())
    return runs


def dp_worker(
    cfg: MultimodalConfig, train: TrainConfig, zero: int, bucket_mb: float, vs_torch: bool
) -> dict:
    """One data-parallel rank: its share of each global batch, our DDP / ZeRO (and torch's DDP with
    vs_torch)."""
    from labs.experiments.zero import held_bytes

    rank = dist.get_rank()
    n = dist.get_world_size()
    device = rank_device()
    batches = shapes.rank_batches(
        steps=train.steps,
        batch_size=train.per_rank_batch(n),
        n_prefix=cfg.n_prefix,
        rank=rank,
        world_size=n,
        seed=train.data_seed,
        image_size=cfg.vision.image_size,
    )
    batches, model = _on(device, batches), build_multimodal(cfg, seed=train.seed, device=device)
    trainer = exercise("multimodal").DataParallelTrainer(
        model, cfg=train, zero=zero, bucket_mb=bucket_mb
    )
    out = {"losses": [], "step_times": []}
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        with CommLedger() if step == 0 else contextlib.nullcontext() as ledger:
            out["losses"].append(trainer.step(*batch))
        out["step_times"].append(time.perf_counter() - t0)
        if step == 0:
            out["sent"] = ledger.sent_bytes()
            out["grads"] = (
                _grads(model) if zero == 0 else {}
            )  # ZeRO keeps gradient shards, not .grad
        report_progress()
    out["state"] = (
        state_bytes(model, trainer.optimizer)["total"]
        if zero == 0
        else held_bytes(model, trainer.sharded)["total"]
    )
    if vs_torch:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            build_multimodal(cfg, seed=train.seed, device=device), bucket_cap_mb=bucket_mb
        )
        optimizer, times, losses = make_optimizer(ddp.parameters(), train), [], []
        for images, tokens, targets in batches:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            _, loss = ddp(images, tokens, targets)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            report_progress()
        out["torch"] = {"losses": losses, "step_time_s": median_step_time(times)}
    return out


def tp_worker(cfg: MultimodalConfig, train: TrainConfig) -> dict:
    """One tensor-parallel rank: the whole global batch through its decoder shards and its encoder
    replica."""
    device = rank_device()
    model = exercise("multimodal").TensorParallelMultimodal(
        build_multimodal(cfg, seed=train.seed, device=device)
    )
    optimizer = make_optimizer(model.parameters(), train)
    out = {"losses": [], "step_times": []}
    for step, (images, tokens, targets) in enumerate(_on(device, data_for(cfg, train))):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with CommLedger() if step == 0 else contextlib.nullcontext() as ledger:
            with ledger.phase("forward") if ledger else contextlib.nullcontext():
                _, loss = model(images, tokens, targets)
            with ledger.phase("backward") if ledger else contextlib.nullcontext():
                loss.backward()
        if step == 0:
            out["comm"] = [
                {
                    "op": r.op.replace("_single", ""),
                    "phase": r.phase,
                    "payload_bytes": r.payload_bytes,
                    "sent_bytes": r.sent_bytes,
                }
                for r in ledger.records
            ]
            out["grads"] = _grads(model)
            out["partition_dims"] = {
                n: getattr(p, "partition_dim", None) for n, p in model.named_parameters()
            }
        optimizer.step()
        out["step_times"].append(time.perf_counter() - t0)
        out["losses"].append(loss.item())
        report_progress()
    out["state"] = state_bytes(model, optimizer)["total"]
    out["replicated"] = {
        n: p.detach().cpu().clone()
        for n, p in model.named_parameters()
        if n.startswith(("encoder.", "projector."))
    }
    return out


# --- checks in the parent
# ------------------------------------------------------------------------------
# The key projection's bias has a gradient of exactly 0 in exact arithmetic (adding q·b to every
# score of a row
# leaves the softmax unchanged); what is computed is rounding noise (~1e-11), so it is compared in
# absolute
# terms, against the largest gradient of the model, instead of relative to itself.
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
    dims, pairs = per_rank[0]["partition_dims"], []
    for name, dim in dims.items():
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
    spec, _ = specs(cfg)
    if mode == "pp":
        if nproc < 2:
            raise ValueError(
                f"mode='pp' needs nproc >= 2 (the encoder's stage and a decoder stage), got {nproc}"
            )
        check_divides(train.batch_size, "batch_size", microbatches, "microbatches")
        split = split if split is not None else theory.default_split(spec.n_layers, nproc)
        return theory.check_split(split, n_layers=spec.n_layers, stages=nproc)
    if mode == "dp":
        train.per_rank_batch(nproc)
        if zero not in zero_theory.STAGES:
            raise ValueError(
                f"zero={zero!r} is not one of {zero_theory.STAGES}; 0 is DDP, 1-3 the ZeRO stages"
            )
    if mode == "tp":
        from labs.theory.tensor_parallel import check

        check(spec, tp=nproc, batch=train.batch_size, seq=cfg.seq_len)
    return None


def _reference(cfg: MultimodalConfig, train: TrainConfig, dp: int = 1) -> ReferenceResult:
    return train_reference(cfg, train, dp=dp, return_grads=True)


def run(
    *,
    nproc: int = 4,
    steps: int = 5,
    mode: str = "pp",
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    split=None,
    microbatches: int = 4,
    zero: int = 0,
    bucket_mb: float = 0.1,
    batch_size: int = 8,
    size: str = "tiny",
    seed: int = 0,
    timed_steps: int = 0,
) -> dict:
    """Train the multimodal model in ``mode`` on ``nproc`` ranks and check it (module docstring).
    ``split``: decoder layers per pipeline stage (default: the encoder alone on stage 0);
    ``microbatches``: per step (pp); ``zero``: 0 (DDP) or a ZeRO stage (dp); ``size``: "tiny" or
    "timing"; ``timed_steps``: record the pipeline's timeline on the last so many steps."""
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {tuple(SIZES)}")
    cfg = SIZES[size]
    train = TrainConfig(steps=steps, batch_size=batch_size, seed=seed)
    split = check_args(
        cfg, nproc=nproc, mode=mode, split=split, microbatches=microbatches, zero=zero, train=train
    )
    ref = _reference(cfg, train, dp=nproc if mode == "dp" else 1)
    s = new_summary(
        "multimodal",
        nproc=nproc,
        backend=choose_backend(nproc, backend),
        steps=steps,
        mode=mode,
        size=size,
        batch_size=batch_size,
        seq_len=cfg.seq_len,
        n_prefix=cfg.n_prefix,
    )
    kw = dict(
        backend=backend, timeout=timeout, progress=steps * (2 if vs_torch and mode == "dp" else 1)
    )
    if mode == "pp":
        per_rank = [
            runs[0]
            for runs in launch(
                pp_worker,
                nproc,
                cfg,
                train,
                [split],
                microbatches,
                min(timed_steps, steps),
                desc=f"pp split={split}",
                **kw,
            )
        ]
        fill_pp(s, per_rank, ref, cfg, split=split, microbatches=microbatches)
    elif mode == "dp":
        per_rank = launch(
            dp_worker, nproc, cfg, train, zero, bucket_mb, vs_torch, desc=f"dp zero={zero}", **kw
        )
        fill_dp(s, per_rank, ref, cfg, zero=zero, vs_torch=vs_torch)
    else:
        per_rank = launch(tp_worker, nproc, cfg, train, desc="tp", **kw)
        fill_tp(s, per_rank, ref, cfg)
    s["step_time_s"] = max(median_step_time(r["step_times"]) for r in per_rank)
    s["state_bytes_per_rank"] = [r["state"] for r in per_rank]
    s["matches_reference"] = (
        s["matches_reference"] and (s["max_rel_grad_diff"] or 0.0) <= TOLERANCES[torch.float32]
    )
    comm, state = (
        s[k] if isinstance(s[k], list) else [s[k]] * nproc
        for k in ("theory_comm_bytes_per_rank", "theory_state_bytes_per_rank")
    )
    s["comm_matches_theory"] = s.get("comm_matches_theory", True) and all(
        abs(b - t) < 1e-6 for b, t in zip(s["comm_bytes_per_rank"], comm)
    )
    s["state_matches_theory"] = s["state_bytes_per_rank"] == state
    return s


def fill_pp(
    s: dict,
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
    grads = {n: g for r in runs for n, g in r["grads"].items()}
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
        from labs.experiments.multimodal_timeline import measure_timelines

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
    s: dict,
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
    ]
    s["max_rel_grad_diff"], s["worst_grad"] = _worst(grads, ref.grads) if not zero else (None, None)
    s["grads_checked"] = len(
        grads
    )  # ZeRO keeps gradient shards, not .grad: its losses are compared
    fill_losses(
        s,
        [statistics.fmean(r["losses"][i] for r in per_rank) for i in range(s["steps"])],
        ref.losses,
    )
    s.update(zero=zero, unit_numels=units, comm_bytes_per_rank=[r["sent"] for r in per_rank])
    # DDP is ZeRO stage 0: every rank all-reduces every gradient and holds the whole state
    s["theory_comm_bytes_per_rank"] = zero_theory.comm_bytes(units, stage=zero, dp=nproc)["total"]
    s["theory_state_bytes_per_rank"] = zero_theory.held_bytes(units, stage=zero, dp=nproc)["total"]
    if vs_torch:
        s["torch_step_time_s"] = max(r["torch"]["step_time_s"] for r in per_rank)
        s["torch_losses"] = [
            statistics.fmean(r["torch"]["losses"][i] for r in per_rank) for i in range(s["steps"])
        ]


def fill_tp(s: dict, per_rank: list[dict], ref: ReferenceResult, cfg: MultimodalConfig) -> None:
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
    s["comm_matches_theory"] = all(summarise(r["comm"]) == s["theory_comm"] for r in per_rank)
    s["comm_bytes_per_rank"] = [sum(c["sent_bytes"] for c in r["comm"]) for r in per_rank]
    s["theory_comm_bytes_per_rank"] = sum(c["sent_bytes"] for c in calls)
    n_params = (
        param_counts_per_rank(spec, tp=nproc)["total"]
        + theory.encoder_param_counts(enc, text_hidden=spec.hidden)["total"]
    )
    s["theory_state_bytes_per_rank"] = theory_state_bytes(n_params, precision="fp32")["total_bytes"]
    rep = [r["replicated"] for r in per_rank]
    s["encoder_replicas_identical"] = all(torch.equal(r[n], rep[0][n]) for r in rep for n in rep[0])
    s["losses_equal_on_every_rank"] = all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
    s["matches_reference"] = s["matches_reference"] and s["losses_equal_on_every_rank"]


def report(s: dict) -> str:
    """A run's checks in a few lines: the reference, bytes sent and held against the theory, step
    time."""
    kb = lambda b: f"{b / 1e3:,.1f} kB"  # noqa: E731
    per = lambda v: " / ".join(kb(x) for x in v) if isinstance(v, list) else kb(v)  # noqa: E731
    what = {
        "pp": f"pipeline, split {tuple(s.get('split') or ())}, M={s.get('microbatches')}",
        "dp": f"data parallel, {'ZeRO-' + str(s.get('zero')) if s.get('zero') else 'bucketed DDP'}",
        "tp": "tensor-parallel decoder, replicated encoder",
    }[s["mode"]]
    lines = [
        f"{what} on {s['nproc']} ranks ({s['backend']}), {s['steps']} AdamW steps, batch {s['batch_size']} "
        f"of {s['n_prefix']} image + {s['seq_len'] - s['n_prefix']} caption tokens",
        f"  losses     {' '.join(f'{x:.4f}' for x in s['losses'])}",
        f"  reference  {' '.join(f'{x:.4f}' for x in s['reference_losses'])}   max relative difference "
        f"{s['max_rel_loss_diff']:.1e}; step-1 gradients "
        + (
            f"{s['max_rel_grad_diff']:.1e} ({s['worst_grad']})"
            if s["max_rel_grad_diff"] is not None
            else "not compared (ZeRO keeps gradient shards)"
        ),
        f"  sent/rank  {per(s['comm_bytes_per_rank'][0] if s['mode'] != 'pp' else s['comm_bytes_per_rank'])}"
        f" per step measured, {per(s['theory_comm_bytes_per_rank'])} theory",
        f"  held/rank  {per(s['state_bytes_per_rank'][0] if s['mode'] != 'pp' else s['state_bytes_per_rank'])}"
        f" measured, {per(s['theory_state_bytes_per_rank'])} theory (parameters, gradients, AdamW)",
    ]
    if s["mode"] == "tp":
        lines.append(
            f"  encoder    replicas identical on every rank: {s['encoder_replicas_identical']}"
        )
    if s.get("torch_step_time_s"):
        lines.append(
            f"  step time  ours {s['step_time_s'] * 1e3:.0f} ms, "
            f"torch DDP {s['torch_step_time_s'] * 1e3:.0f} ms"
        )
    else:
        lines.append(f"  step time  {s['step_time_s'] * 1e3:.0f} ms (median)")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--mode", choices=MODES, default="pp", help="pipeline, data or tensor parallel"
    )
    parser.add_argument(
        "--split",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="pp: decoder layers per stage, e.g. 0,2,1,1 (stage 0 also holds the encoder)",
    )
    parser.add_argument("--microbatches", type=int, default=4, help="pp: micro-batches per step")
    parser.add_argument("--zero", type=int, default=0, help="dp: 0 (DDP) or ZeRO stage 1, 2, 3")
    parser.add_argument("--bucket-mb", type=float, default=0.1, help="dp: DDP bucket size in MiB")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (global)")
    parser.add_argument(
        "--size", choices=tuple(SIZES), default="tiny", help="tiny (checks) or timing (imbalance)"
    )
    parser.add_argument(
        "--timed-steps", type=int, default=0, help="pp: record the timeline of the last N steps"
    )
    parser.add_argument("--seed", type=int, default=0)
