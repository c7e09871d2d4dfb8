"""What a rank may send its parent: plain data, decoded without running any of the rank's code.

    data = encode(("ok", result, "gloo"))    # in the rank
    kind, *payload = decode(data)           # in the parent: plain data, or RefusedMessage

A rank runs code the parent does not trust: the learner's exercise, and under grading a
submission's. Python's ``pickle.loads`` runs whatever callable the bytes name (``os.system``,
or a pytest hook installed in the grader's process), so the launcher never unpickles what a rank
sends. Messages travel in ``torch.save``'s format and are read back with ``torch.load(...,
weights_only=True)``: torch's restricted unpickler, which builds only allowlisted types and calls
only allowlisted functions. What it accepts:

* torch's defaults: ``None``, bools, ints, floats, complex numbers, strings, bytes, bytearrays,
  lists, tuples, dicts, sets, ``OrderedDict``, ``Counter``; tensors and parameters (CPU, any
  dtype), ``torch.dtype``, ``torch.device``, ``torch.Size``;
* ``ALLOWED``, below: what else the course's ranks return (a frozenset, a timeline's events).

Anything else (a numpy array, a learner's own class, a function) is refused: :func:`decode`
returns :class:`RefusedMessage` naming what the bytes asked for, and ``launch`` raises a
``RankError`` for that rank telling the learner to return plain data. Nothing of the rank's runs
in the parent either way.

A test harness like the device audit: with ``LABS_RESULTS_LOG=<file>`` in the parent's
environment, each decoded message appends one line to the file, the launched function's label
and the globals its bytes named (``-`` for none): the table of what every lab's ranks send home.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import pickletools
import zipfile
from typing import NamedTuple

import torch

RESULTS_LOG_ENV = "LABS_RESULTS_LOG"
# Beyond torch's defaults, what the course's ranks return (found by running every lab's tests
# with LABS_RESULTS_LOG): a builtin container torch leaves out, and the course's result classes,
# named here and imported from the course's own code when a message is decoded. A class goes
# here only after a look at how it unpickles: its __new__, then its __setstate__ or a plain
# __dict__ update, with the decoded (plain) state.
ALLOWED = (
    "builtins.frozenset",
    "labs.measure.timeline.Event",  # the spans labs.experiments.ddp_timeline's ranks return
)


class RefusedMessage(NamedTuple):
    """What :func:`decode` returns for bytes it will not turn into objects: ``needs`` names the
    global the bytes asked for ("numpy.core.multiarray._reconstruct"), or is "" when the bytes
    were not a message at all; ``reason`` is the unpickler's complaint."""

    needs: str
    reason: str


def encode(message: object) -> bytes:
    """``message`` in ``torch.save``'s format (raises what pickling raises for an object that
    cannot be pickled: a lambda, a lock, an open file)."""
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def decode(data: bytes, label: str = "") -> object:
    """The message in ``data``, built from allowlisted types only, tensors on the CPU (a CUDA
    tensor loaded here would initialise CUDA in the parent and forbid the next fork); a
    :class:`RefusedMessage` when the bytes name anything else or are no message. ``label`` names
    the launched function in ``LABS_RESULTS_LOG``."""
    try:
        with torch.serialization.safe_globals(_allowed()):
            message = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # whatever the bytes make torch raise, they are refused
        message = RefusedMessage(_first_refused(data), _reason(e))
    if os.environ.get(RESULTS_LOG_ENV):
        _record(os.environ[RESULTS_LOG_ENV], label, data, message)
    return message


@functools.cache
def _allowed() -> list[object]:
    """The objects ``ALLOWED`` names (its modules are the standard library's and the course's)."""
    found = []
    for name in ALLOWED:
        module, _, attribute = name.rpartition(".")
        found.append(getattr(importlib.import_module(module), attribute))
    return found


def _first_refused(data: bytes) -> str:
    """The first global ``data`` names that is neither torch's default nor in ``ALLOWED``."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # not a zip of torch.save's, or no pickle in it: no global to name
        return ""
    return next((name for name in unsafe if name not in ALLOWED), "")


def _reason(error: Exception) -> str:
    """The line of torch's message that says what was wrong (torch wraps it in advice about
    ``weights_only=False``, which must never be taken here)."""
    text = str(error).split("WeightsUnpickler error:")[-1]
    boilerplate = (
        "Weights only load failed",
        "Check the documentation",
        "Please file",
        "(1)",
        "(2)",
    )
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(boilerplate)]
    # its advice to allowlist the global is for trusted files: never here
    return lines[0].split(" Please use")[0] if lines else type(error).__name__


def globals_named(data: bytes) -> list[str]:
    """The globals (``module.name``) a message's pickle names, without loading it."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            ops = pickletools.genops(archive.read(name))
            return sorted({arg.replace(" ", ".") for op, arg, _ in ops if op.name == "GLOBAL"})
    except (zipfile.BadZipFile, StopIteration, ValueError):
        return ["(not a message)"]


def _record(path: str, label: str, data: bytes, message: object) -> None:
    names = globals_named(data)
    verdict = "REFUSED " if isinstance(message, RefusedMessage) else ""
    with open(path, "a") as f:
        f.write(f"{label or '?'}\t{verdict}{' '.join(names) or '-'}\n")
