"""The parts of ``python -m labs.grade`` (instructor-only: never shipped in the student release).

``sandbox``: the bubblewrap sandbox each graded item runs in, and its limits.
``inside``: the sandbox's first process: lays out the course copy, runs the item, watches limits.
``processes``: run one item to its end or its time limit, reading its output, results and status.
``pytest_plugin``: loaded into each graded pytest run; streams every test's outcome to the grader.
``results``: checks a test run's stream against the grader's own list of tests.
``run_notebook``: executes one notebook with nbclient inside the sandbox, reporting cell by cell.
``notebooks``: prepares a student's notebook from the release's cells (by id) and judges its run.
``submission``: reads a student's folder without following links or trusting sizes and depths.
``report``: the per-student, per-lab ``Result`` and the files written from it.
"""
