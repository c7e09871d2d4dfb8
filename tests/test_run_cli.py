"""`python -m labs.run`: the summary contract, the stub message, and the torchrun worker mode."""

import inspect
import json
import time

import pytest
import torch

from labs.experiments.common import (
    SUMMARY_KEYS,
    RunSummary,
    format_summary,
    new_summary,
    to_json,
)
from labs.experiments.spec import command_labs
from labs.measure.timing import StepTimer, step_time, time_steps
from tests import torchrun_labs
from tests.helpers import TORCHRUN, checks_ok, json_lines, run_cli, run_json


def test_json_summary_has_every_required_key():
    summary = run_json(
        "-m",
        "labs.run",
        "collectives",
        "--nproc",
        "2",
        "--json",
        "--impl",
        "solutions",
        "--vs-torch",
    )
    assert set(SUMMARY_KEYS) <= set(summary)
    assert (
        summary["lab"] == "collectives" and summary["nproc"] == 2 and summary["impl"] == "solutions"
    )
    assert summary["backend"] == "gloo"
    assert checks_ok(summary, "integer sum equals dist.all_reduce", "bytes sent per rank")
    assert summary["torch_step_time_s"] > 0
    assert summary["passed"] is True and all(c["ok"] for c in summary["checks"])
    assert {"chunk sent in each round", "bytes per send"} <= {c["name"] for c in summary["checks"]}


