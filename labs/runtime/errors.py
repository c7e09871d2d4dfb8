"""How a launch fails: the exceptions ``launch`` raises, and which rank's story they tell.

When one rank fails, its peers usually fail a moment later ("connection reset by peer",
blocked in a collective with a rank that is gone). The error names the root cause: a rank's
own exception first, then a rank that died, and only then the errors peers raised because
of it; with the last lines the failing rank wrote to stderr (gloo's and NCCL's messages
are there, not in any Python exception).
"""

from __future__ import annotations

import re
import signal
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

# The launcher's own code: its frames are plumbing, not the learner's story.
RUNTIME_DIR = Path(__file__).resolve().parent
ROOT = RUNTIME_DIR.parent.parent  # the repository: labs/ and solutions/ sit here
# torch.profiler's Kineto marks each start and stop on stderr ("USDT:<time> <pid>:<tid>
# SyncActivityProfilerHandler.cpp:52] profiler_start"): bookkeeping, not news
_PROFILER_MARKER = re.compile(r"^(USDT|STAGE):.*\] (profiler_start|profiler_stop|Completed Stage:)")


# The exc_type of a RankFailure for a rank whose message the parent refused to decode.
REFUSED = "RefusedResult"


class RankFailure(NamedTuple):
    """What a rank that raised sends back to the launcher."""

    exc_type: str  # e.g. "NotImplementedError"
    message: str
    traceback: str  # the text of the rank's traceback, the launcher's frames left out
    location: str = ""  # "labs/ddp.py:57": the exercise file and line where it raised, if any


