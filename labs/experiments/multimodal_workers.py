"""Experiment 11 on the ranks: one worker per mode, each training the multimodal model and
recording what the parent checks (``labs.experiments.multimodal``).

* ``pp_worker``: one pipeline stage per split, the encoder on stage 0 (notebook 05's 1F1B);
* ``dp_worker``: the whole model, notebook 02's bucketed DDP or notebook 03's ZeRO (and torch's
  DDP with ``vs_torch``);
* ``tp_worker``: notebook 04's tensor-parallel decoder, the encoder and projector replicated.

Each returns its losses, step 1's gradients by name (on the CPU), the bytes it sent in step 1, the
bytes of state it holds, and its step time (``labs.measure.timing``).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from labs.data import shapes
from labs.experiments.zero import held_bytes
from labs.measure import CommLedger, Timeline, state_bytes
from labs.measure.timing import StepTimer
from labs.models.vision import MultimodalConfig, build_multimodal
from labs.runtime.device import ddp_device_ids, deterministic_algorithms, rank_device
from labs.runtime.impl import exercise
from labs.runtime.launcher import report_progress
from labs.runtime.pipe import pipe_group, record_ops
from labs.train import TrainConfig, make_optimizer, multimodal_data_for


def reference_name(name: str) -> str:
    """A pipeline stage's parameter name in the whole model (``layers.3.…`` ->
    ``decoder.layers.3.…``)."""
    return name if name.startswith(("encoder.", "projector.")) else "decoder." + name


def _grads(module, rename=lambda n: n) -> dict:
    """Gradients by name, on the CPU (results travel to the parent by pickle); None where a
    parameter got none."""
    return {
        rename(n): None if p.grad is None else p.grad.detach().cpu().clone()
        for n, p in module.named_parameters()
    }


def _params(module, rename=lambda n: n) -> dict:
    """Parameters by name, on the CPU."""
    return {rename(n): p.detach().cpu().clone() for n, p in module.named_parameters()}


def _on(device, batches) -> list[tuple]:
    """Every tensor of every batch on ``device`` (the rank's GPU under NCCL; a no-op on the CPU)."""
    return [tuple(t.to(device) for t in batch) for batch in batches]


# --- the workers, one per mode --------------------------------------------------------------------
def pp_worker(
    cfg: MultimodalConfig, train: TrainConfig, splits: list, microbatches: int, timed: int
) -> list[dict]:
    """One pipeline stage per split in ``splits`` (each its own model, optimizer and data), trained
    with the splits' steps interleaved (so every split meets the same machine load); the last
    ``timed`` steps of each are recorded on a timeline. Returns one result per split."""
    mm = exercise("multimodal")
    pp = exercise("pipeline_parallel")  # the schedule train_step_pp runs, timed by the pipe
    pipe = pipe_group()
    batches = _on(pipe.device, multimodal_data_for(cfg, train))
    runs = []
    for split in splits:
        model = build_multimodal(cfg, seed=train.seed, device=pipe.device)
        stage = mm.build_multimodal_stage(model, split=split, stage=pipe.rank)
        optimizer = make_optimizer(stage.parameters(), train)
        runs.append(
            {
                "stage": stage,
                "optimizer": optimizer,
                "timer": StepTimer(pipe.device),
                "losses": [],
                "timelines": [],
            }
        )
    for step, batch in enumerate(batches):
        for run in runs:
            # a new Timeline starts with a barrier, which lines the ranks' clocks up
            timeline = Timeline() if step >= train.steps - timed else None
            measured = CommLedger() if step == 0 else contextlib.nullcontext()
            recorded = contextlib.nullcontext()
            if timeline is not None:  # the pipe times the stage's operations
                targets = batch[2].chunk(microbatches)  # as train_step_pp cuts them
                recorded = record_ops(pp, timeline, chunks=[run["stage"]], targets=targets)
            with run["timer"].step(), measured as ledger, recorded:
                loss = mm.train_step_pp(
                    run["stage"],
                    run["optimizer"],
                    batch,
                    pipe=pipe,
                    microbatches=microbatches,
                )
            if step == 0:
                run["sent"] = ledger.sent_bytes()
                calls = ledger.calls_by_op()
                run["sent_per_call"] = calls.get("isend", []) + calls.get("send", [])
                run["grads"] = _grads(run["stage"], reference_name)
            if loss is not None:
                run["losses"].append(float(loss))
            if timeline is not None:
                run["timelines"].append(timeline.events)
        report_progress()
    for run in runs:
        run["final_params"] = _params(run["stage"], reference_name)
        run["state"] = state_bytes(run["stage"], run.pop("optimizer"))["total"]
        run["params"] = sum(p.numel() for p in run.pop("stage").parameters())
        run["step_time_s"] = run.pop("timer").step_time()
    return runs


def dp_worker(
    cfg: MultimodalConfig, train: TrainConfig, zero: int, bucket_mb: float, vs_torch: bool
) -> dict:
    """One data-parallel rank: its share of each global batch, our DDP / ZeRO (and torch's DDP with
    vs_torch)."""
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
    batches = _on(device, batches)
    model = build_multimodal(cfg, seed=train.seed, device=device)
    trainer = exercise("multimodal").DataParallelTrainer(
        model, cfg=train, zero=zero, bucket_mb=bucket_mb
    )
    out = {"losses": []}
    timer = StepTimer(device)
    for step, batch in enumerate(batches):
        measured = CommLedger() if step == 0 else contextlib.nullcontext()
        with timer.step(), measured as ledger:
            out["losses"].append(trainer.step(*batch))
        if step == 0:
            out["sent"] = ledger.sent_bytes()
            out["sent_per_call"] = ledger.calls_by_op().get("all_reduce", [])
            # ZeRO keeps gradient shards, not .grad
            out["grads"] = _grads(model) if zero == 0 else {}
        report_progress()
    out["step_time_s"] = timer.step_time()
    # ZeRO-3 keeps shards of the parameters: compared through the losses
    out["final_params"] = _params(model) if zero == 0 else None
    if zero == 0:
        out["state"] = state_bytes(model, trainer.optimizer)["total"]
    else:
        out["state"] = held_bytes(model, trainer.optimizer)["total"]
    if vs_torch:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            build_multimodal(cfg, seed=train.seed, device=device),
            device_ids=ddp_device_ids(device),
            bucket_cap_mb=bucket_mb,
        )
        optimizer = make_optimizer(ddp.parameters(), train)
        losses = []
        torch_timer = StepTimer(device)
        for images, tokens, targets in batches:
            with torch_timer.step():
                optimizer.zero_grad(set_to_none=True)
                _, loss = ddp(images, tokens, targets)
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
            report_progress()
        out["torch"] = {"losses": losses, "step_time_s": torch_timer.step_time()}
    return out