def test_the_summary_ends_with_the_verdict_and_a_failed_check_exits_1(monkeypatch, capsys):
    from labs.experiments import collectives
    from labs.experiments.checks import Check
    from labs.run import main

    def failing_run(**options):
        s = new_summary("collectives", nproc=options["nproc"], backend="gloo", steps=1)
        s.add_checks(
            [
                Check("bytes per send", True, [8, 8], [8, 8]),
                Check(
                    "chunk sent in each round",
                    False,
                    "chunk 0",
                    "chunk 1",
                    None,
                    "rank 0",
                    "check the (r - s) mod N index",
                ),
            ]
        )
        return s

    monkeypatch.setattr(collectives, "run", failing_run)
    assert main(["collectives", "--nproc", "2"]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("hint (chunk sent in each round): check the (r - s) mod N index")
    assert "collectives: FAIL: 1 of 2 checks failed" in out
    assert main(["collectives", "--nproc", "2", "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["passed"] is False and summary["checks"][1]["where"] == "rank 0"
    # a summary without checks has no verdict to give: a FAIL
    monkeypatch.setattr(
        collectives, "run", lambda **o: new_summary("collectives", nproc=2, backend="gloo", steps=1)
    )
    assert main(["collectives", "--nproc", "2"]) == 1
    assert "FAIL: the run made no checks" in capsys.readouterr().out


def test_summary_reads_like_a_dict_and_writes_flat_json():
    s = new_summary("ddp", nproc=2, backend="gloo", steps=3, variant="all")
    s["step_time_s"] = 0.25  # a contract key: a field
    s["max_rel_param_diff"] = 2e-7  # the lab's own: in details
    s.update(variants={"naive": {"max_rel_grad_diff": 1e-7}})
    assert isinstance(s, RunSummary) and s.step_time_s == 0.25 and s.loss is None
    assert s.details == {"variant": "all", "max_rel_param_diff": 2e-7, "variants": s["variants"]}
    assert "max_rel_param_diff" in s and "lab" in s and "nope" not in s and s.get("nope") is None
    keys = [*SUMMARY_KEYS, "variant", "max_rel_param_diff", "variants", "matches_reference"]
    assert list(s) == keys
    with pytest.raises(KeyError):
        s["nope"]
    with pytest.raises(TypeError, match="contract key"):
        del s["lab"]
    out = json.loads(to_json(s))
    assert list(out)[: len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)  # flat: the contract first
    assert out["step_time_s"] == 0.25 and out["variant"] == "all" and "details" not in out
    assert (
        out["max_rel_param_diff"] == 2e-7 and out["variants"]["naive"]["max_rel_grad_diff"] == 1e-7
    )
    assert format_summary(s).splitlines()[0].split() == ["lab", "ddp"]


def test_matches_reference_is_read_off_the_checks_by_one_rule():
    from labs.experiments.checks import Check

    s = new_summary("ddp", nproc=2, backend="gloo", steps=1)
    assert s["matches_reference"] is None  # no check against the reference: nothing to say
    s.add_checks(
        [Check("losses", True, against="reference"), Check("bytes", False, against="theory")]
    )
    assert s["matches_reference"] is True and not s.passed
    s.add_checks([Check("gradients after step 1", False, 2.0, 0.0, against="reference")])
    assert s["matches_reference"] is False and s.check("gradients after step 1").measured == 2.0
    assert json.loads(to_json(s))["matches_reference"] is False
    with pytest.raises(TypeError, match="derived from the checks"):
        s["matches_reference"] = True
    with pytest.raises(KeyError, match="no check named"):
        s.check("parameters")


@pytest.mark.parametrize("lab", sorted(command_labs()))
def test_every_lab_runs_one_way_and_returns_the_one_summary_type(lab):
    """``run(*, nproc, steps, backend, vs_torch, timeout, **options)``: the lab's own options are
    its ``Options``' fields, which give the command line's too."""
    run = command_labs()[lab].run
    signature = inspect.signature(run)
    assert signature.return_annotation in ("RunSummary", RunSummary), lab
    assert list(signature.parameters) == [
        "nproc",
        "steps",
        "backend",
        "vs_torch",
        "timeout",
        "options",
    ], lab


def test_step_time_drops_the_warm_up_step():
    assert step_time([10.0, 1.0, 3.0, 2.0]) == 2.0  # the median of the steps after the first
    assert step_time([5.0]) == 5.0  # one step: nothing else to report
    with pytest.raises(ValueError, match="times is empty"):
        step_time([])
    timer = StepTimer(torch.device("cpu"))
    for seconds in (0.2, 0.0, 0.0):
        with timer.step():
            time.sleep(seconds)
    assert len(timer.times) == 3 and timer.times[0] >= 0.2 > timer.step_time()
    calls = []
    assert time_steps(lambda: calls.append(1), 4) < 0.2 and len(calls) == 4
    with pytest.raises(ValueError, match="steps must be >= 1"):
        time_steps(lambda: None, 0)


def test_unfilled_stub_gives_one_line_naming_the_function():
    proc = run_cli("-m", "labs.run", "collectives", "--nproc", "2", "--impl", "labs")
    assert proc.returncode == 3
    lines = [line for line in proc.stderr.splitlines() if "it/s" not in line and line.strip()]
    assert lines[-1].startswith("exercise ring_all_reduce is not written yet"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "invalid choice"),
        (["collectives", "--nproc", "0"], "nproc must be an integer >= 1, got 0"),
        (["collectives", "--bogus"], "unrecognized arguments"),
        (["collectives", "--numel", "0"], "numel must be >= 1"),
        # rejected before any rank starts, naming the valid values (issue 22)
        (["zero", "--nproc", "3"], "use nproc in {2,4,8}"),
        (["infer", "--steps", "0"], "steps must be an integer >= 1, got 0"),
        (["pp", "--layers", "0"], "layers must be an integer >= 1, got 0"),
        (["multimodal", "--nproc", "3", "--split", "2,0,2"], "stage 1 holds no decoder layer"),
        (["multimodal", "--nproc", "7"], "use nproc in 2..6"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message, capsys):
    """``labs.run``'s main, in this process (``python -m labs.run`` exits with what it returns, or
    argparse's exit: ``test_the_command_line_exits_2_on_bad_arguments``)."""
    from labs.run import main

    try:
        code = main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_command_line_exits_2_on_bad_arguments():
    """The exit status of ``python -m labs.run`` itself: argparse's error and ours."""
    for args, message in [
        (["nope"], "invalid choice"),
        (["collectives", "--nproc", "0"], "nproc must be an integer >= 1, got 0"),
    ]:
        proc = run_cli("-m", "labs.run", *args)
        assert proc.returncode == 2
        assert message in proc.stderr


# Every lab under torchrun, as on a GPU box or across nodes: at N=2 every lab (the lab's own options
# where N=2 needs them), and at N=4 the labs whose N=4 paths N=2 cannot show: the mesh's subgroups
# (TP x PP), four pipeline stages, MoE's uneven all-to-all over 4 ranks and placement over 4 stages
# in inference. On gloo, 2 steps each. The labs of one N share one torchrun job
# (``tests/torchrun_labs.py``: every worker runs ``labs.run``'s main for each lab in turn, as
# ``python -m labs.run`` does under torchrun), so torch's start-up in every rank is paid once per
# job, not once per lab: ~60 CPU-seconds for the 15 runs instead of ~250 (measured on 2 cores).
# ``test_under_torchrun_each_rank_is_a_worker`` runs ``torchrun -m labs.run`` itself.
TORCHRUN_ARGS = {"mesh": {2: ["--dp", "2"], 4: ["--tp", "2", "--pp", "2"]}}
TORCHRUN_JOBS = [(lab, 2) for lab in sorted(command_labs())] + [
    (lab, 4) for lab in ("infer", "mesh", "moe", "pp")
]


class TorchrunJob:
    """One torchrun job of ``nproc`` workers running the labs of ``TORCHRUN_JOBS`` at ``nproc``:
    the job's process (its console stderr) and, per lab, what each rank printed and its exit code
    (read from each rank's own stdout, which torchrun writes to a file: ``--redirects 1``)."""

    def __init__(self, nproc: int, log_dir):
        labs = [lab for lab, n in TORCHRUN_JOBS if n == nproc]
        command_lines = [
            [lab, "--steps", "2", "--json", "--impl", "solutions"]
            + TORCHRUN_ARGS.get(lab, {}).get(nproc, [])
            for lab in labs
        ]
        self.proc = run_cli(
            TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--log-dir",
            str(log_dir),
            "--redirects",
            "1",
            "-m",
            "tests.torchrun_labs",
            json.dumps(command_lines),
            timeout=300 + 120 * len(labs),
        )
        # <log_dir>/<run id>/attempt_0/<local rank>/stdout.log
        logs = {int(p.parent.name): p.read_text() for p in log_dir.glob("*/attempt_*/*/stdout.log")}
        assert sorted(logs) == list(range(nproc)), (logs, self.proc.stderr[-3000:])
        self.ranks = [torchrun_labs.split_by_lab(logs[rank]) for rank in range(nproc)]

    def lab(self, lab: str) -> list[tuple[str, int | None]]:
        """(stdout, exit code) of every rank for ``lab``'s run; the job's stderr if it never ran."""
        runs = [by_lab.get(lab) for by_lab in self.ranks]
        assert all(runs), f"{lab} did not run on every rank:\n{self.proc.stderr[-3000:]}"
        return runs

    def failed(self) -> bool:
        """Whether the job failed: torchrun's exit status, unless a lab's own exit code (which that
        lab's test reports) explains it."""
        explained = any(
            code not in (0, None) for by_lab in self.ranks for _, code in by_lab.values()
        )
        return self.proc.returncode != 0 and not explained


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    """``torchrun_job(nproc)``: the one torchrun job of the labs at ``nproc``, started on first
    use."""
    jobs = {}

    def job(nproc: int) -> TorchrunJob:
        if nproc not in jobs:
            jobs[nproc] = TorchrunJob(nproc, tmp_path_factory.mktemp(f"torchrun{nproc}"))
        return jobs[nproc]

    return job


@pytest.mark.slow
@pytest.mark.parametrize("lab, nproc", TORCHRUN_JOBS)
def test_every_lab_runs_under_torchrun(torchrun_job, lab, nproc):
    job = torchrun_job(nproc)
    runs = job.lab(lab)
    assert [code for _, code in runs] == [0] * nproc, job.proc.stderr[-3000:]
    assert not job.failed(), job.proc.stderr[-3000:]  # e.g. a worker that crashed on its way out
    [summary] = json_lines(runs[0][0])  # rank 0 prints, the others do not
    assert [json_lines(stdout) for stdout, _ in runs[1:]] == [[]] * (nproc - 1)
    assert summary["lab"] == lab and summary["nproc"] == nproc and summary["backend"] == "gloo"
    assert summary["matches_reference"] is True, summary
    assert summary["passed"] is True, [c for c in summary["checks"] if not c["ok"]]


@pytest.mark.slow
def test_under_torchrun_each_rank_is_a_worker():
    """Each torchrun rank is a worker, and each takes ``--reference`` from the command line: with
    the learner's stubs (``--impl labs``) for everything else, the ring all-reduce of every rank is
    the reference's, or the stub would raise (issue 28: the per-exercise choice reaches torchrun's
    ranks)."""
    proc = run_cli(
        TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "labs.run",
        "collectives",
        "--json",
        "--impl",
        "labs",
        "--reference",
        "collectives",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = json_lines(proc.stdout)
    assert len(summaries) == 1, "only rank 0 prints the summary"
    summary = summaries[0]
    assert summary["nproc"] == 2 and summary["passed"] and summary["matches_reference"]
    assert summary["impl"] == "labs" and summary["reference_exercises"] == ["collectives"]
    assert checks_ok(summary, "integer sum equals dist.all_reduce", "bytes sent per rank")
