"""Experiment 03, checkpoints: save a ZeRO model on N ranks, resume on M ranks and in one process.

    demo = checkpoint_demo(save_nproc=4, load_nproc=2)   # notebook 03
    print(format_checkpoint(demo))

The sharded checkpoint itself (DCP, DTensor shards, errors) is ``labs.checkpoint``; this
module trains with ``labs.experiments.zero.train_worker`` before and after it and
compares the resumed runs with one uninterrupted run.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import torch

from labs.experiments.zero import (
    RunSpec,
    build,
    check_options,
    mean_losses,
    param_diff,
    train_worker,
)
from labs.runtime.launcher import launch
from labs.train import TrainConfig, compare_losses, data_for


def checkpoint_demo(
    folder=None,
    *,
    save_nproc: int = 4,
    load_nproc: int = 2,
    steps: int = 3,
    stage: int = 3,
    model: str = "course",
    backend: str = "auto",
    timeout: float = 300.0,
) -> dict:
    """Train ``steps`` steps on ``save_nproc`` ranks and save to ``folder``; resume for ``steps``
    more on ``load_nproc`` ranks, on ``save_nproc`` ranks and in one process (no process
    group), and compare each with one uninterrupted run of 2·``steps`` steps.

    Returns the losses of the second half (``uninterrupted``, ``resumed_on_<n>``,
    ``single_process``), the parameters saved, as loaded and at the end of each run
    (``saved_params``, ``params_loaded_on_<n>``, ``params_resumed_on_<n>``...) and the
    comparisons: ``*_exact`` (bit for bit), ``*_max_rel_loss_diff``, ``*_max_rel_param_diff``.
    """
    # labs.checkpoint imports DCP, which is large: imported once here, not in every forked rank
    from labs.checkpoint import load_full

    folder = folder or tempfile.mkdtemp(prefix="zero3-ckpt-")
    check_options(stage, False, model, min(save_nproc, load_nproc), steps)
    cfg = TrainConfig(steps=2 * steps)
    # resumed and uninterrupted runs are compared bit for bit (the table's "rerun" rule): on a
    # GPU that takes deterministic kernels
    spec = RunSpec(stage=stage, model=model, steps=2 * steps, deterministic=True)

    def go(nproc: int, run_spec: RunSpec) -> list[dict]:
        return launch(train_worker, nproc, run_spec, cfg, backend=backend, timeout=timeout)

    whole = go(save_nproc, spec)
    first = go(save_nproc, replace(spec, steps=steps, save=str(folder)))
    out = {
        "folder": str(folder),
        "save_nproc": save_nproc,
        "load_nproc": load_nproc,
        "uninterrupted": mean_losses(whole)[steps:],
        "uninterrupted_params": whole[0]["params"],
        "saved_params": first[0]["params"],
    }
    for n in sorted({load_nproc, save_nproc}):
        rs = go(n, replace(spec, steps=steps, start=steps, load=str(folder)))
        out.update(
            {
                f"resumed_on_{n}": mean_losses(rs),
                f"params_loaded_on_{n}": rs[0]["loaded_params"],
                f"params_resumed_on_{n}": rs[0]["params"],
            }
        )
    single = build(model, seed=cfg.seed)
    optimizer = load_full(folder, single, cfg)
    out["params_loaded_single"] = {n: p.detach().clone() for n, p in single.named_parameters()}
    out["single_process"] = []
    for x, y in data_for(cfg, save_nproc)[steps:]:  # the same global batches, in one process
        _, loss = single(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["single_process"].append(loss.item())
    out["params_resumed_single"] = {n: p.detach().clone() for n, p in single.named_parameters()}
    for tag in [f"on_{n}" for n in sorted({load_nproc, save_nproc})] + ["single"]:
        losses = out[f"resumed_{tag}" if tag != "single" else "single_process"]
        loaded = out[f"params_loaded_{tag}"]
        final = out[f"params_resumed_{tag}"]
        out[f"load_{tag}_exact"] = all(
            torch.equal(loaded[n], p) for n, p in out["saved_params"].items()
        )
        out[f"resume_{tag}_exact"] = losses == out["uninterrupted"]
        loss_diff = compare_losses(losses, out["uninterrupted"])
        out[f"resume_{tag}_max_rel_loss_diff"] = loss_diff["max_rel_loss_diff"]
        params = param_diff(final, out["uninterrupted_params"])
        out[f"resume_{tag}_max_rel_param_diff"] = params["max_rel_param_diff"]
    return out


def format_checkpoint(d: dict) -> str:
    """``checkpoint_demo``'s losses after resuming, side by side, and whether they are exact."""
    tags = [f"on_{n}" for n in sorted({d["load_nproc"], d["save_nproc"]})] + ["single"]
    label = {"single": "1 process"} | {
        f"on_{n}": f"{n} ranks" for n in (d["load_nproc"], d["save_nproc"])
    }
    lines = [
        f"saved by {d['save_nproc']} ranks to {d['folder']}",
        f"{'resumed on':<14}"
        + "".join(
            f"{'step ' + str(i + 1 + len(d['uninterrupted'])):>9}"
            for i in range(len(d["uninterrupted"]))
        )
        + "   loaded exactly?  losses exact?",
        f"{'uninterrupted':<14}" + "".join(f"{x:>9.6f}" for x in d["uninterrupted"]),
    ]
    for tag in tags:
        losses = d[f"resumed_{tag}"] if tag != "single" else d["single_process"]
        exact = (
            "yes"
            if d[f"resume_{tag}_exact"]
            else f"no, within {d[f'resume_{tag}_max_rel_loss_diff']:.0e}"
        )
        lines.append(
            f"{label[tag]:<14}"
            + "".join(f"{x:>9.6f}" for x in losses)
            + f"   {'yes' if d[f'load_{tag}_exact'] else 'NO':<16} {exact}"
        )
    return "\n".join(lines)
