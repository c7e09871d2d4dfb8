"""Single-source stubs: labs/ is what generation gives, mirrors solutions/, and fails the lab
tests."""

import ast

import pytest

from labs import stubs
from labs.runtime.impl import EXERCISES
from tests.helpers import ROOT, junit_outcomes, run_cli


def test_learner_modules_are_what_generation_gives():
    for path, text in stubs.expected_stubs().items():
        assert path.exists(), f"{path.name} is missing; run `python -m labs.stubs`"
        assert path.read_text() == text, (
            f"labs/{path.name} drifted from solutions/; run `python -m labs.stubs`"
        )


def test_every_solution_module_is_a_known_exercise_with_a_notebook():
    for path in (ROOT / "solutions").glob("*.py"):
        if path.name == "__init__.py":
            continue
        assert path.stem in EXERCISES, (
            f"solutions/{path.name} is not listed in labs.runtime.impl.EXERCISES"
        )
        source = path.read_text()
        assert stubs.BEGIN in source, f"solutions/{path.name} has no exercise block"
        notebook = stubs._notebook(source)
        assert (ROOT / notebook).exists(), (
            f"solutions/{path.name} names {notebook}, which does not exist"
        )


def _public_api(source: str) -> dict:
    """name -> (arguments, docstring) for every public function, class and method."""
    api = {}

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, (ast.FunctionDef, ast.ClassDef))
                and not child.name.startswith("_")
                or isinstance(child, ast.FunctionDef)
                and child.name in ("__init__", "forward", "backward")
            ):
                args = ast.unparse(child.args) if isinstance(child, ast.FunctionDef) else ""
                api[prefix + child.name] = (args, ast.get_docstring(child))
                if isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")

    visit(ast.parse(source))
    return api


def test_stubs_and_solutions_share_signatures_and_docstrings():
    for path, _ in stubs.expected_stubs().items():
        solution = (ROOT / "solutions" / path.name).read_text()
        assert _public_api(path.read_text()) == _public_api(solution), path.name


def test_stub_raises_not_implemented_naming_the_function_and_notebook():
    text = stubs.make_stub(
        'NOTEBOOK = "00_x.ipynb"\n\ndef f(x):\n    """Doc."""\n    ### BEGIN SOLUTION\n'
        "    return x\n    ### END SOLUTION\n",
        "demo.py",
    )
    namespace = {}
    exec(compile(text, "demo", "exec"), namespace)
    with pytest.raises(
        NotImplementedError,
        match="exercise f is not written yet: see its docstring and notebooks/00_x.ipynb",
    ):
        namespace["f"](1)


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f():\n    ### BEGIN SOLUTION\n    pass\n", "never closed"),
        ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "outside a function"),
        ("def f():\n    pass\n    ### END SOLUTION\n", "without"),
    ],
)
def test_malformed_markers_are_errors(source, message):
    with pytest.raises(ValueError, match=message):
        stubs.make_stub(source, "bad.py")


def exercise_test_files() -> list[str]:
    """The test files that mark tests ``exercise`` (what labs.grade grades too): the others have
    nothing for the stub check to select, so it does not collect them."""
    return [
        f"tests/{path.name}"
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if "mark.exercise" in path.read_text()
    ]


def _junit_name(item) -> str:
    """A collected test's ``classname::name``, as ``junit_outcomes`` spells it."""
    path, *rest = item.nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]]) + "::" + rest[-1]


@pytest.mark.slow
def test_exercise_tests_fail_on_the_learner_stubs(tmp_path, request):
    """The honesty check: every test marked ``exercise`` passes on solutions/ (the rest of the
    suite shows that) and fails on the unfilled stubs, so none of them can pass vacuously."""
    report = tmp_path / "stubs.xml"
    proc = run_cli(
        "-m",
        "pytest",
        "-m",
        "exercise",
        "-p",
        "no:cacheprovider",
        "-q",
        "--tb=line",  # a line per failure: the outcomes are what this reads
        "--timeout",
        "120",
        f"--junitxml={report}",
        *exercise_test_files(),
        env={"LABS_IMPL": "labs"},
        timeout=1800,
    )
    outcomes = junit_outcomes(report)
    assert outcomes, f"no exercise tests ran:\n{proc.stdout[-2000:]}"
    passed = [name for name, outcome in outcomes.items() if outcome == "passed"]
    skipped = [name for name, outcome in outcomes.items() if outcome == "skipped"]
    assert not passed, f"these exercise tests pass on the unfilled stubs: {passed}"
    assert not skipped, f"these exercise tests were skipped on the stubs: {skipped}"
    # where this session collected other files (the whole suite), none of their exercise tests
    # escaped the check
    marked = {
        _junit_name(item)
        for item in request.session.items
        if item.get_closest_marker("exercise") and item.path.parent == ROOT / "tests"
    }
    assert not marked - set(outcomes), f"never run on the stubs: {sorted(marked - set(outcomes))}"
