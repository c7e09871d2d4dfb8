"""Run a lab from the command line and print its summary.

    python -m labs.run collectives --nproc 4 --json
    python -m labs.run ddp --nproc 4 --steps 5 --impl solutions --vs-torch
    python -m labs.run mesh --nproc 4 --tp 2 --pp 2 --reference pipeline_parallel
                                             # your mesh, ZeRO, TP and CP on the reference PP
    torchrun --nproc-per-node 4 -m labs.run ddp --json        # each torchrun rank is a worker

Options every lab takes: ``--nproc``, ``--steps``, ``--impl solutions|labs`` (overrides
``LABS_IMPL``), ``--reference EX[,EX...]`` (the reference for those exercises alone, your code for
the rest: overrides ``LABS_REFERENCE``; every rank inherits it, torchrun's too), ``--json``,
``--vs-torch``, ``--backend auto|gloo|nccl``, ``--timeout``, ``--profile DIR`` (a torch.profiler
trace per rank, ``DIR/rank<r>.json``, and each profiled step's compute, communication and exposed
communication: ``labs.experiments.profiling``).
``python -m labs.run LAB --help`` lists the lab's own, which come from its declaration
(``labs.experiments.<lab>.LAB``, ``labs.experiments.spec``): the fields of its ``Options``.

The summary ends with the verdict: one line per check (losses, gradients, parameters, bytes per
op and call, state, ...), then ``PASS``, or ``FAIL`` with what failed, where, and a hint at the
likely cause. ``--json`` carries the same as ``passed`` and ``checks``.

Exit status: 0 when every check passed, 1 when a check failed (or the run did: a rank raised, a
timeout, an error while comparing) or the run made no checks, 2 for bad arguments (every option
is judged before any rank starts; a ``--reference`` this copy of the course does not hold, with
what to ask the instructor for), 3 when an exercise is not written yet (one line names the
function to write; when it is an earlier exercise the lab runs, the next says how to run its
reference instead).
"""

from __future__ import annotations

import argparse
import os
import sys

from labs.experiments import spec


def build_parser(lab: spec.Lab | None = None) -> argparse.ArgumentParser:
    """The command line: the options every lab takes, then ``lab``'s own (from its ``Options``);
    without a lab, every lab's name (read from the declarations, importing none)."""
    parser = argparse.ArgumentParser(
        prog="python -m labs.run", description="Run a lab and print its summary."
    )
    names = [lab.name] if lab is not None else spec.command_names()
    parser.add_argument("lab", choices=names, help="which lab")
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks (default: WORLD_SIZE under torchrun, else 4)"
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps (or repetitions)")
    parser.add_argument(
        "--impl",
        choices=("solutions", "labs"),
        default=None,
        help="whose exercise code runs (default: the LABS_IMPL switch, else labs)",
    )
    parser.add_argument(
        "--reference",
        metavar="EX[,EX...]",
        default=None,
        help="run the reference for these exercises alone and your code for the rest (default:"
        " the LABS_REFERENCE switch), e.g. --reference pipeline_parallel",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--vs-torch", action="store_true", help="also time PyTorch's own implementation"
    )
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before the run is stopped"
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="write each rank's torch.profiler trace of steps 1-3 to DIR/rank<r>.json and print"
        " each step's compute, communication and exposed communication",
    )
    if lab is not None:
        spec.add_options(parser.add_argument_group(f"{lab.name} options"), lab.options)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)
    lab = spec.lab(name) if name else None
    if lab is None or not lab.command:
        build_parser().parse_args(argv)  # prints usage and the valid lab names, exits 2
        return 2
    args = build_parser(lab).parse_args(argv)

    from labs.experiments import profiling
    from labs.experiments.common import format_summary, to_json
    from labs.runtime.errors import RankError
    from labs.runtime.impl import ReferenceUnavailable, set_implementation
    from labs.runtime.launcher import under_torchrun
    from labs.theory.dims import check_positive

    if args.impl:
        set_implementation(args.impl)  # ranks inherit the environment
    if args.nproc is None:
        args.nproc = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 4
    # Bad arguments, all of them, before any rank starts: exit 2. What fails later is the run's.
    try:
        if args.reference is not None:
            use_only_reference(args.reference)  # ranks inherit the environment
        check_positive(nproc=args.nproc, steps=args.steps)
        if args.profile:
            profiling.check_profiled(lab.name, args.steps)
        options = lab.command_line_options(args)
        lab.parse(options, nproc=args.nproc, steps=args.steps, vs_torch=args.vs_torch)
    except (ValueError, ReferenceUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NotImplementedError as e:  # a lab whose options the exercise judges (the mesh's)
        print(_unwritten_message(e), file=sys.stderr)
        return 3
    common = dict(
        nproc=args.nproc,
        steps=args.steps,
        backend=args.backend,
        vs_torch=args.vs_torch,
        timeout=args.timeout,
    )
    is_rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        if args.profile:
            summary = profiling.run_profiled(lab.name, lab.run, args.profile, **common, **options)
        else:
            summary = lab.run(**common, **options)
    except RankError as e:
        if e.exc_type == "NotImplementedError":
            print("\n\n".join(filter(None, [e.message, e.advice])), file=sys.stderr)
            return 3
        print(f"error: {e}", file=sys.stderr)
        return 1
    except NotImplementedError as e:
        print(_unwritten_message(e), file=sys.stderr)
        return 3
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = (
        profiling.profile_report(args.profile, args.nproc) if is_rank0 and args.profile else None
    )
    if report and args.json:
        summary["profile"] = profiling.json_report(report)
    if is_rank0 and args.json:
        print(to_json(summary), flush=True)  # ``passed`` and ``checks`` are in it
    elif is_rank0:
        print(format_summary(summary), flush=True)
        print(f"\n{summary.verdict()}", flush=True)
    if report and not args.json:
        print(profiling.format_report(report), flush=True)
    return 0 if summary.passed else 1


def use_only_reference(names: str) -> None:
    """``--reference``: the reference for ``names`` ("" for none) and the learner's code for the
    rest, in this process and every rank; ValueError for an unknown name, ReferenceUnavailable
    (saying what to ask for) for a reference this copy of the course does not hold."""
    from labs.runtime.impl import ReferenceUnavailable, parse_exercises, set_reference
    from labs.runtime.prerequisites import reference_available, unavailable_message

    chosen = parse_exercises(names, what="--reference")
    for name in chosen:
        if not reference_available(name):
            raise ReferenceUnavailable(unavailable_message(name))
    set_reference(chosen)


def _unwritten_message(e: NotImplementedError) -> str:
    """A NotImplementedError raised in this process, and, when it came from an earlier exercise
    the lab runs, which one and how to run its reference instead."""
    import traceback

    from labs.runtime.errors import exercise_location, stuck_advice

    frames = traceback.extract_tb(e.__traceback__)
    text = "".join(traceback.format_list(frames))
    advice = stuck_advice(exercise_location(frames), text)
    return "\n\n".join(filter(None, [str(e), advice]))
