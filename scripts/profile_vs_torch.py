"""Profile a lab's ranks to see where ours and torch's step time go (issue 13, item 2).

    python scripts/profile_vs_torch.py collectives --nproc 4 --steps 5
    python scripts/profile_vs_torch.py zero --nproc 4 --top 12

Runs ``labs.experiments.<lab>.run(vs_torch=True)`` with every launched rank function wrapped in
``torch.profiler`` (CPU activity). For each launch it prints, per rank, wall time and the rank's own
CPU time (a rank whose CPU time is far below its wall time spent the difference waiting: for a peer
in a collective, or for a core when ranks outnumber cores), then rank 0's top operators by self CPU
time, and the share of self CPU time spent in communication operators (c10d/gloo). Nothing in the
lab changes: the experiment module's ``launch`` is wrapped for the duration of the run.
"""

from __future__ import annotations

import argparse
import sys
import time

COMM_MARKERS = (
    "c10d",
    "gloo",
    "nccl",
    "send",
    "recv",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "alltoall",
    "barrier",
    "wait",
)


def is_comm(name: str) -> bool:
    name = name.lower()
    return any(m in name for m in COMM_MARKERS)


def profiled(fn, top: int):
    """``fn`` run under torch.profiler; returns (fn's result, this rank's profile digest)."""

    def rank_fn(*args):
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn(*args)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        averages = prof.key_averages()
        events = [e for e in averages if "ProfilerStep" not in e.key]
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        comm = sum(e.self_cpu_time_total for e in events if is_comm(e.key))
        table = (
            averages.table(sort_by="self_cpu_time_total", row_limit=top)
            if dist.get_rank() == 0
            else ""
        )
        digest = {
            "rank": dist.get_rank(),
            "wall_s": wall,
            "cpu_s": cpu,
            "threads": torch.get_num_threads(),
            "profiled_self_cpu_s": total / 1e6,
            "comm_share": comm / total,
            "table": table,
        }
        return out, digest

    return rank_fn


def profile_lab(lab: str, *, nproc: int, steps: int, top: int, options: dict) -> list[dict]:
    """Run ``lab`` with its launches profiled; one record per launch: desc and per-rank digests."""
    from labs.experiments.spec import command_labs
    from labs.runtime.launcher import RankResults

    module = command_labs()[lab].module
    original = module.launch
    launches = []

    def launch(fn, nprocs, *args, **kw):
        results = original(profiled(fn, top), nprocs, *args, **kw)
        desc = kw.get("desc", getattr(fn, "__name__", "?"))
        launches.append({"desc": desc, "ranks": [digest for _, digest in results]})
        # the lab reads its ranks' results and the backend they used, as from launch itself
        return RankResults([out for out, _ in results], backend=results.backend)

    module.launch = launch
    try:
        summary = module.run(nproc=nproc, steps=steps, vs_torch=True, **options)
    finally:
        module.launch = original
    print(
        f"{lab}: ours {summary['step_time_s'] * 1e3:.1f} ms/step, torch "
        f"{(summary.get('torch_step_time_s') or float('nan')) * 1e3:.1f} ms/step"
    )
    return launches


def report(launches: list[dict]) -> str:
    lines = []
    for launch in launches:
        lines.append(f"\n=== launch {launch['desc']!r}")
        for d in launch["ranks"]:
            lines.append(
                f"  rank {d['rank']}: wall {d['wall_s']:.2f} s, own CPU {d['cpu_s']:.2f} s"
                f" ({d['cpu_s'] / d['wall_s']:.0%} of wall),"
                f" self CPU in comm ops {d['comm_share']:.0%}"
            )
        lines.append(launch["ranks"][0]["table"])
    return "\n".join(lines)


def main(argv=None) -> int:
    from labs.experiments.spec import command_labs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("lab", choices=sorted(command_labs()))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="operators shown for rank 0")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a lab option, e.g. --option stage=2 (value parsed as Python literal)",
    )
    args = parser.parse_args(argv)
    import ast

    from labs.runtime.impl import set_implementation

    set_implementation("solutions")
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    print(
        report(
            profile_lab(args.lab, nproc=args.nproc, steps=args.steps, top=args.top, options=options)
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
