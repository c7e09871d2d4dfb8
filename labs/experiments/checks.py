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

What the labs build their verdicts from:

    training_checks(losses=..., grads=[rank 0's, rank 1's, ...], params=[...], ...)
        # losses every step, every rank's gradients after step 1 and parameters after the last
        # step by name, with the tolerance table's rules (labs.train.rule)
    ranks_check(name, per_rank, expected)      # compare_tensors on every rank; names the rank
    calls_check(name, per_rank_calls, expected)          # counts, then call by call
    collectives_checks(per_rank_triples, expected)       # per (phase, op): bytes per call
    losses_check(losses, reference)      # wrong at step 1: the forward; only later: the update

A check says what it compares against (``against``): "reference" (the single-process run),
"theory" (a formula's figure), "torch" (PyTorch's own implementation), or "" (the ranks' own
consistency: identical replicas, every parameter placed once). ``matches(checks, "reference")``
is the one rule that turns the checks into a lab's ``matches_reference``.

The hints are guesses from the numbers' shape (a ratio near N, near 1/N, near 0, an offset by
one chunk), not proofs: each names the likely cause and where to look. A lab adds its own where
the numbers say more (a ring's chunk per round, a schedule's order, where greedy tokens part).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

_RATIO_SLACK = 0.02  # a scale within 2% of N (or 1/N, 2, 0) counts as that scale


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison of a lab run: ``ok`` when ``measured`` equals ``expected`` within
    ``tolerance`` (relative; None for an exact check). ``where`` says which rank, step,
    parameter or op; ``hint`` (failures only) the likely cause; ``against`` what the figure is
    compared with: "reference", "theory", "torch", or "" (the run's own consistency); ``tensor``
    (``compare_tensors``) the tensor the figures are of, by name: the worst, or the first missing
    or misshapen one."""

    name: str
    ok: bool
    measured: Any = None
    expected: Any = None
    tolerance: float | None = None
    where: str = ""
    hint: str = ""
    against: str = ""
    tensor: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= _RATIO_SLACK * max(abs(target), 1e-12)


def scale_hint(
    what: str,
    scale: float,
    world_size: int | None,
    known_scales: Mapping[float, str] | None = None,
) -> str:
    """The classic mistake behind ``what`` coming out ``scale`` times the reference.
    ``known_scales``: a lab's own factors and their causes (e.g. ``{2.0: "did you divide each
    micro-batch's loss by the number of micro-batches?"}``), tried first."""
    for factor, cause in (known_scales or {}).items():
        if _near(scale, factor):
            return f"{what} are {factor:g}x the reference: {cause}"
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


# A failure's hint when no scale explains it: a text, or a function of the worst tensor's name (a
# lab's own diagnosis of that tensor, e.g. "the ranks hold different gradients for <name>").
Hint = str | Callable[[str], str]


def _hint_for(hint: Hint, name: str) -> str:
    return hint(name) if callable(hint) else hint


def compare_tensors(
    name: str,
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    *,
    tolerance: float,
    where: str = "",
    world_size: int | None = None,
    what: str = "values",
    known_scales: Mapping[float, str] | None = None,
    absolute: tuple[str, ...] = (),
    hint: Hint = "",
    against: str = "reference",
) -> Check:
    """Every tensor of ``expected`` against the one of the same name in ``actual``: the largest
    relative difference (``max |a − e| / max |e|``, per tensor) must be within ``tolerance``.
    Fails on a missing name (or a None: a gradient that never arrived) or a shape mismatch,
    naming the tensor; ``what`` names the quantity in the hint ("gradients", "parameters").
    Tensors whose name ends with one of ``absolute`` are compared against the largest magnitude
    of all of ``expected`` instead of their own (a quantity that is zero in exact arithmetic, so
    its computed value is rounding noise). A failure's hint: the classic cause read off the scale
    (``scale_hint``, with the lab's ``known_scales`` first), else ``hint`` (a text, or a function
    of the tensor's name), else a line naming the tensor."""
    from labs.train import max_rel_diff

    missing = sorted(k for k in expected if actual.get(k) is None)
    if missing:
        return Check(
            name,
            False,
            measured=f"{len(missing)} missing",
            expected=f"{len(expected)} tensors",
            where=f"{where}, {', '.join(missing[:4])}".strip(", "),
            hint=f"{what} of these tensors never arrived: is a parameter skipped (frozen, unused, "
            "tied) or never reduced?",
            against=against,
            tensor=missing[0],
        )
    largest = max((float(e.abs().max()) for e in expected.values() if e.numel()), default=1.0)
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
                hint=_hint_for(hint, key)
                or "the shard or the gathered tensor has the wrong shape: check the split "
                "dimension and the chunk sizes",
                against=against,
                tensor=key,
            )
        if key.endswith(absolute) and absolute:
            rel = (got.double() - ref.double()).abs().max().item() / (largest or 1.0)
        else:
            rel = max_rel_diff(got.double(), ref.double())
        if math.isnan(rel):  # an inf or nan where the reference has none: never "close"
            rel = math.inf
        if rel > worst:
            worst = rel
            worst_name = key
    ok = worst <= tolerance
    found = ""
    if not ok:
        scale, residual = tensor_scale(actual[worst_name], expected[worst_name])
        if residual < 1e-3:
            found = scale_hint(what, scale, world_size, known_scales)
        found = (
            found
            or _hint_for(hint, worst_name)
            or (
                f"{worst_name} differs from the reference by more than rounding: check the code "
                "that reduces or updates it"
            )
        )
    return Check(
        name,
        ok,
        measured=worst,
        expected=0.0,
        tolerance=tolerance,
        where=f"{where}, {worst_name}".strip(", "),
        hint=found,
        against=against,
        tensor=worst_name or "",
    )


