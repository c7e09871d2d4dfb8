"""One exercise at a time: ``LABS_REFERENCE`` runs the reference for the exercises it names and the
learner's code for the rest, in this process and in every launched rank; ``labs.release --reveal``
ships the reference of the named exercises and nothing of the others."""

from __future__ import annotations

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
