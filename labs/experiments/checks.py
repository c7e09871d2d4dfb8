"""Checks and verdicts: what a lab run tells a learner.

Every lab run ends in one verdict. A :class:`Check` is one comparison (losses, gradients after
step 1, parameters after the last step, bytes per op and call, state held, schedule order,
tokens) with where it was made (rank, step, parameter or op), what was measured, what was
expected, the tolerance, and, when it fails, a hint: the classic mistake that most likely
explains it ("gradients are 4x the reference: did you divide by the world size?").

    checks = [
        compare_tensors("gradients after step 1", grads, ref.grads, tolerance=1e-5,
                        where="rank 1", world_size=4),
        compare_values("all-reduce bytes per call", sent, expected, where="rank 0, step 2"),
    ]
    summary.add_checks(checks)
    print(verdict_table(summary.checks))     # PASS, or FAIL and what failed, with the hint

The hints are guesses from the numbers' shape (a ratio near N, near 1/N, near 0, an offset by
one chunk), not proofs: each names the likely cause and where to look.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

_RATIO_SLACK = 0.02  # a scale within 2% of N (or 1/N, 2, 0) counts as that scale


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison of a lab run: ``ok`` when ``measured`` equals ``expected`` within
    ``tolerance`` (relative; None for an exact check). ``where`` says which rank, step,
    parameter or op; ``hint`` (failures only) the likely cause."""

    name: str
    ok: bool
    measured: Any = None
    expected: Any = None
    tolerance: float | None = None
    where: str = ""
    hint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= _RATIO_SLACK * max(abs(target), 1e-12)


def scale_hint(what: str, scale: float, world_size: int | None) -> str:
    """The classic mistake behind ``what`` coming out ``scale`` times the reference."""
    n = world_size or 0
    if _near(scale, 0.0) or abs(scale) < _RATIO_SLACK:
        return (
            f"{what} are zero or missing: was the collective skipped, or the result never "
            "copied back (a reduction into a temporary that is then dropped)?"
        )
    if n > 1 and _near(scale, n):
        return (
            f"{what} are {n}x the reference (the world size): did you divide the sum by the "
            "world size?"
        )
    if n > 1 and _near(scale, 1 / n):
        return (
            f"{what} are 1/{n} of the reference: each rank kept only its own share (did the "
            "all-reduce run, and did it add rather than overwrite?), or you divided twice"
        )
    if _near(scale, 2.0):
        return (
            f"{what} are 2x the reference: was something reduced twice (a hook that fires "
            "twice, a tied weight counted in two places, a bucket flushed twice)?"
        )
    if _near(scale, -1.0):
        return f"{what} have the wrong sign: check the order of a subtraction"
    return ""


def tensor_scale(actual, expected) -> tuple[float, float]:
    """(scale, residual): the least-squares ``s`` with ``actual ≈ s · expected``, and
    ``|actual − s · expected| / |expected|`` (0 when ``actual`` is exactly a multiple)."""
    a = actual.double().flatten()
    e = expected.double().flatten()
    ee = float(e @ e)
    if ee == 0.0:
        return (math.inf if float(a @ a) else 1.0), 0.0
    s = float(a @ e) / ee
    return s, float((a - s * e).norm()) / math.sqrt(ee)


