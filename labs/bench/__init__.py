"""The course-wide benchmark: every lab beside PyTorch's own implementation and the theory.

    python -m labs.bench                          # every lab, 4 ranks, 5 steps -> out/bench/
    python -m labs.bench --out docs/bench --impl solutions
    python -m labs.bench --labs zero tp --nproc 2 4 --steps 3
    python -m labs.bench --labs mesh --reference pipeline_parallel   # your labs, the reference PP

Each configuration of each lab (its declaration's ``bench``: ``LAB.bench`` in
``labs.experiments.<lab>``, ``labs.experiments.spec.Bench``) runs the lab's ``run`` with
``vs_torch=True``, ``--repeats`` times, and becomes one row:
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
import datetime
import os
import sys
import time
from collections.abc import Mapping

from labs.bench.report import SLOWER, hardware, write
from labs.experiments import spec
from labs.experiments.spec import Bench
from labs.theory.dims import check_positive

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


def row_from_summary(s: Mapping, entry: Bench, wall_s: float) -> dict:
    """One bench row from a lab's summary (a ``labs.experiments.common.RunSummary``: the contract's
    keys and its own)."""
    diff_key = next((k for k in DIFF_KEYS if s.get(k) is not None), None)
    ours = s.get("step_time_s")
    theirs = s.get("torch_step_time_s")
    bubble = s.get("bubble_fraction")
    theory_bubble = s.get("theory_bubble_fraction")
    if not entry.bubble:
        bubble = theory_bubble = None
    matches = s.get("matches_reference")  # read off the run's checks (RunSummary)
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


def note_for(s: Mapping, entry: Bench) -> str:
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


def merge_repeats(summaries: list[Mapping], entry: Bench) -> dict:
    """One summary from repeated runs: the fastest step times (the least disturbed by other
    processes), the largest difference from the reference, every run's checks against it."""
    merged = dict(summaries[0])
    for key in ("step_time_s", "torch_step_time_s"):
        times = [s[key] for s in summaries if s.get(key) is not None]
        merged[key] = min(times) if times else None
    for key in DIFF_KEYS:
        if merged.get(key) is not None:
            merged[key] = max(s[key] for s in summaries)
    if merged.get("matches_reference") is not None:
        merged["matches_reference"] = all(s.get("matches_reference") for s in summaries)
    return merged


def label(entry: Bench, nproc: int) -> str:
    """The configuration's label, or its options as ``key=value`` pairs."""
    return entry.label or " ".join(f"{k}={v}" for k, v in entry.options_for(nproc).items())


def run_config(
    lab: str,
    entry: Bench,
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
    base = {
        "lab": lab,
        "config": label(entry, nproc),
        "nproc": nproc,
        "backend": backend,
        "steps": steps,
    }
    declared = spec.lab(lab)
    if declared is None:
        return {
            **base,
            "status": "skipped",
            "note": f"labs.experiments.{lab} is not in this copy of the course yet",
        }
    options = entry.options_for(nproc)
    vs_torch = vs_torch and entry.vs_torch
    t0 = time.perf_counter()
    summaries = []
    try:
        declared.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    except ValueError as e:  # the lab refuses these options (e.g. this rank count), or lost one
        return {**base, "status": "invalid", "note": f"ValueError: {e}"[:300]}
    except NotImplementedError as e:  # a check that asks the exercise (the mesh's)
        return {**base, "status": "not written", "note": f"NotImplementedError: {e}"[:300]}
    try:
        for _ in range(repeats):
            summaries.append(
                declared.run(
                    nproc=nproc,
                    steps=steps,
                    backend=backend,
                    vs_torch=vs_torch,
                    timeout=timeout,
                    **options,
                )
            )
    except Exception as e:
        # RankError, LaunchTimeout, NotImplementedError, an error while comparing: the row says
        message = getattr(e, "message", None) or (str(e).splitlines() or [""])[0]
        unwritten = "NotImplementedError" in (type(e).__name__, getattr(e, "exc_type", ""))
        status = "not written" if unwritten else "failed"
        return {
            **base,
            "status": status,
            "wall_s": time.perf_counter() - t0,
            "note": f"{type(e).__name__}: {message}"[:300],
        }
    return row_from_summary(merge_repeats(summaries, entry), entry, time.perf_counter() - t0)


def configurations(lab: str) -> tuple[Bench, ...]:
    """The bench's configurations of ``lab``: its declaration's (one with its defaults when the lab
    is not in this copy of the course, for the row that says so)."""
    declared = spec.lab(lab)
    return declared.bench if declared is not None else (Bench(),)


def run_lab(lab: str, *, nproc: int, steps: int, **kw) -> list[dict]:
    """Every configuration of ``lab`` (``configurations``): one row each."""
    return [run_config(lab, entry, nproc=nproc, steps=steps, **kw) for entry in configurations(lab)]


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
    """Every lab in ``labs`` (default: every ``labs.run`` lab) at every rank count in
    ``nprocs``."""
    from tqdm.auto import tqdm

    known = spec.command_labs()
    labs = list(labs or known)
    unknown = [lab for lab in labs if lab not in known]
    if unknown:
        raise ValueError(f"labs={unknown} are not labs; choose from {sorted(known)}")
    for n in nprocs:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"nproc must be integers >= 1, got {n!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"steps must be an integer >= 2 (the first step is a warm-up), got {steps!r}"
        )
    check_positive(repeats=repeats)
    jobs = [(lab, entry, n) for lab in labs for entry in configurations(lab) for n in nprocs]
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
    parser = argparse.ArgumentParser(
        prog="python -m labs.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", default="out/bench", help="folder for bench.csv, bench.md, bench.png"
    )
    parser.add_argument(
        "--labs",
        nargs="+",
        choices=sorted(spec.command_labs()),
        default=None,
        help="default: every lab",
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
    parser.add_argument(
        "--reference",
        metavar="EX[,EX...]",
        default=None,
        help="the reference for these exercises alone, your code for the rest (default: the"
        " LABS_REFERENCE switch)",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per lab run")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    # On a GPU machine, launch's backend choice calls torch.cuda.is_available(), which initialises
    # CUDA here unless it may ask NVML, and forked NCCL ranks could then not initialise it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from labs.run import use_only_reference
    from labs.runtime.impl import ReferenceUnavailable, implementation, set_implementation

    if args.impl:
        set_implementation(args.impl)
    try:
        if args.reference is not None:
            use_only_reference(args.reference)
        rows = run_bench(
            labs=args.labs,
            nprocs=args.nproc,
            steps=args.steps,
            repeats=args.repeats,
            backend=args.backend,
            timeout=args.timeout,
            progress=args.progress,
        )
    except (ValueError, ReferenceUnavailable) as e:
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
