"""The course's calculators from the command line (pure formulas, no torch needed).

    python -m labs.theory memory --preset llama3-8b --seq 4096 --mbs 1 --precision bf16-mixed \
        --zero 3 --dp 8 --json
    python -m labs.theory memory --preset llama3-8b --experts 8 --top-k 2 --dp 8 --ep 4 --zero 1 \
        --fp8 --offload --gpu-mem 79.6
    python -m labs.theory bubble --schedule 1f1b --stages 4 --microbatches 8 --json
    python -m labs.theory bubble --schedule zb-h1 --stages 4 --microbatches 8
    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \
        --gpu-mem 80 --json
    python -m labs.theory plan --preset llama3-405b --seq 8192 --gpus 16384 --global-batch 2048 \
        --recompute selective --layout tp=8,pp=16,cp=1,dp=128,zero=1,v=2
    python -m labs.theory comm --op all_reduce --bytes 1e9 --ranks 8 --json
    python -m labs.theory moe --preset mixtral-8x7b --json

Each command's module exposes ``add_arguments(parser)``, ``cli(args) -> dict`` and
optionally ``format_result(result) -> str`` for the readable (non-JSON) output.
Invalid input exits with status 2 and one line naming the parameter.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

COMMANDS = {
    # bytes per rank of a collective
    "comm": "labs.theory.comm_cli",
    # notebook 01: per-rank memory
    "memory": "labs.theory.memory_report",
    # notebook 05: pipeline bubble
    "bubble": "labs.theory.pipeline",
    # notebook 06: ring-attention work, K/V bytes, long-context memory
    "cp": "labs.theory.context_parallel",
    # notebook 07: active vs total parameters, all-to-all bytes
    "moe": "labs.theory.moe",
    # notebook 08: the parallelism planner
    "plan": "labs.theory.plan_report",
    # notebook 09: KV cache per rank, messages per token, decode time
    "infer": "labs.theory.inference",
    # notebook 11: an encoder's memory and pipeline imbalance
    "multimodal": "labs.theory.multimodal_plan",
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line), run the command, print its result; the exit
    status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m labs.theory", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}"
    )
    modules = {}
    for name, path in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name != path:
                raise
            continue  # not part of this copy of the course yet
        p = sub.add_parser(name, help=(modules[name].__doc__ or "").strip().splitlines()[0])
        modules[name].add_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    module = modules[args.command]
    try:
        result = module.cli(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json or not hasattr(module, "format_result"):
        print(json.dumps(result))
    else:
        print(module.format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
