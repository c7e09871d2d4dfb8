"""The parts of ``python -m labs.grade`` (instructor-only: never shipped in the student release).

``processes``: run one item in its own process group with a time limit; kill what it leaves behind.
``report``: the per-student, per-lab ``Result`` and the files written from it.
``pytest_plugin``: loaded into each graded pytest run; streams every test's outcome to a file as
it happens (a run that is killed still says which tests passed).
``run_notebook``: executes one notebook with nbclient, recording the cell it is in.
"""
