"""Exercise 10: from the launcher's report (and a timeline) to the rank to look at first."""

import pytest

from labs.experiments import failures
from labs.runtime import exercise
from labs.runtime.errors import LaunchTimeout, RankDied, RankError
from tests.helpers import in_child

pytestmark = pytest.mark.exercise


def suspect_ranks(error, world_size):
    return exercise("diagnosis").suspect_ranks(error, world_size)


def straggler(wait_s):
    return exercise("diagnosis").straggler(wait_s)


@pytest.mark.parametrize(
    "error, world_size, suspects",
    [
        (LaunchTimeout(5, unfinished=[0, 2, 3], finished=[1]), 4, [1]),
        (LaunchTimeout(5, unfinished=[0, 3], finished=[1, 2]), 4, [1, 2]),
        (LaunchTimeout(5, unfinished=[0, 1], finished=[]), 2, [0, 1]),  # a deadlock
        (RankDied(2, -9, "rank 2 died from SIGKILL"), 4, [2]),
        (RankError(1, "ValueError", "rank 1 cannot find its data shard", "tb"), 4, [1]),
        (
            RankError(0, "RuntimeError", "Rank 3 failed to pass monitoredBarrier in 1000 ms", ""),
            4,
            [3],
        ),
    ],
)
def test_suspects_from_each_report(error, world_size, suspects):
    assert in_child(suspect_ranks, error, world_size) == suspects


def test_an_error_launch_never_raises_is_refused():
    with pytest.raises(RankError, match="LaunchTimeout, RankDied or RankError") as info:
        in_child(suspect_ranks, ValueError("bad"), 2)
    assert info.value.exc_type == "TypeError"


def test_straggler_waits_least():
    assert in_child(straggler, {0: 0.31, 1: 0.02, 2: 0.29}) == 1
    assert in_child(straggler, {0: 0.001, 1: 0.4}) == 0


@pytest.mark.parametrize(
    "scenario, world_size, culprit", [("skipped_collective", 3, 1), ("straggler", 3, 1)]
)
def test_the_real_reports_point_at_the_culprit(scenario, world_size, culprit):
    with pytest.raises((LaunchTimeout, RankError)) as info:
        failures.reproduce(scenario, timeout=5)
    assert in_child(suspect_ranks, info.value, world_size) == [culprit], str(info.value)


def test_a_real_slow_rank_is_found_from_its_timeline():
    slow = failures.straggler_timeline(nproc=3, steps=3, slow_rank=2, slowdown=6.0)
    assert in_child(straggler, slow["wait_s"]) == 2, slow["wait_s"]