def step_tolerances(tolerance: float | Sequence[float], steps: int) -> list[float]:
    """One bound per step: ``tolerance`` itself when it is a list (``labs.train.Rule.per_step``:
    a bound that grows over a long run), else the same number at every step."""
    if isinstance(tolerance, (int, float)):
        return [float(tolerance)] * steps
    return list(tolerance)


def losses_check(
    losses: list[float],
    reference: list[float],
    *,
    tolerance: float | Sequence[float],
    name: str = "losses",
    first_step_hint: str = "",
    later_step_hint: str = "",
) -> Check:
    """Every step's loss against the reference's, relative, within ``tolerance`` (one number, or
    one per step): the worst step (the largest difference over its bound) is reported. A failure
    at step 1 means the forward differs (before any update): ``first_step_hint``; a failure only
    later means the update does: ``later_step_hint``."""
    if len(losses) != len(reference):
        return Check(
            name,
            False,
            len(losses),
            len(reference),
            where="steps",
            hint="the run reported another number of losses than it made steps",
            against="reference",
        )
    diffs = [abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses, reference)]
    diffs = [math.inf if math.isnan(d) else d for d in diffs]  # a nan loss is never close
    bounds = step_tolerances(tolerance, len(diffs))
    worst = max(range(len(diffs)), key=lambda i: diffs[i] / bounds[i] if bounds[i] else diffs[i])
    bad = [i for i, (d, t) in enumerate(zip(diffs, bounds)) if d > t]
    hint = ""
    if bad and bad[0] == 0:
        hint = first_step_hint or (
            "the loss differs already at step 1, before any update: the forward pass differs "
            "(the data each rank reads, the model's split, or how the ranks' losses combine)"
        )
    elif bad:
        hint = later_step_hint or (
            f"step 1 matches and step {bad[0] + 1} does not: the forward is right, the update"
            " is not (the gradients that reach the optimizer, their synchronisation, or gradients"
            " left over from the previous step)"
        )
    return Check(
        name,
        not bad,
        measured=diffs[worst],
        expected=0.0,
        tolerance=bounds[worst],
        where=f"step {worst + 1} of {len(diffs)}",
        hint=hint,
        against="reference",
    )


def ranks_check(
    name: str,
    actual: Sequence[Mapping[str, Any] | None],
    expected: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    *,
    tolerance: float,
    step: int | None = None,
    world_size: int | None = None,
    what: str = "values",
    known_scales: Mapping[float, str] | None = None,
    absolute: tuple[str, ...] = (),
    hint: Hint = "",
    against: str = "reference",
) -> Check:
    """``compare_tensors`` on every rank: ``actual[r]`` (None: rank r holds none of them) against
    ``expected[r]`` (or one mapping for every rank). Returns the first rank's failure, else the
    worst rank's pass, ``where`` = "rank r, step s, <tensor>"."""
    checks = []
    for r, got in enumerate(actual):
        if got is None:
            continue
        want = expected if isinstance(expected, Mapping) else expected[r]
        at = f"rank {r}" + (f", step {step}" if step is not None else "")
        checks.append(
            compare_tensors(
                name,
                got,
                want,
                tolerance=tolerance,
                where=at,
                world_size=world_size,
                what=what,
                known_scales=known_scales,
                absolute=absolute,
                hint=hint,
                against=against,
            )
        )
    if not checks:
        return Check(
            name,
            False,
            "nothing",
            "every rank's",
            tolerance,
            hint="no rank reported any",
            against=against,
        )
    failed = [c for c in checks if not c.ok]
    if failed:
        return failed[0]
    return max(checks, key=lambda c: c.measured)


