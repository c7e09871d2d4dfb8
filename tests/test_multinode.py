"""Multi-node, for real: two torchrun "nodes" of 2 processes each, meeting through a c10d
rendezvous on 127.0.0.1, get the same result as 4 local ranks. The same flags run on a cluster
with the first node's address as the endpoint (README, "several nodes")."""

import os
import socket
import subprocess

import pytest

from tests.helpers import ROOT, TORCHRUN, json_lines, run_json

LAB = [
    "-m",
    "labs.run",
    "collectives",
    "--json",
    "--impl",
    "solutions",
    "--numel",
    "4096",
    "--steps",
    "2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_of_two_equal_four_local_ranks():
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "labs-test",
                *LAB,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    summaries = [s for out, _ in outputs for s in json_lines(out)]
    assert len(summaries) == 1, "only global rank 0 (on node 0) prints the summary"
    multi = summaries[0]
    local = run_json(*LAB, "--nproc", "4")
    assert multi["nproc"] == local["nproc"] == 4
    for key in (
        "comm_bytes_per_rank",
        "theory_comm_bytes_per_rank",
        "sends_per_rank",
        "matches_reference",
        "passed",
    ):
        assert multi[key] == local[key], key
