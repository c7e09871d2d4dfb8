"""How long does it take to start 4 gloo ranks and get their results back?

    .venv/bin/python scripts/bench_launch.py [--nproc 4] [--repeats 3] > docs/bench/launch.txt

Five ways, measured in one run, for the same trivial function (one all-reduce, return the
rank), wall time from the call to having every rank's result in the calling process:

* ``labs.launch``, fork: ranks forked from this already-imported interpreter (Linux);
* ``labs.launch``, spawn, cold: the first spawned launch of a process (macOS, Windows, CUDA
  initialised, ``LABS_START_METHOD=spawn``): each worker imports torch (``labs.runtime.pool``);
* ``labs.launch``, spawn, warm: every later spawned launch, on the workers the first one left;
* ``torch.multiprocessing.spawn``, as most tutorials launch: each rank re-imports torch, every time;
* ``torchrun --standalone``: a new interpreter per rank plus the elastic agent.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labs import launch
from labs.runtime.pool import worker_pool


def trivial() -> int:
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank()


def _spawn_entry(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    result = trivial()
    with open(os.path.join(out_dir, f"{rank}"), "w") as f:
        f.write(str(result))
    dist.destroy_process_group()


def with_spawn(nproc: int) -> list[int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_spawn_entry, args=(nproc, port, out), nprocs=nproc, join=True)
        return [int(open(os.path.join(out, str(r))).read()) for r in range(nproc)]


def with_torchrun(nproc: int) -> None:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    code = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "dist.init_process_group('gloo')",
            "t = torch.ones(1)",
            "dist.all_reduce(t)",
            "print(dist.get_rank())",
            "dist.destroy_process_group()",
        ]
    )
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(code)
        script.flush()
        subprocess.run(
            [torchrun, "--standalone", f"--nproc-per-node={nproc}", script.name],
            check=True,
            capture_output=True,
        )


def timed(fn, repeats, before=None):
    """The median wall time of ``repeats`` calls of ``fn``; ``before`` runs untimed before each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    n = args.nproc
    load = os.getloadavg()[0]

    def forked():
        launch(trivial, n, start_method="fork")

    def spawned():
        launch(trivial, n, start_method="spawn")

    forked()  # imports torch._dynamo here once, as a notebook's first launch does
    rows = [
        ("labs.launch, fork", timed(forked, args.repeats)),
        ("labs.launch, spawn, cold", timed(spawned, args.repeats, before=worker_pool().shutdown)),
        ("labs.launch, spawn, warm", timed(spawned, args.repeats)),  # the workers cold left
        ("torch.multiprocessing.spawn", timed(lambda: with_spawn(n), args.repeats)),
        ("torchrun --standalone", timed(lambda: with_torchrun(n), args.repeats)),
    ]
    worker_pool().shutdown()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# `python scripts/bench_launch.py`, {now}, torch {torch.__version__}, Python"
        f" {platform.python_version()}; load average before the run: {load:.2f}"
    )
    print(f"{n} gloo ranks, trivial all-reduce, median of {args.repeats}, {os.cpu_count()} cores:")
    fork = rows[0][1]
    for name, seconds in rows:
        print(f"  {name:<30} {seconds:7.3f} s   ({seconds / fork:5.1f}x the fork launcher)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
