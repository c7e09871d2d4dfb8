"""Every classic mistake of the ZeRO lab's catalog (``tests/classic_bugs_zero.py``), planted in the
solution, makes the lab's verdict FAIL, with the expected check failing and a hint naming the
cause; the unedited solution PASSes the same small runs."""

from __future__ import annotations

import pytest

from labs.experiments import zero
from tests.classic_bugs_zero import CATALOG, RUNS, all_bugs, edited_source, planted

pytestmark = pytest.mark.slow


def run_lab(options: dict | None = None):
    return zero.run(**{"timeout": 120.0, **RUNS["zero"], **(options or {})})


def test_the_zero_lab_has_at_least_five_classic_bugs():
    bugs = CATALOG["zero"]
    assert len(bugs) >= 5 and len({b.id for b in bugs}) == len(bugs)
    for bug in bugs:
        edited_source(bug)  # the text to replace occurs exactly once


@pytest.mark.parametrize(
    "options", sorted({tuple(sorted(b.options.items())) for b in CATALOG["zero"]}), ids=str
)
def test_the_solution_passes_the_catalog_runs(options):
    summary = run_lab(dict(options))
    assert summary.passed, summary.verdict()


@pytest.mark.parametrize("lab, bug", all_bugs(), ids=[bug.id for _, bug in all_bugs()])
def test_a_planted_bug_fails_with_its_hint(lab, bug):
    with planted(bug):
        summary = run_lab(bug.options)
    verdict = summary.verdict()
    assert not summary.passed, verdict
    failed = {c.name: c for c in summary.checks if not c.ok}
    assert bug.check in failed, verdict
    assert bug.hint in failed[bug.check].hint, verdict
