"""One exercise at a time: ``LABS_REFERENCE`` runs the reference for the exercises it names and the
learner's code for the rest, in this process and in every launched rank; ``labs.release --reveal``
ships the reference of the named exercises and nothing of the others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from labs import launch
from labs.release import build_release, check_release
from labs.runtime import impl
from tests.helpers import ROOT, run_cli


def _sources(*names: str) -> list[str]:
    """Where each exercise's module comes from ("labs" or "solutions"), as a rank sees it."""
    return [impl.exercise(name).__name__.split(".")[0] for name in names]


def test_the_reference_stands_in_for_the_named_exercises_alone(monkeypatch):
    monkeypatch.setenv(impl.IMPL_ENV, "labs")
    monkeypatch.setenv(impl.REFERENCE_ENV, "pipeline_parallel, zero")
    assert impl.reference_exercises() == ("pipeline_parallel", "zero")
    assert _sources("pipeline_parallel", "zero", "ddp") == ["solutions", "solutions", "labs"]
    # every rank inherits the choice (forked here; torchrun and spawned ranks read the same
    # environment variable)
    ranks = launch(_sources, 2, "pipeline_parallel", "ddp")
    assert list(ranks) == [["solutions", "labs"]] * 2
    monkeypatch.setenv(impl.IMPL_ENV, "solutions")  # the whole reference: LABS_REFERENCE adds none
    assert _sources("ddp") == ["solutions"]


def test_an_unknown_exercise_is_named_with_the_valid_ones(monkeypatch):
    monkeypatch.setenv(impl.REFERENCE_ENV, "pipeline,zero")
    with pytest.raises(
        ValueError, match="LABS_REFERENCE: unknown exercise 'pipeline'; choose from"
    ):
        impl.exercise("zero")
    with pytest.raises(ValueError, match="reference: unknown exercise 'nope'"):
        impl.set_reference("nope")


def test_check_takes_the_reference_for_other_exercises_only():
    proc = run_cli("-m", "labs.check", "mesh", "--reference", "mesh", env={"LABS_IMPL": "labs"})
    assert proc.returncode == 2 and "use --impl solutions" in proc.stderr


def _solution_lines(name: str) -> set[str]:
    """The lines of ``solutions/<name>.py``'s solution blocks worth recognising (no comments, no
    short lines) that the course's own code in ``labs/`` (the stubs included) does not hold too:
    what a learner must not see before the reveal."""
    public = "\n".join(p.read_text() for p in (ROOT / "labs").rglob("*.py"))
    lines, inside = set(), False
    for line in (ROOT / "solutions" / f"{name}.py").read_text().splitlines():
        text = line.strip()
        if text.startswith("### BEGIN SOLUTION"):
            inside = True
        elif text.startswith("### END SOLUTION"):
            inside = False
        elif inside and len(text) >= 30 and not text.startswith("#") and text not in public:
            lines.add(text)
    return lines


def _leaks(folder, names) -> dict[str, Counter]:
    """file -> exercise -> how many of its solution lines the file holds (3 or more is a copy of
    its solution in some form; a line or two are shared idioms, e.g. a shape helper)."""
    secret = {line: name for name in names for line in _solution_lines(name)}
    found = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        counts = Counter(name for line, name in secret.items() if line in text)
        counts = Counter({name: n for name, n in counts.items() if n >= 3})
        if counts:
            found[path.relative_to(folder).as_posix()] = counts
    return found


