"""The flight recorder on a reproduced hang (notebook 10): each rank's record of its collectives,
and torch's fr_trace naming the collective and the rank that skipped it."""

import pickle

import pytest

from labs.experiments.flight_recorder import (
    FILE_PREFIX,
    read_flight_records,
    record_skipped_collective,
)


def test_records_name_the_skipped_collective_and_the_rank(tmp_path):
    folder = record_skipped_collective(tmp_path, nproc=2, group_timeout=2.0)
    records = {
        r: pickle.loads((folder / f"{FILE_PREFIX}{r}").read_bytes())["entries"] for r in range(2)
    }
    # rank 0 called three all-reduces, rank 1 (the last rank) two
    assert [e["collective_seq_id"] for e in records[0]] == [1, 2, 3]
    assert [e["collective_seq_id"] for e in records[1]] == [1, 2]
    assert {e["profiling_name"] for e in records[0]} == {"gloo:all_reduce"}
    report = read_flight_records(folder)
    assert "Not all ranks joining collective, sequence number: 3" in report
    assert "missing ranks: {1}" in report


def test_one_rank_cannot_skip(tmp_path):
    with pytest.raises(ValueError, match="nproc must be >= 2"):
        record_skipped_collective(tmp_path, nproc=1)
