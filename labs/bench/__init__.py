"""The course-wide benchmark: every lab beside PyTorch's own implementation and the theory.

    python -m labs.bench                          # every lab, 4 ranks, 5 steps -> out/bench/
    python -m labs.bench --out docs/bench --impl solutions
    python -m labs.bench --labs zero tp --nproc 2 4 --steps 3

Each configuration in ``BENCH`` of each lab in ``labs.run.LABS`` runs its experiment
(``labs.experiments.<lab>.run``) with ``vs_torch=True``, ``--repeats`` times, and becomes one row:
step time ours / torch's (DDP, FSDP2 ``fully_shard``, DTensor TP, ``torch.distributed.pipelining``,
``dist.all_reduce``; the fastest of the repeats, the least disturbed by other processes), bytes sent
per rank measured / theory, state bytes per rank measured / theory, the largest relative difference
from the single-process reference, and the pipeline bubble measured / theory. Writes ``bench.csv``,
``bench.md`` (the table, the machine, and a note for every configuration slower than torch's by more
than ``SLOWER``: why, from profiling with ``scripts/profile_vs_torch.py``) and ``bench.png``. A lab
whose module is not in this copy of the course is skipped with a note; a lab that fails is a row
saying why, and the others still run. Exit status 0 when every row ran (or was skipped), 1
otherwise. What it writes, and its columns, is ``labs.bench.report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping

from labs.bench.report import SLOWER, hardware, write
from labs.theory.dims import check_positive


@dataclasses.dataclass(frozen=True)
class Entry:
    """How the bench runs one configuration of a lab, and what its ``torch_step_time_s`` times."""

    # the lab's options, or a function nproc -> options
    options: dict | Callable[[int], dict] = dataclasses.field(default_factory=dict)
    torch: str | None = None  # PyTorch's counterpart, or None where there is none
    like_for_like: bool = True  # False: torch's time is not of the same parallel job
    check: str = "matches_reference"  # the summary's verdict against the reference
    vs_torch: bool = True  # False: this configuration is not comparable with torch's (see its note)
    note: str = ""  # shown under the table whatever the timing
    bubble: bool = True  # False: the lab's bubble figure means nothing in this configuration
    label: str = ""  # how the table names it (default: its options)

    def options_for(self, nproc: int) -> dict:
        return self.options(nproc) if callable(self.options) else dict(self.options)


def _mesh(nproc: int) -> dict:
    return {"dp": nproc // 2, "tp": 2} if nproc % 2 == 0 else {"dp": nproc}


# Lab -> its configurations (one row each). A lab missing here runs with its defaults.
BENCH: dict[str, list[Entry]] = {
    "collectives": [Entry(torch="dist.all_reduce", check="exact_int")],
    "memory": [
        Entry(
            options={"precisions": ("fp32",), "recomputes": ("none",)}, label="fp32, no recompute"
        )
    ],
    "ddp": [Entry(options={"variant": "bucketed"}, torch="DistributedDataParallel")],
    "zero": [
        Entry(
            options={"stage": 1},
            torch="ZeroRedundancyOptimizer under DDP",
            note="The same job, two algorithms: ours reduce-scatters the gradients and all-gathers"
            " the updated shards (2Ψ per step); torch's DDP all-reduces them (2Ψ), then"
            " ZeroRedundancyOptimizer broadcasts each rank's updated parameters (Ψ more).",
        ),
        Entry(options={"stage": 3}, torch="FSDP2 fully_shard"),
    ],
    "tp": [Entry(options={"sp": False}, torch="DTensor parallelize_module")],
    "pp": [
        Entry(
            options={"schedule": "1f1b", "op_time": 0.0},
            torch="torch.distributed.pipelining",
            bubble=False,
            note="Unpadded: the same job as torch's. Its idle time is message latency around ~1 ms "
            "operations, not the schedule's bubble (see the padded row below).",
        ),
        Entry(
            options={"schedule": "1f1b", "op_time": 0.02},
            vs_torch=False,
            note="Each forward padded to 20 ms and each backward to 40 ms with sleeps (the lab's "
            "op_time), as if every stage's compute were that long, so the bubble is measurable on "
            "CPU: compare its bubble with the theory, not its time with torch's (unpadded, in the "
            "row above).",
        ),
    ],
    "cp": [Entry(torch="SDPA, one process (no CPU context_parallel)", like_for_like=False)],
    "moe": [Entry()],
    "mesh": [Entry(options=_mesh)],
    "infer": [
        Entry(
            options={"mode": "tp"},
            torch="transformers generate, one process",
            like_for_like=False,
            check="tokens_match",
        )
    ],
    "multimodal": [
        Entry(options={"mode": "pp"}),
        Entry(
            options={"mode": "dp", "bucket_mb": 25.0},
            torch="DistributedDataParallel",
            note="25 MiB buckets, torch DDP's default, which the lab's torch run uses: at the "
            "lab's default 0.1 MiB (bucketing made visible on a tiny model) ours makes 9 "
            "all-reduces per step to torch's 1, each a gloo round trip, and was 1.5-1.9x slower "
            "(profiled).",
        ),
    ],
}

# Why ours is slower than torch's where it is (profiled with scripts/profile_vs_torch.py): text,
# then the run's own figures where the summary has them.
EXPLANATIONS = {
    "collectives": (
        "Same bytes (ratio 1.000); the gap is latency. The ring is 2(N-1) dependent rounds of "
        "`batch_isend_irecv` driven from Python: each round hands a chunk to gloo's threads, "
        "sleeps until the neighbour's chunk arrives and adds it, so it costs a wake-up and a round "
        "trip whatever the chunk size; `dist.all_reduce` runs its whole algorithm inside gloo's "
        "C++ threads. Profiled (scripts/profile_vs_torch.py, 64 Ki floats): ranks spend about half "
        "their wall time waiting, ~70% of their CPU time in the c10d send/recv calls and ~2% in "
        "the chunk adds. On 2 ranks (one per core) a round costs 0.4-0.8 ms and ours is 1.4-2.2x "
        "torch's; on 4 ranks sharing 2 cores a woken rank often waits for a core, up to a "
        "scheduler tick (4 ms, CONFIG_HZ=250), 6 rounds in a row: across our runs a round cost 1-4 "
        "ms and ours was 2.7-8x torch's. Nothing to fix in the lab: calling gloo's all-reduce "
        "instead would remove the exercise."
    ),
    "cp": (
        "Not like for like: torch's `context_parallel` has no CPU sharding rule, so torch's time "
        "is the whole batch's forward + backward in one process (no optimizer step, no ring). Ours "
        "adds, per layer, 2(N-1) K/V ring rounds each way and the gradient all-reduce, on ranks "
        "sharing 2 cores."
    ),
    "infer": (
        "Not like for like: transformers' `generate` runs in one process. Decoding is "
        "latency-bound: every token of the tensor-parallel model waits for its collectives, each a "
        "gloo round trip between processes sharing the cores, and this tiny model's compute per "
        "token is far shorter than that. Tensor-parallel decoding pays off where a token's compute "
        "dwarfs the collectives' latency (large models, NVLink)."
    ),
}


def _details(s: Mapping) -> str:
    """The run's own figures behind an explanation, where its summary has them."""
    try:
        if s["lab"] == "collectives":
            rounds = s["sends_per_rank"]
            return (
                f" Here: {rounds} rounds, {s['step_time_s'] / rounds * 1e3:.2f} ms each, against "
                f"{s['torch_step_time_s'] * 1e3:.2f} ms for the whole `dist.all_reduce`."
            )
        if s["lab"] == "pp" and s.get("op_time_s"):
            return (
                f" Here: measured {s['bubble_fraction']:.3f} against the formula's "
                f"{s['theory_bubble_fraction']:.3f}, which assumes messages cost nothing; with the "
                f"measured mean delay of {s['measured_delay_s'] * 1e3:.1f} ms per operation the "
                f"schedule run on paper gives {s['delay_bubble_fraction']:.3f} "
                "(`labs.theory.pipeline.fit_timeline`)."
            )
        if s["lab"] == "infer":
            return (
                f" Here: on one rank ours makes {s['single_tokens_per_s']:.0f} tokens/s and "
                f"transformers {s['torch_tokens_per_s']:.0f}; on {s['nproc']} ranks each token "
                f"waits for {s['messages_per_token']} collectives of {s['message_s'] * 1e3:.2f} ms "
                f"(measured), {s['latency_per_token_s'] * 1e3:.1f} ms per token in all."
            )
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    return ""


