"""Several ``python -m labs.run`` command lines in one torchrun job (``tests/test_run_cli.py``).

    torchrun --nproc-per-node 2 -m tests.torchrun_labs '[["ddp", "--steps", "2", "--json"], ...]'

Every torchrun worker runs ``labs.run``'s ``main`` on each command line in turn, as ``python -m
labs.run`` runs it in a torchrun worker: each lab's launches join the job, one lab after another.
One job pays torch's start-up in every rank (~3 CPU-seconds a process on 2 cores) once for all its
labs instead of once per lab. Every worker prints a marker line before and after each lab, so that
``split_by_lab`` finds each lab's output and exit code in every rank's own stdout.
"""

from __future__ import annotations

import json
import sys

from labs.run import main

START = "### torchrun_labs start "
EXIT = "### torchrun_labs exit "


def run_all(command_lines: list[list[str]]) -> int:
    """Run every command line; the job's exit code is the worst of them."""
    worst = 0
    for argv in command_lines:
        print(START + json.dumps(argv), flush=True)
        code = main(argv)
        print(f"{EXIT}{code}", flush=True)
        worst = max(worst, code)
    return worst


def split_by_lab(stdout: str) -> dict[str, tuple[str, int | None]]:
    """One rank's stdout -> lab -> (what the rank printed for it, its exit code; None if the lab
    never finished)."""
    runs: dict[str, tuple[str, int | None]] = {}
    lab, lines = None, []
    for line in stdout.splitlines():
        if line.startswith(START):
            lab, lines = json.loads(line[len(START) :])[0], []
            runs[lab] = ("", None)
        elif line.startswith(EXIT) and lab is not None:
            runs[lab] = ("\n".join(lines), int(line[len(EXIT) :]))
            lab = None
        elif lab is not None:
            lines.append(line)
            runs[lab] = ("\n".join(lines), None)
    return runs


if __name__ == "__main__":
    sys.exit(run_all(json.loads(sys.argv[1])))
