"""The instructor's guide (docs/instructors.md): its generated parts are what the classic-bug
catalogue and solutions/ give (as the stubs are checked against solutions/), it covers every
notebook and every lab of the catalogue, the README links it, and it ships in the student release
without a line of a solution."""

from scripts.instructors_guide import GUIDE, REGION, lab_notebook, solution_functions, updated
from tests.classic_bugs import all_bugs
from tests.helpers import ROOT


def test_the_generated_parts_are_what_the_catalogue_and_solutions_give():
    text = GUIDE.read_text()
    assert updated(text) == text, (
        "docs/instructors.md drifted from tests/classic_bugs.py or solutions/: run "
        "`python scripts/instructors_guide.py`"
    )


def test_every_notebook_and_every_lab_has_its_section():
    text = GUIDE.read_text()
    for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert f"\n### {notebook.name[:2]} · " in text, f"no section for {notebook.name}"
    mistakes = next(m.group("body") for m in REGION.finditer(text) if m.group("name") == "mistakes")
    for lab in {lab for lab, _ in all_bugs()}:
        assert f"`python -m labs.run {lab}`" in mistakes, f"no mistakes table for the {lab} lab"
        assert lab_notebook(lab)[:2] in mistakes


def test_the_size_reader_counts_solution_lines_only():
    source = (
        "def f():\n    x = 1\n    ### BEGIN SOLUTION\n    # why\n    y = 2\n\n    return y\n"
        "    ### END SOLUTION\n\n\nclass A:\n    def g(self):\n        ### BEGIN SOLUTION\n"
        "        pass\n        ### END SOLUTION\n\n    def h(self):\n        return 0\n"
    )
    assert solution_functions(source) == [("f", 2), ("A.g", 1)]


def test_the_readme_links_the_guide():
    assert "(docs/instructors.md)" in (ROOT / "README.md").read_text()


def test_the_guide_ships_in_the_release_and_holds_no_solution_line():
    """It ships (the README links it; its hints are what the checks print anyway); the generator
    and this test, which read the instructor-only catalogue, do not."""
    from labs import stubs
    from labs.release import release_plan

    plan = release_plan()
    assert "docs/instructors.md" in plan
    assert "scripts/instructors_guide.py" not in plan
    assert "tests/test_instructors_guide.py" not in plan
    text = GUIDE.read_text()
    for path in sorted((ROOT / "solutions").glob("*.py")):
        inside = False
        for line in path.read_text().splitlines():
            code = line.strip()
            if code in (stubs.BEGIN, stubs.END):
                inside = code == stubs.BEGIN
            elif inside and len(code) >= 20 and not code.startswith("#"):
                assert code not in text, f"docs/instructors.md quotes {path.name}: {code!r}"