def calls_check(
    name: str,
    measured: Sequence[Sequence[float]],
    expected: Sequence[Sequence[float]],
    *,
    world_size: int | None = None,
    what: str = "bytes",
    count_hint: str = "",
    hint: str = "",
    tolerance: float = 1e-9,
    known_scales: Mapping[float, str] | None = None,
    against: str = "theory",
) -> Check:
    """Per rank, the figure of every call (e.g. the bytes of each all-reduce, in the order they
    were issued) against the expected list: first the number of calls, then call by call (within
    ``tolerance`` relative, for formulas with fractions). Returns the first mismatch, ``where`` =
    "rank r, call i"; passing, rank 0's lists. ``known_scales``: as ``scale_hint``'s."""
    for r, (got, want) in enumerate(zip(measured, expected)):
        got = list(got)
        want = list(want)
        if len(got) != len(want):
            return Check(
                name,
                False,
                len(got),
                len(want),
                where=f"rank {r}: calls",
                hint=count_hint
                or f"rank {r} issued {len(got)} calls where {len(want)} were expected: a "
                "collective skipped, issued twice, or issued per tensor instead of per bucket?",
                against=against,
            )
        for i, (m, e) in enumerate(zip(got, want)):
            if abs(m - e) > tolerance * max(abs(e), 1.0):
                found = scale_hint(what, m / e, world_size, known_scales) if e else ""
                return Check(
                    name,
                    False,
                    m,
                    e,
                    where=f"rank {r}, call {i + 1} of {len(want)}",
                    hint=found
                    or hint
                    or f"call {i + 1} on rank {r} moved {m:g} {what} instead of {e:g}: check the "
                    "tensor (or chunk) it was given",
                    against=against,
                )
    first = list(measured[0]) if measured else []
    return Check(
        name,
        len(measured) == len(expected),
        first,
        list(expected[0]) if expected else [],
        where=f"{len(measured)} ranks, {len(first)} calls each",
        against=against,
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
    against: str = "theory",
) -> Check:
    """``measured`` against ``expected`` (numbers, or equal-length lists compared element by
    element): exactly when ``tolerance`` is None, else within ``tolerance`` relative. A failure
    carries ``hint``, or a scale hint when the measured figure is a multiple of the expected.
    ``against``: what ``expected`` comes from, a formula ("theory", the usual case) or another."""
    pairs = list(zip(measured, expected)) if isinstance(expected, list) else [(measured, expected)]
    if isinstance(expected, list) and len(measured) != len(expected):
        return Check(
            name, False, measured, expected, tolerance, where, hint or "lengths differ", against
        )

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
    return Check(name, ok, measured, expected, tolerance, where, "" if ok else hint, against)


def collectives_checks(
    measured: Sequence[Sequence[tuple[str, str, float]]],
    expected: Sequence[Sequence[tuple[str, str, float]]],
    *,
    world_size: int | None = None,
    count_hint: str = "",
    hint: str = "",
    prefix: str = "",
) -> list[Check]:
    """Bytes per op and per call: ``measured[r]`` and ``expected[r]`` are rank r's collectives as
    (phase, op, bytes sent) triples. One check per (phase, op) that either side has, named
    "<prefix><phase> <op> bytes per call", comparing every rank's calls with ``calls_check``, in
    increasing size (the order autograd issues them in is not the contract). ``count_hint`` and
    ``hint`` may use ``{phase}`` and ``{op}``."""
    keys = sorted({(ph, op) for calls in [*measured, *expected] for ph, op, _ in calls})
    checks = []
    for phase, op in keys:

        def pick(calls, phase=phase, op=op):
            return sorted(b for ph, o, b in calls if (ph, o) == (phase, op))

        checks.append(
            calls_check(
                f"{prefix}{phase} {op} bytes per call".strip(),
                [pick(c) for c in measured],
                [pick(c) for c in expected],
                world_size=world_size,
                count_hint=count_hint.format(phase=phase, op=op),
                hint=hint.format(phase=phase, op=op),
            )
        )
    return checks


