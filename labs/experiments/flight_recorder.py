"""The flight recorder on a reproduced hang (notebook 10): each rank keeps a ring buffer of its
last collectives; after a timeout every rank dumps it, and torch's ``fr_trace`` lines the ranks'
records up by sequence number and names the collective, and the rank, that did not match.

    folder = record_skipped_collective("../out/flight_recorder")   # 2 gloo ranks, ~3 s
    print(read_flight_records(folder))     # = python -m torch.distributed.flight_recorder.fr_trace

The recorder is on when ``TORCH_FR_BUFFER_SIZE`` (older name: ``TORCH_NCCL_TRACE_BUFFER_SIZE``)
is > 0 when a process group is created: the number of collectives each rank remembers. Under
NCCL a watchdog timeout makes every rank write its record by itself (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``); torch 2.13 records gloo's collectives too but
writes nothing on its own, so here each rank catches the timeout and dumps its record
(``torch._C._distributed_c10d._dump_fr_trace()``, a private call: the same pickle NCCL writes).
One more gap of gloo's record: it leaves the process groups' membership (``pg_config``) empty, which
``fr_trace`` needs to line ranks up, so ``dump_flight_record`` fills it in from the group objects.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from labs.runtime.launcher import launch

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"  # collectives remembered per rank; 0 (default) = off
FILE_PREFIX = "fr_trace_rank_"  # one file per rank: the prefix, then the rank


def dump_flight_record(folder: str | os.PathLike, groups: list) -> Path:
    """Write this rank's flight record (a pickled dict: ``entries``, one per collective, with its
    sequence number, op, sizes, state and Python stack) to ``folder/fr_trace_rank_<rank>``, with
    the membership of ``groups`` filled in."""
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    config = {name: c for name, c in record.get("pg_config", {}).items() if name}
    for group in groups:
        ranks = dist.get_process_group_ranks(group)
        config[group.group_name] = {
            "name": group.group_name,
            "desc": group.group_desc,
            "ranks": str(ranks),
        }
    record["pg_config"] = config
    path = Path(folder) / f"{FILE_PREFIX}{dist.get_rank()}"
    path.write_bytes(pickle.dumps(record))
    return path


def skipped_collective_rank(folder: str, group_timeout: float) -> dict:
    """Notebook 10's first hang: the last rank skips the third of three all-reduces. The others
    wait in it until the group's timeout; then every rank dumps its flight record."""
    rank = dist.get_rank()
    group = dist.new_group(timeout=timedelta(seconds=group_timeout))
    x = torch.ones(4)
    error = None
    try:
        for i in range(3):
            if rank == dist.get_world_size() - 1 and i == 2:
                break  # the bug: a rank-local condition skips a collective
            dist.all_reduce(x, group=group)
    except RuntimeError as e:  # gloo: "Timed out waiting 2000ms for recv operation to complete"
        error = str(e)
    dump_flight_record(folder, [dist.group.WORLD, group])
    return {"rank": rank, "error": error}


def record_skipped_collective(
    folder: str | os.PathLike, *, nproc: int = 2, group_timeout: float = 2.0, timeout: float = 60.0
) -> Path:
    """Reproduce the skipped collective on ``nproc`` gloo ranks with the flight recorder on;
    returns ``folder``, holding one record per rank."""
    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 for one rank to skip a collective, got {nproc}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{FILE_PREFIX}*"):
        old.unlink()
    launch(
        skipped_collective_rank,
        nproc,
        str(folder),
        group_timeout,
        backend="gloo",
        timeout=timeout,
        env={BUFFER_ENV: "64"},
    )
    return folder


def read_flight_records(folder: str | os.PathLike) -> str:
    """What torch's analyser says about the records in ``folder``: its report, as text (the
    same as ``python -m torch.distributed.flight_recorder.fr_trace FOLDER``)."""
    from torch.distributed.flight_recorder import fr_trace

    logger = logging.getLogger("Flight Recorder")  # where fr_trace writes its report
    text = io.StringIO()
    mine = logging.StreamHandler(text)
    mine.setFormatter(logging.Formatter("%(message)s"))
    handlers = logger.handlers[:]
    logger.handlers = [mine]
    try:
        fr_trace.main([str(folder), "--prefix", FILE_PREFIX])
    finally:
        logger.handlers = handlers
    return "\n".join(
        line for line in text.getvalue().splitlines() if "tabulate is not installed" not in line
    )
