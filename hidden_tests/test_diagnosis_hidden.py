"""Hidden checks for exercise 10 (graded, never released): the suspects on larger jobs, from
messages and rank numbers the public tests do not use, and the crashed-rank scenario run for real.

The public tests read reports of 2 to 4 ranks whose finished ranks come sorted, a late rank with
one digit, and rank numbers 0..N-1 in the straggler's timeline.
"""

import pytest

from labs.experiments import failures
from labs.runtime import exercise
from labs.runtime.errors import LaunchTimeout, RankDied, RankError

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
    assert exercise("diagnosis").suspect_ranks(error, world_size) == suspects


def test_the_straggler_is_named_by_its_rank_not_its_position():
    """Timelines of a sub-group: ranks 4, 7 and 9 (not 0, 1, 2)."""
    straggler = exercise("diagnosis").straggler
    assert straggler({4: 0.21, 7: 0.013, 9: 0.30}) == 7
    assert straggler({9: 0.5, 3: 0.25, 6: 0.75}) == 3
    assert straggler({2: 0.0}) == 2  # one rank: nobody waits for anyone, it is the only one


@pytest.mark.parametrize("error", [TimeoutError("30 s"), KeyboardInterrupt(), RuntimeError("x")])
def test_other_errors_are_refused_with_a_type_error(error):
    with pytest.raises(TypeError, match="LaunchTimeout, RankDied or RankError"):
        exercise("diagnosis").suspect_ranks(error, 4)


def test_a_real_crashed_rank_is_the_suspect():
    """Notebook 10's crashed-rank scenario: rank 1 of 2 kills itself; the launcher says so."""
    with pytest.raises(RankDied) as info:
        failures.reproduce("crashed_rank", timeout=10)
    assert exercise("diagnosis").suspect_ranks(info.value, 2) == [1], str(info.value)