DIFF_KEYS = ("max_rel_loss_diff", "max_rel_diff", "max_abs_loss_diff")


def _per_rank(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def ratio(measured, theory) -> float | None:
    """measured / theory, rank by rank; the rank farthest from 1 (None when either is missing)."""
    if measured is None or theory is None:
        return None
    m = _per_rank(measured)
    t = _per_rank(theory)
    t = t * len(m) if len(t) == 1 else t
    ratios = [a / b if b else (1.0 if a == b else float("inf")) for a, b in zip(m, t)]
    return max(ratios, key=lambda r: abs(r - 1)) if ratios else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _most(value) -> float | None:
    """The largest of a per-rank figure (or the one figure)."""
    return None if value is None else max(_per_rank(value))


def row_from_summary(s: Mapping, entry: Entry, wall_s: float) -> dict:
    """One bench row from a lab's summary (a ``labs.experiments.common.RunSummary``: the contract's
    keys and its own)."""
    diff_key = next((k for k in DIFF_KEYS if s.get(k) is not None), None)
    ours = s.get("step_time_s")
    theirs = s.get("torch_step_time_s")
    bubble = s.get("bubble_fraction")
    theory_bubble = s.get("theory_bubble_fraction")
    if not entry.bubble:
        bubble = theory_bubble = None
    matches = s.get(entry.check)
    return {
        "lab": s["lab"],
        "config": label(entry, s["nproc"]),
        "nproc": s["nproc"],
        "backend": s["backend"],
        "impl": s.get("impl"),
        "steps": s["steps"],
        "status": "ok",
        "ours_ms": _ms(ours),
        "torch_ms": _ms(theirs),
        "torch_impl": s.get("torch_impl") or (entry.torch if theirs is not None else None),
        "same_job": entry.like_for_like if theirs is not None else None,
        "ours_over_torch": ours / theirs if ours and theirs else None,
        "comm_bytes": _most(s.get("comm_bytes_per_rank")),
        "theory_comm_bytes": _most(s.get("theory_comm_bytes_per_rank")),
        "comm_ratio": ratio(s.get("comm_bytes_per_rank"), s.get("theory_comm_bytes_per_rank")),
        "state_bytes": _most(s.get("state_bytes_per_rank")),
        "theory_state_bytes": _most(s.get("theory_state_bytes_per_rank")),
        "state_ratio": ratio(s.get("state_bytes_per_rank"), s.get("theory_state_bytes_per_rank")),
        "max_diff": s.get(diff_key) if diff_key else None,
        "diff_key": diff_key,
        "matches_reference": None if matches is None else bool(matches),
        "bubble": bubble,
        "theory_bubble": theory_bubble,
        "bubble_ratio": bubble / theory_bubble if bubble is not None and theory_bubble else None,
        "wall_s": wall_s,
        "note": note_for(s, entry),
    }


def note_for(s: Mapping, entry: Entry) -> str:
    """The configuration's note, and why ours is slower than torch's when it is by more than
    ``SLOWER``."""
    ours = s.get("step_time_s")
    theirs = s.get("torch_step_time_s")
    parts = [entry.note]
    if ours and theirs and ours > SLOWER * theirs:
        why = EXPLANATIONS.get(
            s["lab"], f"Not explained yet: run `python scripts/profile_vs_torch.py {s['lab']}`."
        )
        kind = "" if entry.like_for_like else " (torch's time is not of the same parallel job)"
        parts.append(f"Ours is {ours / theirs:.2f}x torch's{kind}. {why}")
    if any(parts):
        parts.append(_details(s).strip())
    return " ".join(filter(None, parts))


def merge_repeats(summaries: list[Mapping], entry: Entry) -> dict:
    """One summary from repeated runs: the fastest step times (the least disturbed by other
    processes), the largest difference from the reference, the reference check of every run."""
    merged = dict(summaries[0])
    for key in ("step_time_s", "torch_step_time_s"):
        times = [s[key] for s in summaries if s.get(key) is not None]
        merged[key] = min(times) if times else None
    for key in DIFF_KEYS:
        if merged.get(key) is not None:
            merged[key] = max(s[key] for s in summaries)
    if merged.get(entry.check) is not None:
        merged[entry.check] = all(s.get(entry.check) for s in summaries)
    return merged


def label(entry: Entry, nproc: int) -> str:
    """The configuration's label, or its options as ``key=value`` pairs."""
    return entry.label or " ".join(f"{k}={v}" for k, v in entry.options_for(nproc).items())


def run_config(
    lab: str,
    entry: Entry,
    *,
    nproc: int,
    steps: int,
    backend: str = "auto",
    timeout: float = 180.0,
    vs_torch: bool = True,
    repeats: int = 1,
) -> dict:
    """Run one configuration of a lab (with torch's side by side unless ``vs_torch=False``); its
    bench row. A failure is a row too: status "failed", "not written" (a stub), "invalid" (the lab
    refused these options, e.g. this rank count) or "skipped" (the lab is not in this copy of the
    course)."""
    from labs.run import LABS

    base = {
        "lab": lab,
        "config": label(entry, nproc),
        "nproc": nproc,
        "backend": backend,
        "steps": steps,
    }
    try:
        module = importlib.import_module(LABS[lab])
    except ModuleNotFoundError as e:
        if e.name != LABS[lab]:
            raise
        return {
            **base,
            "status": "skipped",
            "note": f"{LABS[lab]} is not in this copy of the course yet",
        }
    accepted = inspect.signature(module.run).parameters
    options = entry.options_for(nproc)
    ignored = sorted(set(options) - set(accepted))
    if ignored:  # the lab renamed an option: say so rather than bench something else quietly
        return {
            **base,
            "status": "invalid",
            "note": f"{LABS[lab]}.run takes no option(s) {ignored}",
        }
    t0 = time.perf_counter()
    summaries = []
    try:
        for _ in range(repeats):
            summaries.append(
                module.run(
                    nproc=nproc,
                    steps=steps,
                    backend=backend,
                    vs_torch=vs_torch and entry.vs_torch,
                    timeout=timeout,
                    **options,
                )
            )
    except Exception as e:
        # RankError, LaunchTimeout, ValueError, NotImplementedError: the row says which
        message = getattr(e, "message", None) or (str(e).splitlines() or [""])[0]
        status = (
            "not written"
            if "NotImplementedError" in (type(e).__name__, getattr(e, "exc_type", ""))
            else "invalid"
            if isinstance(e, ValueError)
            else "failed"
        )
        return {
            **base,
            "status": status,
            "wall_s": time.perf_counter() - t0,
            "note": f"{type(e).__name__}: {message}"[:300],
        }
    return row_from_summary(merge_repeats(summaries, entry), entry, time.perf_counter() - t0)


def run_lab(lab: str, *, nproc: int, steps: int, **kw) -> list[dict]:
    """Every configuration of ``lab`` in ``BENCH`` (its defaults if it has none there): one row
    each."""
    return [
        run_config(lab, entry, nproc=nproc, steps=steps, **kw)
        for entry in BENCH.get(lab, [Entry()])
    ]


def run_bench(
    *,
    labs=None,
    nprocs=(4,),
    steps: int = 5,
    repeats: int = 3,
    backend: str = "auto",
    timeout: float = 180.0,
    progress: bool = True,
) -> list[dict]:
    """Every lab in ``labs`` (default: all of ``labs.run.LABS``) at every rank count in
    ``nprocs``."""
    from tqdm.auto import tqdm

    from labs.run import LABS

    labs = list(labs or LABS)
    unknown = [lab for lab in labs if lab not in LABS]
    if unknown:
        raise ValueError(f"labs={unknown} are not labs; choose from {sorted(LABS)}")
    for n in nprocs:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"nproc must be integers >= 1, got {n!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"steps must be an integer >= 2 (the first step is a warm-up), got {steps!r}"
        )
    check_positive(repeats=repeats)
    jobs = [(lab, entry, n) for lab in labs for entry in BENCH.get(lab, [Entry()]) for n in nprocs]
    rows = []
    with tqdm(jobs, desc="bench", unit="run", disable=not progress, position=0) as bar:
        for lab, entry, n in bar:
            bar.set_postfix_str(f"{lab} x{n}")
            rows.append(
                run_config(
                    lab,
                    entry,
                    nproc=n,
                    steps=steps,
                    backend=backend,
                    timeout=timeout,
                    repeats=repeats,
                )
            )
    return rows


