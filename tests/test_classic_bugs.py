"""Every classic mistake of the catalog (``tests/classic_bugs.py``), planted in the solution, makes
its lab's verdict FAIL, with the expected check failing and a hint naming the cause; the unedited
solutions PASS the same small runs."""

from __future__ import annotations

import pytest

from labs.experiments.spec import command_labs
from tests.classic_bugs import CATALOG, RUNS, all_bugs, edited_source, planted

pytestmark = pytest.mark.slow

LABS_WITH_CATALOG = sorted(command_labs())


def run_lab(lab: str, options: dict | None = None):
    return command_labs()[lab].run(**{"timeout": 120.0, **RUNS[lab], **(options or {})})


def test_every_lab_has_at_least_five_classic_bugs():
    assert sorted(CATALOG) == LABS_WITH_CATALOG
    for lab, bugs in CATALOG.items():
        assert len(bugs) >= 5, lab
        assert len({b.id for b in bugs}) == len(bugs), lab
        for bug in bugs:
            edited_source(bug)  # the text to replace occurs exactly once


@pytest.mark.parametrize("lab", LABS_WITH_CATALOG)
def test_the_solution_passes_the_catalog_runs(lab):
    for options in [{}] + [b.options for b in CATALOG[lab] if b.options]:
        summary = run_lab(lab, options)
        assert summary.passed, summary.verdict()


@pytest.mark.parametrize(
    "lab, bug", all_bugs(), ids=[f"{lab}: {bug.id}" for lab, bug in all_bugs()]
)
def test_a_planted_bug_fails_with_its_hint(lab, bug):
    with planted(bug):
        summary = run_lab(lab, bug.options)
    verdict = summary.verdict()
    assert not summary.passed, verdict
    failed = {c.name: c for c in summary.checks if not c.ok}
    assert bug.check in failed, verdict
    assert bug.hint in failed[bug.check].hint, verdict
