"""The course benchmark (labs/bench/) and the GPU validation path's CPU run
(scripts/gpu_check.py).

Harness tests: they run the reference solutions (``--impl solutions``), so they are not marked
exercise.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
import types

import nbformat
import pytest

from labs import bench
from labs.bench import report as bench_report
from labs.experiments.spec import Bench, Lab, command_labs, option
from scripts import gpu_check
from tests.helpers import run_cli


# --- the bench, end to end on two cheap labs
# -------------------------------------------------------
def test_bench_writes_table_csv_and_figure(tmp_path):
    proc = run_cli(
        "-m",
        "labs.bench",
        "--labs",
        "collectives",
        "memory",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--impl",
        "solutions",
        "--no-progress",
        "--out",
        str(tmp_path),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "bench.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == bench_report.COLUMNS
        rows = {r["lab"]: r for r in reader}
    assert set(rows) == {"collectives", "memory"}
    ring = rows["collectives"]
    memory = rows["memory"]
    assert ring["status"] == memory["status"] == "ok"
    assert ring["nproc"] == "2" and ring["backend"] == "gloo" and ring["impl"] == "solutions"
    # measured against the theory and the reference, by the labs' own checks
    for row in (ring, memory):
        assert float(row["comm_ratio"]) == pytest.approx(1.0, abs=1e-9)
        assert float(row["state_ratio"]) == pytest.approx(1.0, abs=1e-9)
        assert row["matches_reference"] == "True" and float(row["max_diff"]) <= 1e-5
    # torch's counterpart: dist.all_reduce for the ring; none for the memory lab
    assert (
        float(ring["torch_ms"]) > 0
        and ring["torch_impl"] == "dist.all_reduce"
        and ring["same_job"] == "True"
    )
    assert float(ring["ours_over_torch"]) == pytest.approx(
        float(ring["ours_ms"]) / float(ring["torch_ms"])
    )
    assert memory["torch_ms"] == "" and memory["ours_over_torch"] == ""
    md = (tmp_path / "bench.md").read_text()
    assert "| lab | ranks | ours (ms) | torch (ms) |" in md and "cores" in md and "torch 2." in md
    assert (
        md.count("\n| collectives | 2 |") == 1
        and md.count("\n| memory (fp32, no recompute) | 2 |") == 1
    )
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "bench.md" in proc.stdout


def test_bench_rejects_bad_input():
    with pytest.raises(ValueError, match="not labs; choose from"):
        bench.run_bench(labs=["warp"], progress=False)
    with pytest.raises(ValueError, match="steps must be"):
        bench.run_bench(labs=["collectives"], steps=1, progress=False)
    with pytest.raises(ValueError, match="nproc must be"):
        bench.run_bench(labs=["collectives"], nprocs=[0], progress=False)
    proc = run_cli("-m", "labs.bench", "--labs", "warp", timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


# --- rows from summaries: ratios, notes, missing and failing labs
# ----------------------------------
def _summary(**kw):
    s = {
        "lab": "pp",
        "nproc": 4,
        "backend": "gloo",
        "impl": "solutions",
        "steps": 5,
        "step_time_s": 0.3,
        "torch_step_time_s": 0.2,
        "comm_bytes_per_rank": [100.0, 200.0, 200.0, 100.0],
        "theory_comm_bytes_per_rank": [100, 200, 210, 100],
        "state_bytes_per_rank": [8, 8, 8, 8],
        "theory_state_bytes_per_rank": 8,
        "max_rel_loss_diff": 2e-7,
        "matches_reference": True,
        "bubble_fraction": 0.3,
        "theory_bubble_fraction": 0.25,
    }
    return {**s, **kw}


def test_row_ratios_bubble_and_slow_note():
    entry = Bench(torch="torch.distributed.pipelining")
    row = bench.row_from_summary(_summary(), entry, wall_s=1.0)
    assert row["comm_ratio"] == pytest.approx(200 / 210)  # the rank farthest from theory
    assert row["state_ratio"] == 1.0 and row["theory_comm_bytes"] == 210
    assert row["bubble_ratio"] == pytest.approx(1.2) and row["ours_over_torch"] == pytest.approx(
        1.5
    )
    assert row["diff_key"] == "max_rel_loss_diff" and row["matches_reference"] is True
    assert "1.50x torch's" in row["note"]  # > 20% slower: the row carries a note
    fast = bench.row_from_summary(_summary(step_time_s=0.23), entry, wall_s=1.0)
    assert fast["note"] == ""  # within 20%
    unpadded = bench.row_from_summary(_summary(), Bench(bubble=False, note="why"), wall_s=1.0)
    assert unpadded["bubble"] is None and unpadded["note"].startswith("why Ours is 1.50x")
    cp = bench.row_from_summary(_summary(lab="cp"), bench.configurations("cp")[0], wall_s=1.0)
    assert "not of the same parallel job" in cp["note"] and bench.EXPLANATIONS["cp"] in cp["note"]
    md = bench_report.markdown(
        [row, fast],
        {"date": "today", "impl": "solutions", "command": "x", "hardware": bench_report.hardware()},
    )
    assert "## Notes" in md and "0.300 (0.250)" in md and "✓" in md


def test_repeats_keep_the_fastest_time_and_the_worst_difference():
    runs = [
        _summary(step_time_s=0.4, torch_step_time_s=0.2, max_rel_loss_diff=1e-7),
        _summary(
            step_time_s=0.3, torch_step_time_s=0.25, max_rel_loss_diff=3e-7, matches_reference=False
        ),
    ]
    merged = bench.merge_repeats(runs, Bench())
    assert (merged["step_time_s"], merged["torch_step_time_s"]) == (0.3, 0.2)
    assert merged["max_rel_loss_diff"] == 3e-7 and merged["matches_reference"] is False
    with pytest.raises(ValueError, match="repeats must be"):
        bench.run_bench(labs=["collectives"], repeats=0, progress=False)


@dataclasses.dataclass(frozen=True)
class PickyOptions:
    """A lab that refuses 2 ranks, before running anything."""

    seed: int = option(0)

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        if nproc != 4:
            raise ValueError(f"nproc={nproc} is not one of (4,)")


def _declare(monkeypatch, name: str, run, options=PickyOptions, bench_options=None) -> None:
    """A lab ``labs.experiments.<name>`` that exists for this test only."""
    module = types.ModuleType(f"labs.experiments.{name}")
    module.LAB = Lab(
        name=name,
        notebook="99_none",
        exercises=(),
        options=options,
        bench=(Bench(options=bench_options or {}),),
    )
    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)


def test_missing_and_failing_labs_are_rows(monkeypatch):
    [row] = bench.run_lab("ghost", nproc=2, steps=2)
    assert row["status"] == "skipped" and "not in this copy" in row["note"]

    @dataclasses.dataclass(frozen=True)
    class Easy:
        seed: int = option(0)

    for name, exc, options, status in (
        ("boom", RuntimeError("rank 1 died"), Easy, "failed"),
        ("late", ValueError("comparing: shapes differ"), Easy, "failed"),  # not an argument's
        ("picky", None, PickyOptions, "invalid"),  # refused up front: the run never starts
        ("stub", NotImplementedError("write ring_all_reduce"), Easy, "not written"),
    ):

        def run(*, nproc, steps, backend, vs_torch, timeout, _exc=exc):
            raise _exc or AssertionError("a refused run must not start")

        _declare(monkeypatch, name, run, options)
        [row] = bench.run_lab(name, nproc=2, steps=2)
        assert row["status"] == status and str(exc or "is not one of (4,)") in row["note"], row
    # a configuration with an option the lab lost
    _declare(monkeypatch, "lost", lambda **kw: None, Easy, bench_options={"stage": 3})
    [row] = bench.run_lab("lost", nproc=2, steps=2)
    assert row["status"] == "invalid" and "has no option(s) ['stage']" in row["note"]


def test_every_lab_declares_its_bench_configurations():
    for name, lab in command_labs().items():
        assert lab.bench and bench.configurations(name) == lab.bench
        for entry in lab.bench:  # every configuration names only options the lab has
            assert set(entry.options_for(lab.ranks)) <= set(lab.option_names()), name


# --- the GPU path: its planning, and its CPU run with the same code
# --------------------------------
def test_plan_runs_each_lab_at_min_gpus_and_its_ranks():
    assert gpu_check.lab_plan(4, 8, "auto") == (4, "nccl", "NCCL, one process per GPU (4 of 8)")
    assert gpu_check.lab_plan(8, 2, "auto")[:2] == (2, "nccl")
    assert gpu_check.lab_plan(4, 0, "auto")[:2] == (4, "gloo")
    nproc, backend, why = gpu_check.lab_plan(4, 1, "auto")
    assert (nproc, backend) == (1, "nccl")
    assert "not exercised: point-to-point messages, uneven all-to-all, subgroups" in why
    assert "forced" in gpu_check.lab_plan(4, 8, "gloo")[2]
    assert gpu_check.lab_ranks("mesh") == 8 and gpu_check.lab_ranks("ddp") == 4


def _report(labs, trows=(), notebooks=()):
    return {"labs": labs, "throughput": {"rows": list(trows)}, "notebooks": list(notebooks)}


def test_invalid_and_skipped_are_never_a_pass():
    ran = {"lab": "ddp", "config": "", "status": "ok", "passed": True}
    assert gpu_check.check_verdict(_report([ran]))[0]
    for status in ("invalid", "skipped", "failed"):
        ok, text = gpu_check.check_verdict(
            _report([ran, {"lab": "zero", "status": status, "passed": False}])
        )
        assert not ok and f"zero ({status})" in text, text
    ok, text = gpu_check.check_verdict(
        _report([ran], trows=[{"mode": "zero3", "status": "skipped"}])
    )
    assert not ok and "throughput zero3 (skipped)" in text
    # a configuration that needs more ranks than there are GPUs is listed, not passed
    ok, text = gpu_check.check_verdict(
        _report([ran, {"lab": "multimodal", "config": "mode=pp", "status": "not exercised"}])
    )
    assert ok and "1 lab configuration(s) matched" in text
    assert "not exercised on this machine: multimodal mode=pp" in text


@pytest.mark.parametrize(
    "name, expected, tflops, gib",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 80),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 80),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 94),
        ("NVIDIA H200", "H200 SXM", 989.5, 141),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5, 141),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312, 40),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB", 312, 40),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB", 312, 80),
        ("NVIDIA A100 80GB PCIe", "A100 80GB", 312, 80),
        ("NVIDIA GH200 480GB", None, None, None),
    ],
)
def test_gpu_table_matches_each_name_to_its_own_figures(name, expected, tflops, gib):
    known = gpu_check.known_gpu(name)
    assert (known.name if known else None) == expected
    if known:
        assert (known.bf16_tflops, known.memory_gib) == (tflops, gib)
        assert gpu_check.gpu_spec([name], None)[0] == tflops * 1e12


def test_peak_and_the_1b_scale_up():
    peak, gib, source = gpu_check.gpu_spec(["NVIDIA H200"], None)
    assert peak == 989.5e12 and gib == 141 and "data sheet" in source
    assert gpu_check.gpu_spec(["Mystery GPU"], None)[:2] == (None, None)
    assert gpu_check.gpu_spec(["NVIDIA H200"], 100.0)[0] == 100e12
    import torch

    from labs.models.transformer import ModelConfig, Transformer, count_params
    from labs.theory.memory import param_count

    cfg = gpu_check.model_config(tiny=False)
    with torch.device("meta"):
        n = count_params(Transformer(ModelConfig(**cfg)))
    assert n == param_count(gpu_check.spec_of(cfg)) and 0.9e9 < n < 1.1e9
    mbs = gpu_check.pick_micro_batch(cfg, world=1, gpu_gib=gib)
    assert (
        mbs >= 4
        and max(gpu_check.predicted_bytes(cfg, world=1, micro_batch=mbs).values())
        <= gib * 2**30 / 2
    )
    assert (
        max(gpu_check.predicted_bytes(cfg, world=1, micro_batch=2 * mbs).values()) > gib * 2**30 / 2
    )
    assert (
        gpu_check.pick_micro_batch(cfg, world=8, gpu_gib=None) == 2
    )  # no GPU: the tiny run's size


def _notebook(path, source):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, path)
    return path


def test_gpu_check_cpu_smoke(tmp_path):
    good = _notebook(tmp_path / "good.ipynb", "assert 1 + 1 == 2")
    out = tmp_path / "out"
    proc = run_cli(
        "scripts/gpu_check.py",
        "--cpu-smoke",
        "--peak-tflops",
        "1",
        "--notebooks",
        str(good),
        "--out",
        str(out),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["plan"] == [["collectives", 4, "gloo", "gloo, CPU tensors"]]
    [lab] = report["labs"]
    assert lab["lab"] == "collectives" and lab["passed"] and lab["backend"] == "gloo"
    rows = {r["mode"]: r for r in report["throughput"]["rows"]}
    assert set(rows) == set(gpu_check.MODE_NAMES)
    for r in rows.values():
        assert (
            r["status"] == "ok" and r["world"] == 2 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        )
    # ours and torch's train the same weights on the same tokens: the same losses, up to bf16
    # rounding
    for ours in gpu_check.OURS:
        assert rows[ours]["max_rel_loss_diff_vs_torch"] <= 1e-3
    assert report["notebooks"] == [
        dict(report["notebooks"][0], notebook="good.ipynb", status="passed")
    ]
    md = (out / "gpu_check.md").read_text()
    assert "## Throughput" in md and "our ZeRO-3" in md and "PASSED" in proc.stdout


def test_notebook_phase_reports_failures(tmp_path):
    import time

    bad = tmp_path / "bad.ipynb"
    bad.write_text("{ not a notebook")  # nbval fails on it without starting a kernel
    rows = gpu_check.run_notebooks(
        [bad], jobs=1, deadline=time.monotonic() + 120, log=lambda _: None
    )
    assert [(r["notebook"], r["status"]) for r in rows] == [("bad.ipynb", "failed")]
    late = gpu_check.run_notebooks(
        [bad], jobs=1, deadline=time.monotonic() + 10, log=lambda _: None
    )
    assert [(r["notebook"], r["status"]) for r in late] == [
        ("bad.ipynb", "skipped")
    ]  # no time left to start


def test_throughput_halves_the_micro_batch_on_out_of_memory(monkeypatch):
    import time

    # imported before the patch: a module that imports ``launch`` while it is patched would keep
    # the fake for the rest of the session
    import labs.experiments.zero  # noqa: F401
    from labs.runtime import launcher

    tried = []

    def fake_launch(fn, nprocs, run, **kw):
        tried.append(run.micro_batch)
        if run.micro_batch > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return [
            {
                "device_name": "fake",
                "step_time_s": 0.5,
                "losses": [5.0, 4.0],
                "n_params": 10,
                "peak_memory_bytes": None,
            }
        ] * nprocs

    monkeypatch.setattr(launcher, "launch", fake_launch)
    cfg = gpu_check.model_config(tiny=True)
    [row] = gpu_check.measure_throughput(
        ["ddp"],
        cfg=cfg,
        world=2,
        backend="gloo",
        micro_batch=8,
        predict_memory=False,
        peak=1e12,
        steps=2,
        timeout=60,
        deadline=time.monotonic() + 60,
        log=lambda _: None,
    )
    assert tried == [8, 4, 2] and row["status"] == "ok" and row["micro_batch"] == 2
    assert row["tokens_per_s"] == 2 * 2 * cfg["seq_len"] / 0.5  # world x micro-batch x seq per step


def test_a_configuration_that_needs_more_ranks_than_gpus_is_not_exercised(monkeypatch):
    """With one GPU every lab runs at world size 1; a configuration the lab refuses there is
    "not exercised" (listed, never passed), while one refused at the lab's own ranks fails."""
    import time

    def fake_run_lab(lab, *, nproc, **kw):
        if nproc < 2:
            return [{"lab": lab, "config": "mode=pp", "status": "invalid", "note": "needs 2"}]
        return [{"lab": lab, "config": "", "status": "invalid", "note": "bad option"}]

    monkeypatch.setattr(bench, "run_lab", fake_run_lab)
    args = dict(steps=2, timeout=60, vs_torch=False, deadline=time.monotonic() + 60)
    plans = {"multimodal": gpu_check.lab_plan(4, 1, "auto")}
    [row] = gpu_check.check_labs(["multimodal"], plans, log=lambda _: None, **args)
    assert row["status"] == "not exercised" and not row["passed"]
    plans = {"multimodal": gpu_check.lab_plan(4, 8, "auto")}
    [row] = gpu_check.check_labs(["multimodal"], plans, log=lambda _: None, **args)
    assert row["status"] == "invalid" and not row["passed"]
