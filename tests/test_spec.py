"""Each lab declares itself once (``labs.experiments.spec``): every list of labs and exercises is
built from those declarations, the command line's options are its ``Options``' fields, the
exercises it builds on are the ones its code calls. No process starts here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from labs.experiments import spec
from labs.run import build_parser, main
from labs.runtime import impl
from tests.classic_bugs import CATALOG, RUNS
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
CALLS = re.compile(r"""exercise\(\s*["'](\w+)["']\s*\)""")


def test_the_registries_are_read_off_the_declarations():
    labs = spec.all_labs()
    assert [x.notebook for x in labs] == sorted(x.notebook for x in labs)  # notebook order
    assert impl.EXERCISES == tuple(e for x in labs for e in x.exercises)
    assert sorted(impl.EXERCISES) == sorted(p.stem for p in (ROOT / "solutions").glob("[!_]*.py"))
    assert len(set(impl.EXERCISES)) == len(impl.EXERCISES)  # each exercise taught by one lab
    commands = spec.command_labs()
    assert sorted(RUNS) == sorted(CATALOG) == sorted(commands)
    assert all(RUNS[name] == dict(x.small_run) for name, x in commands.items())
    for x in labs:
        assert (ROOT / "notebooks" / f"{x.notebook}.ipynb").exists(), x.notebook
        assert spec.lab(x.name) is x and x.module.LAB is x


def test_the_listings_read_from_the_source_are_the_declarations():
    """EXERCISES, builds_on and labs.run's lab names come from the declarations' literal fields,
    read without importing the labs (each imports torch): they say what the imported ones say."""
    assert [(x.name, x.notebook, x.exercises, x.builds_on, x.command) for x in spec.all_labs()] == [
        (x.name, x.notebook, x.exercises, x.builds_on, x.command) for x in spec.listings()
    ]
    assert spec.command_names() == sorted(spec.command_labs())


def test_listing_the_labs_imports_none_of_them():
    code = (
        "import sys\n"
        "from labs.experiments import spec\n"
        "print(len(spec.exercises()), spec.command_names()[0], spec.builds_on('mesh')[0])\n"
        "assert 'torch' not in sys.modules and 'labs.experiments.ddp' not in sys.modules\n"
    )
    proc = run_cli("-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["13", "collectives", "zero"]
    help_ = run_cli("-m", "labs.run", "--help", timeout=60)
    assert help_.returncode == 0 and "collectives,cp,ddp,infer,memory" in help_.stdout


def test_a_lab_without_a_command_still_declares_its_exercise():
    failures = spec.lab("failures")
    assert not failures.command and failures.exercises == ("diagnosis",)
    assert "failures" not in spec.command_labs() and "diagnosis" in impl.EXERCISES
    assert spec.teacher("activations").name == "memory"  # notebook 01's, not a lab's run


@pytest.mark.parametrize("name", [x.name for x in spec.all_labs()])
def test_builds_on_names_what_the_lab_calls(name):
    """The exercises a lab's code (its module, its parts, the solutions of what it teaches) calls
    through ``exercise(...)`` are the ones it teaches and the ones it declares it builds on."""
    x = spec.lab(name)
    sources = [*(ROOT / "labs" / "experiments").glob(f"{name}.py")]
    sources += (ROOT / "labs" / "experiments").glob(f"{name}_*.py")
    sources += [ROOT / "solutions" / f"{e}.py" for e in x.exercises]
    called = {c for path in sources for c in CALLS.findall(path.read_text())}
    assert called <= {*x.exercises, *x.builds_on}, sorted(called - {*x.exercises, *x.builds_on})
    assert set(x.builds_on) <= called, sorted(set(x.builds_on) - called)
    earlier = spec.exercises()[: spec.exercises().index(x.exercises[0])]
    assert set(x.builds_on) <= set(earlier)  # only earlier notebooks' exercises


def test_builds_on_for_every_exercise():
    assert impl.builds_on("tensor_parallel") == ("tensor_parallel_comm",)  # part 1 of its lab
    assert impl.builds_on("mesh") == (
        "zero",
        "tensor_parallel",
        "pipeline_parallel",
        "context_parallel",
    )
    assert impl.builds_on("diagnosis") == impl.builds_on("activations") == ()
    with pytest.raises(ValueError, match="unknown exercise 'run'"):
        impl.builds_on("run")
    with pytest.raises(ValueError, match="unknown exercise 'run'"):
        impl.exercise("run")  # the course's own package, not an exercise


@pytest.mark.parametrize("name", sorted(spec.command_labs()))
def test_the_command_line_is_the_options_declaration(name):
    x = spec.command_labs()[name]
    group = next(g for g in build_parser(x)._action_groups if g.title == f"{name} options")
    dests = [a.dest for a in group._group_actions]
    command = [f.name for f in spec.command_fields(x.options)]
    assert list(dict.fromkeys(dests)) == command  # the same names, in the same order
    defaults = build_parser(x).parse_args([name])
    for f in spec.command_fields(x.options):
        assert getattr(defaults, f.name) == f.default, f.name
    # they parse, with each bench configuration on the lab's own ranks (the mesh needs degrees)
    for entry in x.bench:
        options = {**x.command_line_options(defaults), **entry.options_for(x.ranks)}
        assert x.parse(options, nproc=x.ranks, steps=5)


def test_options_are_typed_and_unknown_names_refused():
    collectives = spec.lab("collectives")
    with pytest.raises(ValueError, match=r"collectives has no option\(s\) \['numell'\]"):
        collectives.run(nproc=2, numell=4)  # refused before any rank starts
    with pytest.raises(ValueError, match="numel='4' must be int"):
        collectives.parse({"numel": "4"}, nproc=2, steps=1)
    ddp = spec.lab("ddp")
    with pytest.raises(ValueError, match="variant='nope' is not one of"):
        ddp.parse({"variant": "nope"}, nproc=2, steps=1)
    with pytest.raises(ValueError, match="use dtype='float32'"):
        ddp.parse({"precision": "bf16-mixed", "dtype": "float64"}, nproc=2, steps=1)
    assert ddp.parse({"bucket_mb": 1}, nproc=2, steps=1).bucket_mb == 1.0  # an int is a float
    memory = spec.lab("memory").parse({"precisions": ["fp32"]}, nproc=1, steps=2)
    assert memory.precisions == ("fp32",)  # a list is a tuple
    assert dataclasses.is_dataclass(memory) and memory.__dataclass_params__.frozen


def test_only_argument_errors_exit_2(monkeypatch, capsys):
    from labs.experiments import collectives

    def comparing_fails(**options):
        raise ValueError("while comparing: shapes differ")

    monkeypatch.setattr(collectives, "run", comparing_fails)
    assert main(["collectives", "--nproc", "2"]) == 1
    assert "while comparing: shapes differ" in capsys.readouterr().err
    assert main(["collectives", "--nproc", "2", "--numel", "0"]) == 2  # judged before the run
    assert "numel must be >= 1" in capsys.readouterr().err


def test_each_exercise_module_names_its_labs_notebook():
    """The exercise module's ``NOTEBOOK`` (its stub's message names it) is its lab's notebook."""
    for name in impl.EXERCISES:
        source = (ROOT / "solutions" / f"{name}.py").read_text()
        assert f'NOTEBOOK = "{spec.teacher(name).notebook}.ipynb"' in source, name
