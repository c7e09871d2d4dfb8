"""Bytes each rank sends in one collective (ring algorithms).

python -m labs.theory comm --op all_reduce --bytes 4e8 --ranks 8 [--bandwidth-gbs 100] --json
"""

from __future__ import annotations

import argparse

from labs.theory.comm import BYTES_PER_RANK, ring_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``comm`` command's options."""
    parser.add_argument("--op", required=True, choices=sorted(BYTES_PER_RANK))
    parser.add_argument("--bytes", type=float, required=True, help="K: bytes of the tensor")
    parser.add_argument("--ranks", type=int, required=True, help="N: ranks in the group")
    parser.add_argument(
        "--bandwidth-gbs", type=float, default=None, help="per-rank link bandwidth, GB/s"
    )


def cli(args: argparse.Namespace) -> dict:
    """The command's result: bytes per rank and ring steps (and seconds, given a bandwidth)."""
    sent = BYTES_PER_RANK[args.op](args.bytes, args.ranks)
    result = {
        "op": args.op,
        "tensor_bytes": args.bytes,
        "ranks": args.ranks,
        "bytes_per_rank": sent,
        "ring_steps": ring_steps(args.op, args.ranks),
    }
    if args.bandwidth_gbs is not None:
        if args.bandwidth_gbs <= 0:
            raise ValueError(f"--bandwidth-gbs must be > 0, got {args.bandwidth_gbs}")
        result["seconds"] = sent / (args.bandwidth_gbs * 1e9)
    return result


def format_result(r: dict) -> str:
    """``cli``'s result as one sentence."""
    text = (
        f"{r['op']} of {r['tensor_bytes']:.4g} B over {r['ranks']} ranks: "
        f"{r['bytes_per_rank']:.4g} B sent per rank in {r['ring_steps']} ring steps"
    )
    if "seconds" in r:
        text += f", {r['seconds'] * 1e3:.3g} ms at the given bandwidth"
    return text
