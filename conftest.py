"""Suite-wide settings, for tests/ and for the notebooks nbval runs: the reference solutions run
unless LABS_IMPL says otherwise (the stub check sets it to "labs"), and the files that grade run one
after the other."""

import os

import pytest

os.environ.setdefault("LABS_IMPL", "solutions")

# `--cpu-profile PATH`: the CPU time of every test, cell and file (where the suite's time goes)
pytest_plugins = ("tests.cpu_profile",)

# The files that run `python -m labs.grade`. Each grading run keeps both cores busy (--jobs 2)
# and pins each student to a core; two at once, one on each pytest worker, starved the students
# pinned beside test_grade_concealed's spinner (30 busy processes on one core, and no CPU cgroup
# to share it fairly): a pipeline_parallel item of 16 s took 68 to 145 s. As one pytest-xdist
# unit they run in turn.
GRADING_FILES = (
    "tests/test_grade.py",
    "tests/test_grade_class.py",
    "tests/test_grade_concealed.py",
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: pytest without xdist never calls it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, a file to a worker, with the grading files as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GradingFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "grading" if scope in GRADING_FILES else scope

    return GradingFilesTogether(config, log)