def main(argv=None) -> int:
    from labs.run import LABS

    parser = argparse.ArgumentParser(
        prog="python -m labs.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", default="out/bench", help="folder for bench.csv, bench.md, bench.png"
    )
    parser.add_argument(
        "--labs", nargs="+", choices=sorted(LABS), default=None, help="default: every lab"
    )
    parser.add_argument(
        "--nproc", nargs="+", type=int, default=[4], help="rank counts (each lab at each)"
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps (or repetitions) per lab"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per lab; the fastest step times count (the least disturbed by other processes)",
    )
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument(
        "--impl",
        choices=("solutions", "labs"),
        default=None,
        help="whose exercise code runs (default: the LABS_IMPL switch)",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per lab run")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    # On a GPU machine, launch's backend choice calls torch.cuda.is_available(), which initialises
    # CUDA here unless it may ask NVML, and forked NCCL ranks could then not initialise it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from labs.runtime.impl import implementation, set_implementation

    if args.impl:
        set_implementation(args.impl)
    try:
        rows = run_bench(
            labs=args.labs,
            nprocs=args.nproc,
            steps=args.steps,
            repeats=args.repeats,
            backend=args.backend,
            timeout=args.timeout,
            progress=args.progress,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "repeats": args.repeats,
        "hardware": hardware(),
        "impl": implementation(),
        "command": "python -m labs.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    paths = write(rows, args.out, meta)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1