def tp_worker(cfg: MultimodalConfig, train: TrainConfig) -> dict:
    """One tensor-parallel rank: the whole global batch through its decoder shards and its encoder
    replica (bit for bit the other ranks' replicas: on a GPU, with deterministic kernels)."""
    deterministic_algorithms()  # before the first matmul
    device = rank_device()
    model = exercise("multimodal").TensorParallelMultimodal(
        build_multimodal(cfg, seed=train.seed, device=device)
    )
    optimizer = make_optimizer(model.parameters(), train)
    out = {"losses": []}
    timer = StepTimer(device)
    for step, (images, tokens, targets) in enumerate(_on(device, multimodal_data_for(cfg, train))):
        with timer.step():
            optimizer.zero_grad(set_to_none=True)
            if step == 0:  # the first step under the ledger, by phase
                with CommLedger() as ledger:
                    with ledger.phase("forward"):
                        _, loss = model(images, tokens, targets)
                    with ledger.phase("backward"):
                        loss.backward()
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
            else:
                _, loss = model(images, tokens, targets)
                loss.backward()
            optimizer.step()
        out["losses"].append(loss.item())
        report_progress()
    out["step_time_s"] = timer.step_time()
    out["state"] = state_bytes(model, optimizer)["total"]
    out["final_params"] = _params(model)
    out["replicated"] = {
        n: p.detach().cpu().clone()
        for n, p in model.named_parameters()
        if n.startswith(("encoder.", "projector."))
    }
    return out
