"""Hidden checks for exercise 10 (graded, never released): the suspects on larger jobs, from
messages and rank numbers the public tests do not use, and the crashed-rank scenario run for real.

The public tests read reports of 2 to 4 ranks whose finished ranks come sorted, a late rank with
one digit, and rank numbers 0..N-1 in the straggler's timeline.
"""

import re

import pytest

from labs.experiments import failures
from labs.runtime import exercise
from labs.runtime.errors import LaunchTimeout, RankDied, RankError
from tests.helpers import in_child

pytestmark = pytest.mark.exercise


@pytest.mark.parametrize(
    "error, world_size, suspects",
    [
        # 8 ranks, the still-running ones listed out of order: the returned ones, sorted
        (LaunchTimeout(30, unfinished=[7, 1, 4, 0, 6], finished=[5, 3, 2]), 8, [2, 3, 5]),
        # every rank still running on 16: all of them, sorted
        (LaunchTimeout(30, unfinished=list(range(15, -1, -1)), finished=[]), 16, list(range(16))),
        # a late rank with two digits, named in the middle of a longer message
        (
            RankError(
                0,
                "RuntimeError",
                "[../gloo/barrier.cc:42] Rank 12 failed to pass monitoredBarrier in 30000 ms\n"
                " Original exception: timeout",
                "",
            ),
            16,
            [12],
        ),
        # a message about a rank that is not a monitored barrier's: the rank that raised
        (RankError(5, "RuntimeError", "Rank 2 sent a tensor of the wrong size", ""), 8, [5]),
        (RankDied(0, None, "rank 0 exited early with code 1"), 8, [0]),
    ],
)
def test_suspects_on_larger_jobs(error, world_size, suspects):
    assert in_child(_suspects, error, world_size) == suspects


def _suspects(error, world_size):
    """The learner's suspects for ``error`` (in a child: exercise code never runs in the test
    process); a TypeError it raises comes back as ("TypeError", its message)."""
    try:
        return exercise("diagnosis").suspect_ranks(error, world_size)
    except TypeError as e:
        return ("TypeError", str(e))


def _stragglers(timelines):
    return [exercise("diagnosis").straggler(t) for t in timelines]


def test_the_straggler_is_named_by_its_rank_not_its_position():
    """Timelines of a sub-group: ranks 4, 7 and 9 (not 0, 1, 2)."""
    timelines = [{4: 0.21, 7: 0.013, 9: 0.30}, {9: 0.5, 3: 0.25, 6: 0.75}, {2: 0.0}]
    # one rank: nobody waits for anyone, it is the only one
    assert in_child(_stragglers, timelines) == [7, 3, 2]


@pytest.mark.parametrize("error", [TimeoutError("30 s"), KeyboardInterrupt(), RuntimeError("x")])
def test_other_errors_are_refused_with_a_type_error(error):
    got = in_child(_suspects, error, 4)
    assert isinstance(got, tuple) and got[0] == "TypeError", f"no TypeError: {got!r}"
    assert re.search("LaunchTimeout, RankDied or RankError", got[1]), got[1]


def test_a_real_crashed_rank_is_the_suspect():
    """Notebook 10's crashed-rank scenario: rank 1 of 2 kills itself; the launcher says so."""
    with pytest.raises(RankDied) as info:
        failures.reproduce("crashed_rank", timeout=10)
    assert in_child(_suspects, info.value, 2) == [1], str(info.value)