@pytest.mark.slow
def test_a_release_reveals_the_named_references_and_nothing_of_the_others(tmp_path):
    out = tmp_path / "course"
    manifest = build_release(out, reveal="collectives,zero")
    assert manifest["revealed"] == ["collectives", "zero"] and check_release(out) == []
    shipped = sorted(p.name for p in (out / "solutions").iterdir())
    assert shipped == ["__init__.py", "collectives.py", "zero.py"]
    assert not list(out.rglob("*.pyc")) and not list(out.rglob("__pycache__"))
    hidden = [name for name in impl.EXERCISES if name not in manifest["revealed"]]
    assert _leaks(out, hidden) == {}  # no source, bytecode, notebook output or doc of them
    # the scan recognises a solution where there is one: the revealed files are found
    assert set(_leaks(out, ["collectives", "zero"])) == {
        "solutions/collectives.py",
        "solutions/zero.py",
    }
    readme = (out / "README.md").read_text()
    assert "**Revealed references**: `collectives`, `zero`" in readme
    # in the release, an unrevealed reference says what to do instead of a bare ImportError
    code = (
        "import sys\n"
        # the instructor's editable install would find the course's own solutions/: a student's
        # copy has only the release's
        "sys.meta_path[:] = [\n"
        "    f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')\n"
        "]\n"
        "from labs.runtime.impl import exercise\n"
        "print(exercise('zero').__name__, exercise('ddp').__name__)\n"
        "exercise('pipeline_parallel')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LABS_IMPL"}
    env["LABS_REFERENCE"] = "zero,pipeline_parallel"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=out, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split() == ["solutions.zero", "labs.ddp"], proc.stderr
    assert "ReferenceUnavailable" in proc.stderr
    assert "ask your instructor to reveal it" in proc.stderr
    assert "--reveal pipeline_parallel" in proc.stderr
    # labs.run refuses it before any rank starts, saying the same
    run = code.split("from labs.runtime")[0] + (
        "from labs.run import main\n"
        "sys.exit(main(['collectives', '--reference', 'zero,pipeline_parallel']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run], cwd=out, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "'pipeline_parallel' is not in this copy" in proc.stderr
    assert "--reveal pipeline_parallel" in proc.stderr


def test_reveal_refuses_an_unknown_exercise(tmp_path):
    with pytest.raises(ValueError, match="--reveal: unknown exercise 'ring'"):
        build_release(tmp_path / "x", reveal="ring")


def test_the_layers_take_the_reference_communication_operators_alone():
    """tensor_parallel's layers reach notebook 04's first exercise through the switch: with the
    reference for tensor_parallel_comm alone, the learner's layers use the reference's operators."""
    code = (
        "from labs.runtime.impl import exercise\n"
        "tp = exercise('tensor_parallel')\n"
        "print(tp.__name__, tp.GatherFromModelParallelRegion.__module__)\n"
    )
    env = {"LABS_IMPL": "labs", "LABS_REFERENCE": "tensor_parallel_comm"}
    proc = run_cli("-c", code, env=env)
    assert proc.stdout.split() == ["labs.tensor_parallel", "solutions.tensor_parallel_comm"], (
        proc.stderr
    )


# --- a stuck learner: what a notebook shows, what a failed run says -------------------------------
def test_prerequisites_say_what_is_written_and_what_stands_in(monkeypatch):
    from labs.runtime import prerequisites as pre

    monkeypatch.setenv(impl.IMPL_ENV, "labs")
    monkeypatch.delenv(impl.REFERENCE_ENV, raising=False)
    status = pre.prerequisites("mesh")
    assert [s.name for s in status.states] == list(impl.builds_on("mesh"))
    pp = status["pipeline_parallel"]  # the repository's labs/ holds the stubs
    assert pp.unwritten[:2] == ("StageModule.forward", "build_stage") and not pp.written
    assert pp.reference_available and pp.runs == "labs"
    assert 'labs.use_reference("zero")' in str(status) and "notebook 08 (mesh)" in str(status)
    assert pre.prerequisites("infer").title == "notebook 09 (infer) runs 2 earlier exercises:"
    assert [s.name for s in pre.prerequisites("inference").states] == list(
        impl.builds_on("inference")
    )
    # the one line: the reference for that exercise alone, in this process and every rank
    shown = pre.use_reference("pipeline_parallel")
    assert os.environ[impl.REFERENCE_ENV] == "pipeline_parallel"
    assert shown["pipeline_parallel"].runs == "solutions"
    assert _sources("pipeline_parallel", "zero") == ["solutions", "labs"]
    assert list(launch(_sources, 2, "pipeline_parallel", "zero")) == [["solutions", "labs"]] * 2
    pre.use_reference("zero")
    assert impl.reference_exercises() == ("pipeline_parallel", "zero")
    pre.use_own("zero")
    assert impl.reference_exercises() == ("pipeline_parallel",)
    pre.use_own()
    assert impl.REFERENCE_ENV not in os.environ
    # written: no stub's NotImplementedError left (read from the file, not run)
    monkeypatch.setattr(pre, "_learner_file", lambda name: ROOT / "solutions" / f"{name}.py")
    assert pre.unwritten("pipeline_parallel") == [] and pre.state_of("zero").written
    with pytest.raises(ValueError, match="choose from"):
        pre.prerequisites("nope")
    # a copy of the course without that reference (a student release): said, and what to ask
    monkeypatch.setattr(pre, "reference_available", lambda name: name != "pipeline_parallel")
    monkeypatch.setattr(pre, "_learner_file", lambda name: ROOT / "labs" / f"{name}.py")
    with pytest.raises(impl.ReferenceUnavailable, match="ask your instructor to reveal it"):
        pre.use_reference("pipeline_parallel")
    text = str(pre.prerequisites("mesh"))
    assert "not here" in text and "--reveal pipeline_parallel" in text


def _rank_traceback(*files: str) -> str:
    lines = [f'  File "/course/{f}", line 7, in f\n    x()\n' for f in files]
    return "Traceback (most recent call last):\n" + "".join(lines) + "NotImplementedError: ...\n"


def test_a_failure_in_an_earlier_exercise_says_how_to_use_its_reference(monkeypatch):
    from labs.runtime import prerequisites as pre
    from labs.runtime.errors import RankError

    message = "exercise build_stage is not written yet: see its docstring and notebooks/05_..."
    text = _rank_traceback("labs/experiments/mesh.py", "labs/mesh.py", "labs/pipeline_parallel.py")
    e = RankError(0, "NotImplementedError", message, text, location="labs/pipeline_parallel.py:85")
    assert "exercise pipeline_parallel of notebook 05_pipeline_parallel" in e.advice
    assert 'use_reference("pipeline_parallel")' in e.advice and e.advice in str(e)
    assert "--reference pipeline_parallel" in e.advice
    # the lab's own exercise, or the reference's code, or an exercise the lab does not build on
    own = _rank_traceback("labs/experiments/mesh.py", "labs/mesh.py")
    assert RankError(0, "NotImplementedError", "", own, location="labs/mesh.py:3").advice == ""
    ref = RankError(0, "ValueError", "", text, location="solutions/pipeline_parallel.py:85")
    assert ref.advice == ""
    moe = _rank_traceback("labs/experiments/moe.py", "labs/pipeline_parallel.py")
    assert pre.earlier_exercise("labs/pipeline_parallel.py:9", moe) is None
    # a worker of a notebook cell: the exercise on the stack that builds on it decides
    cell = _rank_traceback("ipykernel_1/cell.py", "labs/inference.py", "labs/tensor_parallel.py")
    assert pre.earlier_exercise("labs/tensor_parallel.py:9", cell) == "tensor_parallel"
    # where the reference is not in this copy of the course: said, with what to ask for
    monkeypatch.setattr(pre, "reference_available", lambda name: False)
    advice = RankError(
        0, "NotImplementedError", message, text, "", "", "labs/pipeline_parallel.py:85"
    )
    assert "not in this copy of the course" in advice.advice
    assert "ask your instructor to reveal it" in advice.advice


def test_labs_run_takes_the_reference_for_one_exercise():
    """``--reference`` reaches the forked ranks (the stubs would raise), and a run that stops in an
    earlier exercise exits 3 saying which and how to use its reference."""
    proc = run_cli(
        "-m", "labs.run", "collectives", "--nproc", "2", "--steps", "1", "--impl", "labs",
        "--reference", "collectives", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["reference_exercises"] == ["collectives"] and summary["impl"] == "labs"
    proc = run_cli(
        "-m", "labs.run", "mesh", "--nproc", "2", "--tp", "2", "--steps", "1", "--impl", "labs",
        "--reference", "mesh",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "exercise apply_tensor_parallel is not written yet" in proc.stderr
    assert 'use_reference("tensor_parallel")' in proc.stderr
    assert "--reference tensor_parallel" in proc.stderr
    proc = run_cli("-m", "labs.run", "mesh", "--reference", "pipeline")
    assert proc.returncode == 2 and "--reference: unknown exercise 'pipeline'" in proc.stderr


def _code_calls(path, *calls: str) -> dict[str, int]:
    """Index of the first code cell of notebook ``path`` that contains each of ``calls``."""
    import nbformat

    cells = nbformat.read(path, as_version=4).cells
    found = {}
    for i, cell in enumerate(cells):
        for call in calls:
            if cell.cell_type == "code" and call in cell.source and call not in found:
                found[call] = i
    return found


def test_every_notebook_that_runs_earlier_exercises_names_them_before_its_lab():
    """Notebooks 08, 09 and 11 (their labs' ``builds_on``) and 12 (it profiles ddp and zero): a
    cell before the first lab run names each earlier exercise and shows its state, in one call."""
    import nbformat

    from labs.experiments.spec import listings

    cases = [
        (x.notebook, f'labs.prerequisites("{x.name}")', x.builds_on, "run(")
        for x in listings()
        if x.builds_on
    ]
    cases.append(
        (
            "12_mixed_precision_and_profiling",
            'labs.exercise_status("ddp", "zero")',
            ("ddp", "zero"),
            "profile_lab(",
        )
    )
    assert [c[0][:2] for c in cases] == ["08", "09", "11", "12"]
    for notebook, call, earlier, lab_call in cases:
        path = ROOT / "notebooks" / f"{notebook}.ipynb"
        found = _code_calls(path, call, lab_call)
        assert call in found and found[call] < found[lab_call], (notebook, found)
        text = nbformat.read(path, as_version=4).cells[found[call] - 1].source
        assert all(f"`{name}`" in text for name in earlier), (notebook, text)
        assert "labs.use_reference(" in text, notebook


def test_check_says_when_an_exercise_waits_on_an_earlier_one(monkeypatch):
    """``labs.check mesh`` whose tests stop in the stub of ``pipeline_parallel`` (the repository's
    labs/ holds the stubs): the closing lines name that earlier exercise and ``--reference``."""
    from labs.check import Verdict, summary
    from labs.runtime import prerequisites as pre

    stopped = Verdict(
        "test_mesh.py::t", "FAIL", "not written yet: build_stage", unwritten="build_stage"
    )
    own = Verdict("test_mesh.py::u", "FAIL", "", unwritten="compose")
    lines = summary("mesh", "labs", [stopped, own])
    assert "Not written yet in labs/mesh.py: compose." in lines[-2]
    assert "Waiting on an earlier exercise, labs/pipeline_parallel.py (build_stage" in lines[-1]
    assert "python -m labs.check mesh --reference pipeline_parallel" in lines[-1]
    monkeypatch.setattr(pre, "reference_available", lambda name: False)
    assert "--reveal pipeline_parallel" in summary("mesh", "labs", [stopped])[-1]