def compare_tensors(
    name: str,
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    tolerance: float,
    where: str = "",
    world_size: int | None = None,
    what: str = "values",
) -> Check:
    """Every tensor of ``expected`` against the one of the same name in ``actual``: the largest
    relative difference (``max |a − e| / max |e|``, per tensor) must be within ``tolerance``.
    Fails on a missing name or a shape mismatch, naming the tensor; ``what`` names the
    quantity in the hint ("gradients", "parameters")."""
    from labs.train import max_rel_diff

    missing = sorted(set(expected) - set(actual))
    if missing:
        return Check(
            name,
            False,
            measured=f"{len(missing)} missing",
            expected=f"{len(expected)} tensors",
            where=f"{where}: {', '.join(missing[:4])}".strip(": "),
            hint=f"{what} of these tensors never arrived: is a parameter skipped (frozen, unused, "
            "tied) or never reduced?",
        )
    worst_name = None
    worst = -1.0
    for key, ref in expected.items():
        got = actual[key]
        if tuple(got.shape) != tuple(ref.shape):
            return Check(
                name,
                False,
                measured=list(got.shape),
                expected=list(ref.shape),
                where=f"{where}, {key}".strip(", "),
                hint="the shard or the gathered tensor has the wrong shape: check the split "
                "dimension and the chunk sizes",
            )
        rel = max_rel_diff(got, ref)
        if rel > worst:
            worst = rel
            worst_name = key
    ok = worst <= tolerance
    hint = ""
    if not ok:
        scale, residual = tensor_scale(actual[worst_name], expected[worst_name])
        if residual < 1e-3:
            hint = scale_hint(what, scale, world_size)
        hint = hint or (
            f"{worst_name} differs from the reference by more than rounding: check the code "
            "that reduces or updates it"
        )
    return Check(
        name,
        ok,
        measured=worst,
        expected=0.0,
        tolerance=tolerance,
        where=f"{where}, {worst_name}".strip(", "),
        hint=hint,
    )


def compare_values(
    name: str,
    measured: float | int | list,
    expected: float | int | list,
    *,
    tolerance: float | None = None,
    where: str = "",
    hint: str = "",
    world_size: int | None = None,
    what: str = "values",
) -> Check:
    """``measured`` against ``expected`` (numbers, or equal-length lists compared element by
    element): exactly when ``tolerance`` is None, else within ``tolerance`` relative. A failure
    carries ``hint``, or a scale hint when the measured figure is a multiple of the expected."""
    pairs = list(zip(measured, expected)) if isinstance(expected, list) else [(measured, expected)]
    if isinstance(expected, list) and len(measured) != len(expected):
        return Check(name, False, measured, expected, tolerance, where, hint or "lengths differ")

    def close(m, e) -> bool:
        if tolerance is None:
            return m == e
        return abs(m - e) <= tolerance * max(abs(e), 1e-300)

    ok = all(close(m, e) for m, e in pairs)
    if not ok and not hint:
        bad = [(m, e) for m, e in pairs if not close(m, e)]
        m, e = bad[0]
        if e:
            hint = scale_hint(what, m / e, world_size)
    return Check(name, ok, measured, expected, tolerance, where, "" if ok else hint)


def passed(checks: Iterable[Check]) -> bool:
    """True when there is at least one check and every check passed."""
    checks = list(checks)
    return bool(checks) and all(c.ok for c in checks)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list) and len(value) > 4:
        return "[" + ", ".join(_short(v) for v in value[:4]) + ", ...]"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def verdict_table(checks: Iterable[Check], *, lab: str = "") -> str:
    """One line per check (ok or FAIL, name, where, measured vs expected), then the verdict:
    ``PASS``, or ``FAIL`` with each failed check's hint."""
    checks = list(checks)
    lines = []
    for c in checks:
        mark = "ok  " if c.ok else "FAIL"
        figures = f"{_short(c.measured)} vs {_short(c.expected)}"
        if c.tolerance is not None:
            figures += f" (tolerance {c.tolerance:g})"
        where = f" [{c.where}]" if c.where else ""
        lines.append(f"  {mark} {c.name}{where}: {figures}")
    failed = [c for c in checks if not c.ok]
    title = f"{lab}: " if lab else ""
    if not checks:
        lines.append(f"{title}FAIL: the run made no checks")
    elif failed:
        lines.append(f"{title}FAIL: {len(failed)} of {len(checks)} checks failed")
        for c in failed:
            if c.hint:
                lines.append(f"  hint ({c.name}): {c.hint}")
    else:
        lines.append(f"{title}PASS: {len(checks)} checks")
    return "\n".join(lines)