def _in_runtime(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(RUNTIME_DIR)
    except (OSError, ValueError):
        return False


def exercise_location(frames: Sequence[traceback.FrameSummary]) -> str:
    """The deepest frame in an exercise module (``labs/<exercise>.py`` or
    ``solutions/<exercise>.py``) as "labs/ddp.py:57", or "" when none is on the stack."""
    from labs.runtime.impl import EXERCISES

    for frame in reversed(frames):
        path = Path(frame.filename)
        if path.stem in EXERCISES and path.parent.name in ("labs", "solutions"):
            return f"{path.parent.name}/{path.name}:{frame.lineno}"
    return ""


def rank_traceback(exc: BaseException) -> tuple[str, str]:
    """(the traceback of ``exc`` as text without the frames in ``labs/runtime``, where it raised
    in an exercise module): what a failed rank reports. A learner reads their own frames (and
    torch's), not the launcher's."""
    frames = traceback.extract_tb(exc.__traceback__)
    shown = traceback.StackSummary.from_list([f for f in frames if not _in_runtime(f.filename)])
    text = "".join(["Traceback (most recent call last):\n"] if shown else []) + "".join(
        shown.format()
    )
    text += "".join(traceback.format_exception_only(type(exc), exc))
    return text, exercise_location(frames)


def stuck_advice(location: str, rank_traceback: str) -> str:
    """When a failure happened in an earlier exercise the lab runs (your ``labs/<exercise>.py``):
    which one, and how to run its reference instead (``labs.runtime.prerequisites``); else ""."""
    if not location.startswith("labs/"):
        return ""
    try:
        from labs.runtime.prerequisites import earlier_exercise, stuck_advice

        name = earlier_exercise(location, rank_traceback)
        return stuck_advice(name) if name else ""
    except Exception:  # the advice must never hide the error it comes with
        return ""


class RankError(RuntimeError):
    """A rank raised. ``rank``, ``exc_type`` (e.g. "NotImplementedError"), ``message``
    and ``rank_traceback`` (the text of the rank's traceback) say what happened; ``advice``: when
    it raised in an earlier exercise the lab runs, which one and how to use its reference."""

    def __init__(
        self,
        rank: int,
        exc_type: str,
        message: str,
        rank_traceback: str,
        others: str = "",
        stderr_tail: str = "",
        location: str = "",
    ):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.rank_traceback = rank_traceback
        self.location = location  # "labs/ddp.py:57" when an exercise raised it
        self.advice = stuck_advice(location, rank_traceback)
        where = f" in {location}" if location else ""
        text = f"rank {rank} raised {exc_type}{where}: {message}"
        if exc_type == REFUSED:
            text = f"rank {rank} sent a result the launcher refused: {message}"
        if others:
            text += f"\n({others})"
        if self.advice:
            text += f"\n\n{self.advice}"
        text += f"\n\n--- traceback of rank {rank} ---\n{rank_traceback.rstrip()}"
        text += _tail_text(rank, stderr_tail)
        super().__init__(text)


class RankDied(RuntimeError):
    """A rank ended without a result: killed by a signal (``signal_name``) or exited early
    (``exit_code``)."""

    def __init__(self, rank: int, exit_code: int | None, text: str, stderr_tail: str = ""):
        self.rank = rank
        self.exit_code = exit_code
        self.signal_name = (
            _signal_name(-exit_code) if exit_code is not None and exit_code < 0 else None
        )
        super().__init__(text + _tail_text(rank, stderr_tail))


def _tail_text(rank: int, tail: str) -> str:
    return (
        f"\n\n--- last lines rank {rank} wrote to stderr ---\n{tail.rstrip()}"
        if tail.strip()
        else ""
    )


class LaunchTimeout(TimeoutError):
    """The run took longer than ``timeout``; ``unfinished`` lists the ranks still running."""

    # why a run usually times out
    HANG = (
        "The usual cause is a collective that some ranks call and others never reach (a skipped"
        " all_reduce, a send without a matching recv)."
    )

    def __init__(
        self, timeout: float, unfinished: list[int], finished: list[int], cause: str = HANG
    ):
        self.unfinished = unfinished
        super().__init__(
            f"timed out after {timeout:g} s: rank(s) {unfinished} had not finished"
            f" (rank(s) {finished or 'none'} returned). {cause} All ranks were killed."
        )


def refused_message(rank: int, refused) -> tuple[str, str, str, str]:
    """The RankFailure fields for a rank whose message the parent refused to decode
    (``refused``: a ``labs.runtime.wire.RefusedMessage``): what it asked for, and how to return
    plain data instead."""
    if refused.needs:
        what = (
            f"its result needs {refused.needs}, which the launcher does not rebuild. Results"
            " travel home as plain data, decoded without running any of the rank's code: None,"
            " bools, numbers, strings, bytes, lists, tuples, dicts, sets, tensors, torch dtypes,"
            " devices and sizes. Return those instead: .tolist() or torch.from_numpy() for a"
            " numpy array, dataclasses.asdict() or vars() for an object of your own"
        )
    else:
        what = "what it sent is not a launcher message"
    note = (
        f"(no traceback: rank {rank} did not raise; the parent refused its bytes, and nothing of"
        " them ran here)"
    )
    return (REFUSED, f"{what} ({refused.reason})", note, "")


def read_stderr(path: str, max_lines: int | None = None) -> str:
    """The text a rank wrote to stderr, without C++ stack frames; with ``max_lines``, only the last
    lines up to a fatal error's headline."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    lines = [
        line
        for line in lines
        if not line.startswith("frame #")  # C++ stack frames: noise
        and not _PROFILER_MARKER.match(line)
    ]
    if max_lines:
        # faulthandler's dump of every thread's stack follows the message that matters: keep its
        # headline only
        fatal = next(
            (i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None
        )
        if fatal is not None:
            lines = lines[: fatal + 1]
        lines = lines[-max_lines:]
    return "\n".join(lines)


# Errors a rank raises only because a peer failed first: not the root cause.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def raise_failure(
    errors: dict[int, Sequence[str]],
    deaths: dict[int, int | None],
    returned: list[int],
    stderr_paths: list[str],
) -> None:
    """Raise for the root cause: a rank's own exception first, then a death, and only then
    the errors that ranks raise when a peer vanished from under them. ``errors``: rank -> the
    (exc_type, message, traceback[, location]) it sent (a ``RankFailure``); ``deaths``: rank ->
    exit code."""
    __tracebackhide__ = True  # IPython: the learner's error, not this frame
    failures = {rank: RankFailure(*sent) for rank, sent in sorted(errors.items())}
    primary = [
        rank
        for rank, failure in failures.items()
        if not any(s in failure.message for s in _SECONDARY)
    ]
    context = [f"rank(s) {returned} had already returned"] if returned else []
    if primary or not deaths:
        rank = (primary or list(failures))[0]
        failure = failures[rank]
        others = [f"rank {r} raised {f.exc_type}" for r, f in failures.items() if r != rank]
        others += [_death_text(r, code) for r, code in sorted(deaths.items())]
        raise RankError(
            rank,
            failure.exc_type,
            failure.message,
            failure.traceback,
            others="; ".join(others + context),
            stderr_tail=read_stderr(stderr_paths[rank], max_lines=15),
            location=failure.location,
        )
    rank = min(deaths)
    others = [f"rank {r} then raised {f.exc_type}" for r, f in failures.items()]
    raise RankDied(
        rank,
        deaths[rank],
        "; ".join([_death_text(rank, deaths[rank])] + others + context)
        + ". The other ranks were stopped.",
        stderr_tail=read_stderr(stderr_paths[rank], max_lines=15),
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _death_text(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        name = _signal_name(-code)
        hint = (
            " (out of memory? the kernel's OOM killer sends SIGKILL)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"rank {rank} died from {name}{hint}"
    return f"rank {rank} exited with code {code} before returning a result"