def training_checks(
    *,
    losses: list[float],
    reference_losses: list[float],
    grads: Sequence[Mapping[str, Any] | None] | None,
    reference_grads: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None,
    params: Sequence[Mapping[str, Any] | None] | None = None,
    reference_params: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    dtype=None,
    loss_dtype=None,
    backend: str = "gloo",
    world_size: int | None = None,
    prefix: str = "",
    known_scales: Mapping[float, str] | None = None,
    absolute: tuple[str, ...] = (),
    first_step_hint: str = "",
    grad_hint: Hint = "",
    mixed: bool = False,
) -> list[Check]:
    """The three checks of a training lab against its single-process reference, with the course's
    tolerances (``labs.train.rule``: "value" for losses and gradients, "param" for parameters after
    AdamW steps, by ``dtype`` and ``backend``):

    * ``losses``: every step;
    * ``gradients after step 1``: every rank's, by parameter name (``grads[r]``: rank r's by name,
      None where it holds none; ``reference_grads``: one mapping, or one per rank, e.g. the shard a
      rank holds);
    * ``parameters after step S``: every rank's, by name (when ``params`` is given).

    AdamW hides a gradient's scale from the losses (it divides by the gradient's own RMS), so a
    gradient N times too large trains the same model: only the gradient check sees it.
    ``grad_hint``: a failed gradient check's hint when no scale explains it (a text, or a function
    of the worst tensor's name). ``prefix``
    names the variant in each check's name ("naive: losses"); ``loss_dtype``: the dtype the loss
    is computed in, when not the model's (the course model's is at least fp32). The bounds of the
    losses and of the parameters after the last step grow over a long run (``Rule.at``).
    ``mixed``: a mixed-precision run against the reference under the same policy, ``dtype`` the
    parameters' (bf16, fp16): the table's "mixed_loss", "mixed_grad" and "mixed_param" rules."""
    import torch

    from labs.train import rule

    dtype = dtype or torch.float32
    loss_dtype = loss_dtype or dtype
    kinds = ("mixed_loss", "mixed_grad", "mixed_param") if mixed else ("value", "value", "param")
    loss_rule = rule(kinds[0], dtype if mixed else loss_dtype, backend)
    grad_rule = rule(kinds[1], dtype, backend)
    param_rule = rule(kinds[2], dtype, backend)
    steps = len(reference_losses)
    checks = [
        losses_check(
            losses,
            reference_losses,
            tolerance=loss_rule.per_step(steps),
            name=f"{prefix}losses",
            first_step_hint=first_step_hint,
        )
    ]
    grads_check = None
    if grads is not None:
        grads_check = ranks_check(
            f"{prefix}gradients after step 1",
            grads,
            reference_grads,
            tolerance=grad_rule.rel,
            step=1,
            world_size=world_size,
            what="gradients",
            known_scales=known_scales,
            absolute=absolute,
            hint=grad_hint,
        )
        checks.append(grads_check)
    if params is not None:
        check = ranks_check(
            f"{prefix}parameters after step {steps}",
            params,
            reference_params,
            tolerance=param_rule.at(steps),
            step=steps,
            world_size=world_size,
            what="parameters",
            absolute=absolute,
        )
        if not check.ok and grads_check is not None and grads_check.ok:
            check = dataclasses.replace(
                check,
                hint=(
                    "the gradients of step 1 match and the parameters after the last step do not:"
                    " are the gradients zeroed at the start of every step (or do they pile up),"
                    " and does every later step synchronise them as step 1 did?"
                    if steps > 1
                    else "the gradients match and the parameters after the update do not: does"
                    " the optimizer step on the synchronised gradients?"
                ),
            )
        checks.append(check)
    return checks


def passed(checks: Iterable[Check]) -> bool:
    """True when there is at least one check and every check passed."""
    checks = list(checks)
    return bool(checks) and all(c.ok for c in checks)


def matches(checks: Iterable[Check], against: str) -> bool | None:
    """Whether every check against ``against`` ("reference", "theory", "torch") passed; None when
    the run made none. A summary's ``matches_reference`` is ``matches(checks, "reference")``."""
    found = [c for c in checks if c.against == against]
    return all(c.ok for c in found) if found else None


def find(checks: Iterable[Check], name: str) -> Check:
    """The check named ``name``; KeyError naming the checks there are."""
    checks = list(checks)
    for c in checks:
        if c.name == name:
            return c
    raise KeyError(f"no check named {name!r}; the checks: {[c.name for c in checks]}")


def _short(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # bytes, counts: exact
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
