"""Exercise 10 (notebooks/10_when_it_breaks.ipynb): from the launcher's report to the rank to
look at first.

A bug on one rank shows up on all of them: the others hang in a collective, or fail a moment
later with "connection reset by peer". ``launch`` already names the root cause as well as it
can (``labs.runtime.errors``); reading its report is the skill:

==================  ==========================================================================
the launcher says   suspect
==================  ==========================================================================
``LaunchTimeout``   the ranks that *returned*: the others still wait in a collective the
                    returned ones skipped; if none returned, every rank waits (a deadlock: all
                    of them, e.g. each one sends before anyone receives)
``RankDied``        the rank that died (a signal: segfault, the OOM killer, a lost node)
``RankError``       the rank that raised, unless its message names another: ``monitored_barrier``
                    raises on the rank that waited, with "Rank 1 failed to pass
                    monitoredBarrier": the late rank is the suspect
==================  ==========================================================================

A slow rank raises nothing: every collective simply ends when it arrives, so the *others*
spend the time waiting inside it. Time spent in collectives, per rank, points at it: the
straggler is the rank that waits least.

No communication of its own: these functions read what ``launch`` raised and what a timeline
measured (``labs.experiments.failures``).
"""

from __future__ import annotations

import re

from labs.experiments import failures
from labs.runtime.errors import LaunchTimeout, RankDied, RankError

NOTEBOOK = "10_when_it_breaks.ipynb"
# The lab has one part, its core, and the minutes it takes at the notebook's pace
# (labs.check.parts); each function's docstring names its part.
PARTS = {"core": 40}

LATE_RANK = re.compile(r"Rank (\d+) failed to pass monitoredBarrier")


def suspect_ranks(error: BaseException, world_size: int) -> list[int]:
    """The ranks to look at first, sorted, from the exception ``launch`` raised for a job of
    ``world_size`` ranks (the table in the module docstring).

    ``LaunchTimeout.unfinished``: the ranks still running; ``RankDied.rank``,
    ``RankError.rank``: the rank that died or raised; ``RankError.message``: its message.
    Any other exception is a ``TypeError`` naming the three the launcher raises.

    Part: core.
    """
    ### BEGIN SOLUTION
    if isinstance(error, LaunchTimeout):
        returned = sorted(set(range(world_size)) - set(error.unfinished))
        return returned or sorted(error.unfinished)
    if isinstance(error, RankDied):
        return [error.rank]
    if isinstance(error, RankError):
        late = LATE_RANK.search(error.message)
        return [int(late.group(1))] if late else [error.rank]
    raise TypeError(
        f"error={type(error).__name__} is not one launch raises; "
        "expected LaunchTimeout, RankDied or RankError"
    )
    ### END SOLUTION


def straggler(wait_s: dict[int, float]) -> int:
    """The rank the others wait for: the one with the least time inside collectives.

    wait_s: rank -> seconds that rank spent in collectives (e.g. the all-reduce spans of a
    timeline: ``straggler_timeline(...)["wait_s"]``).

    Part: core.
    """
    ### BEGIN SOLUTION
    return min(wait_s, key=wait_s.get)
    ### END SOLUTION


# The scenarios of notebook 10 with a known culprit: (scenario, ranks, culprit).
CULPRITS = (
    ("skipped_collective", 3, 1),  # rank 1 skips the last all-reduce
    ("crashed_rank", 2, 1),  # rank 1 kills itself
    ("straggler", 3, 1),  # rank 1 reaches monitored_barrier 3 s late
)


def diagnose_scenarios(timeout: float = 5.0) -> list[dict]:
    """Reproduce each scenario of ``CULPRITS`` and ask :func:`suspect_ranks`; then a slow rank's
    timeline and :func:`straggler`. Rows: ``scenario``, ``error``, ``suspects``, ``culprit``."""
    rows = []
    for scenario, world_size, culprit in CULPRITS:
        try:
            failures.reproduce(scenario, timeout=timeout)
            error = None
        except (LaunchTimeout, RankDied, RankError) as exc:
            error = exc
        rows.append(
            {
                "scenario": scenario,
                "error": type(error).__name__,
                "suspects": suspect_ranks(error, world_size) if error else [],
                "culprit": [culprit],
            }
        )
    slow = failures.straggler_timeline(nproc=3, steps=4, slow_rank=2, slowdown=6.0)
    rows.append(
        {
            "scenario": "slow rank (timeline)",
            "error": None,
            "suspects": [straggler(slow["wait_s"])],
            "culprit": [slow["slow_rank"]],
        }
    )
    return rows
