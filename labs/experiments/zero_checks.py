"""Experiment 03's checks: what decides the ZeRO lab's verdict, each with where it was made and,
when it fails, the classic mistake that most likely explains it.

    checks(summary, per_rank, ref, net, units=unit_params(net), first=ref_after_step_1)

On every rank: the losses of every step; every gradient by name after step 1 (the rank's shard of
the averaged gradient: a piece of each parameter under ZeRO-1/2/3); every parameter after step 1
(where a wrong all-gather shows slice by slice) and after the last step; the bytes of every
collective call and of each op per step; the state held after a step; ZeRO-3's peak parameter
bytes; offload's host traffic. Tolerances come from the course's one table
(``labs.train.rule``: by quantity, dtype and backend); bytes are exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from labs.experiments.checks import (
    Check,
    compare_tensors,
    compare_values,
    scale_hint,
    step_tolerances,
)
from labs.theory import zero as theory
from labs.train import mixed_precision, rule

DTYPES = {"float32": torch.float32, "float64": torch.float64}
LEDGER_OPS = {
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter_single",
    "all_gather": "all_gather_single",
}
ROLES = ("params", "grads", "optimizer", "host", "total")


def checks(s, per_rank: list[dict], ref, net, *, units, first) -> list[Check]:
    """Every check of one ZeRO run (``s``: its summary with the theory's figures filled in;
    ``per_rank``: what each rank returned; ``ref``: the single-process reference, ``first``: the
    same after one step; ``units``: [(name, [parameters])] of the reference model ``net``, in
    order)."""
    dtype = DTYPES[s["dtype"]]
    backend = s["backend"]
    n = s["nproc"]
    stage = s["stage"]
    mixed = mixed_precision(s.get("precision", "fp32"), s.get("reduce_dtype"))
    steps = len(s["reference_losses"])  # the bounds after many steps grow (labs.train._DRIFT)
    if mixed is None:
        loss = rule("value", DTYPES[s["loss_dtype"]], backend)
        value = rule("value", dtype, backend).rel
        param = rule("param", dtype, backend)
    else:  # against the reference under the same policy: the table's mixed rows
        loss, grad, param = (
            rule(f"mixed_{kind}", mixed.param_dtype, backend) for kind in ("loss", "grad", "param")
        )
        value = grad.rel
    names = {p: name for name, p in net.named_parameters()}
    layout = [(name, [names[p] for p in params]) for name, params in units]
    out = [
        against(
            "reference", losses_check(s["losses"], s["reference_losses"], loss.per_step(steps))
        ),
        against("reference", grads_check(per_rank, ref.grads, value, n)),
        against(
            "reference",
            params_check(
                per_rank, first.params, param.at(1), n, stage, layout, "params_step1", "step 1"
            ),
        ),
        against(
            "reference",
            params_check(
                per_rank, ref.params, param.at(steps), n, stage, layout, "params", "the last step"
            ),
        ),
    ]
    numels = [sum(p.numel() for p in params) for _, params in units]
    itemsize = dtype.itemsize
    sizes = comm_itemsizes(itemsize, mixed)
    out += [
        against(
            "theory",
            calls_check(per_rank, expected_calls(numels, stage, n, **sizes), n, stage, mixed),
        ),
        against(
            "theory",
            sent_check(per_rank, theory.comm_bytes(numels, stage=stage, dp=n, **sizes), n),
        ),
        against(
            "theory",
            state_check(
                per_rank, s.get("theory_breakdown_per_rank", s["theory_breakdown"]), n, stage, mixed
            ),
        ),
    ]
    if mixed is not None:
        out.append(against("theory", calculator_check(per_rank, s["calculator_bytes"], stage)))
    if mixed is not None and mixed.loss_scaling:
        out.append(against("reference", skipped_check(per_rank, ref.skipped_steps)))
    if stage == 3:
        out.append(against("theory", peak_check(per_rank, s["theory_peak_param_bytes"])))
    if s["offload"]:
        out.append(
            compare_values(
                "host link bytes per step",
                [r["host_bytes_per_step"] for r in per_rank],
                [s["theory_host_bytes_per_step"]] * n,
                where="every rank",
                hint="each step moves every unit's gradient shard to the host once and its"
                " parameter shard back once: count the transfers (ZeRO-3: the shard goes up at"
                " the first gather after the step, not at every gather)",
            )
        )
    return out


def against(kind: str, check: Check) -> Check:
    """``check`` saying what it compares with: "reference" or "theory"."""
    return dataclasses.replace(check, against=kind)


def losses_check(
    losses: list[float], reference: list[float], tolerance: float | list[float]
) -> Check:
    """Every step's global loss (the mean over the ranks) against the reference's, within
    ``tolerance`` (one number, or one per step)."""
    diffs = [abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses, reference)]
    bounds = step_tolerances(tolerance, len(diffs))
    worst = max(range(len(diffs)), key=lambda i: diffs[i] / bounds[i] if bounds[i] else diffs[i])
    bad = [i for i, (d, t) in enumerate(zip(diffs, bounds)) if d > t]
    ok = not bad and len(losses) == len(reference)
    hint = ""
    if bad and bad[0] == 0:
        hint = (
            "the loss differs at step 1, before any update: the forward differs (the parameters"
            " a unit computes with: is it gathered whole before its forward?)"
        )
    elif bad:
        hint = (
            f"step 1 matches and step {bad[0] + 1} does not: the update is wrong (the averaged"
            " gradient, the shard the optimizer steps, or the all-gather of the new parameters)"
        )
    return Check(
        "losses",
        ok,
        diffs[worst],
        0.0,
        bounds[worst],
        f"step {worst + 1} of {len(diffs)}",
        hint,
    )


def _nonempty(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if v.numel()}


def _first_failure_or_worst(found: list[Check]) -> Check:
    failed = [c for c in found if not c.ok]
    if failed:
        return failed[0]
    return max(found, key=lambda c: c.measured)


def grads_check(per_rank: list[dict], ref_grads: dict, tolerance: float, n: int) -> Check:
    """Each rank's averaged gradients after step 1, by name, against the same elements of the
    reference's (a piece where the rank holds a piece)."""
    found = []
    if not ref_grads and all(got["grads"] is None for got in per_rank):
        return Check(
            "gradients after step 1",
            True,
            "none",
            "none",
            where="fp16 skipped every step, on every rank and in the reference",
        )
    for r, got in enumerate(per_rank):
        if got["grads"] is None:
            return Check(
                "gradients after step 1",
                False,
                "none",
                "the first step taken's",
                where=f"rank {r}",
                hint="this rank took no step: every step was skipped for overflow (fp16) while"
                " the reference took some",
            )
        ranges = got["grad_ranges"]
        expected = {}
        for name, g in ref_grads.items():
            a, b = ranges.get(name, (0, g.numel()))
            expected[name] = g.reshape(-1)[a:b] if name in ranges else g
        ours = {k: v for k, v in got["grads"].items() if k in expected}
        keep = [k for k, v in expected.items() if v.numel()]
        found.append(
            compare_tensors(
                "gradients after step 1",
                {k: ours[k] for k in keep if k in ours},
                {k: expected[k] for k in keep},
                tolerance=tolerance,
                where=f"rank {r}, step 1",
                world_size=n,
                what="gradients",
            )
        )
    return _first_failure_or_worst(found)


def params_check(
    per_rank: list[dict],
    ref_params: dict,
    tolerance: float,
    n: int,
    stage: int,
    layout: list[tuple[str, list[str]]],
    key: str,
    when: str,
) -> Check:
    """Each rank's whole parameters after ``when`` (``per_rank[r][key]``), by name, against the
    reference's; a failure that is right in some ranks' slices of a unit and wrong in others'
    names the all-gather."""
    found = []
    for r, got in enumerate(per_rank):
        check = compare_tensors(
            f"parameters after {when}",
            got[key],
            ref_params,
            tolerance=tolerance,
            where=f"rank {r}, {when}",
            world_size=n,
            what="parameters",
        )
        if not check.ok and stage > 0:
            hint = slices_hint(got[key], ref_params, layout, n, tolerance, stage)
            if hint:
                check = Check(**{**check.to_dict(), "hint": hint})
        found.append(check)
    return _first_failure_or_worst(found)


def slices_hint(
    params: dict, reference: dict, layout: list[tuple[str, list[str]]], n: int, tol: float, stage
) -> str:
    """The hint when a unit's flat parameters are right in some ranks' slices [r·S, (r+1)·S)
    and wrong in others' (the all-gather put the wrong shard in place), else ""."""
    for unit, names in layout:
        if any(k not in params for k in names):
            continue
        ours = torch.cat([params[k].double().reshape(-1) for k in names])
        want = torch.cat([reference[k].double().reshape(-1) for k in names])
        scale = float(want.abs().max()) or 1.0
        shard = math.ceil(ours.numel() / n)
        bad = []
        good = []
        for j in range(n):
            piece = slice(j * shard, min((j + 1) * shard, ours.numel()))
            if piece.start >= ours.numel():
                continue
            diff = float((ours[piece] - want[piece]).abs().max()) / scale
            (bad if diff > tol else good).append(j)
        if bad and good:
            where = "after the step" if stage < 3 else "where a unit is gathered"
            return (
                f"unit {unit!r} is right in the slices of ranks {good} and wrong in those of"
                f" ranks {bad}: the all-gather {where} put other shards in their place: each rank"
                " must send its own slice [r·S, (r+1)·S) (u.full[u.lo:u.hi], not from offset 0)"
            )
    return ""


def comm_itemsizes(itemsize: int, mixed) -> dict[str, int]:
    """Bytes per element of the all-gathers (``itemsize``) and of the reductions
    (``reduce_itemsize``): the run's dtype, or under mixed precision bf16 and the reduce dtype's."""
    if mixed is None:
        return {"itemsize": itemsize, "reduce_itemsize": itemsize}
    return {
        "itemsize": mixed.param_dtype.itemsize,
        "reduce_itemsize": mixed.reduce_dtype.itemsize,
        "overflow_flag": mixed.loss_scaling,
    }


def expected_calls(
    numels: list[int],
    stage: int,
    n: int,
    itemsize: int,
    reduce_itemsize: int | None = None,
    overflow_flag: bool = False,
) -> dict[str, list]:
    """The payload bytes of each collective call of one step, by ledger op, sorted: stage 0 one
    all-reduce per unit (its Ψ_u elements); stages 1-2 one reduce-scatter and one all-gather per
    unit (its padded N·S_u); stage 3 two all-gathers (forward, backward) and one reduce-scatter.
    The reductions carry ``reduce_itemsize`` bytes per element (default ``itemsize``);
    ``overflow_flag`` (fp16, stages 1-3): one all-reduce of a 4-byte flag."""
    reduce_itemsize = reduce_itemsize or itemsize
    padded = [theory.flat_layout(k, n)["padded"] for k in numels]
    if stage == 0:
        return {"all_reduce": sorted(k * reduce_itemsize for k in numels)}
    gathers = 2 if stage == 3 else 1
    out = {
        "reduce_scatter_single": sorted(k * reduce_itemsize for k in padded),
        "all_gather_single": sorted(k * itemsize for k in padded * gathers),
    }
    if overflow_flag:
        out["all_reduce"] = [theory.BYTES]
    return out


def _dtype_hint(op: str, ratio: float, mixed) -> str:
    """Under mixed precision, a call off by the ratio of two dtypes' sizes: the wrong dtype."""
    if mixed is None:
        return ""
    low = str(mixed.param_dtype).removeprefix("torch.")
    if abs(ratio - 0.5) < 1e-9 and "reduce" in op and mixed.reduce_dtype == torch.float32:
        return (
            f"the gradients were reduced in {low} where reduce_dtype=float32 was asked: cast the"
            " flat gradient buffer to the reduce dtype before its reduce-scatter"
        )
    if abs(ratio - 2.0) < 1e-9 and "gather" in op:
        return (
            f"the all-gather carried fp32 where the unit computes in {low}: gather the shard"
            " cast to the compute dtype (2 bytes per element), not the fp32 master"
        )
    return ""


def _all_reduce_hint(measured: list, expected: list, calls: dict[str, list], stage: int) -> str:
    """Why a ZeRO-1/2/3 step ran another number of all-reduces than expected, read off their
    payloads (``measured``): a stage > 0 all-reduces only fp16's 4-byte overflow flag
    (``expected``), so a payload of a unit's gradient buffer is a gradient that was all-reduced
    where it should have been reduce-scattered (``calls``: the expected calls, by op)."""
    grads = [x for x in measured if x != theory.BYTES]  # payloads other than a 4-byte flag
    buffers = calls.get("reduce_scatter_single", [])
    if grads and sorted(grads) == sorted(buffers):
        return (
            f"all_reduce: {len(grads)} calls, each of a unit's whole gradient buffer ([N·S]"
            f" elements, the bytes its reduce-scatter takes) where ZeRO-{stage} reduce-scatters"
            " it: every rank needs"
            " only the sum of its own shard [S], so reduce_scatter_single(output=its slice,"
            " input=the buffer) sends (N-1)/N of the buffer where an all-reduce sends 2(N-1)/N"
            " (and leaves a whole averaged gradient on every rank)"
        )
    if grads:
        return (
            f"all_reduce: {len(grads)} calls of {sorted(set(grads))} bytes where ZeRO-{stage}"
            f" makes {len(expected)} (fp16's 4-byte overflow flag at most): the gradients are"
            " reduce-scattered, one reduce_scatter_single per unit, never all-reduced"
        )
    if len(measured) < len(expected):
        return (
            f"all_reduce: {len(measured)} calls where ZeRO-{stage} in fp16 makes {len(expected)}:"
            " a rank sees only its shard of the gradients, so the overflow flag must be"
            " all-reduced (MAX, 4 bytes) over the group once per step, and every rank skips alike"
        )
    return (
        f"all_reduce: {len(measured)} calls of a 4-byte flag where ZeRO-{stage} makes"
        f" {len(expected)}: the overflow flag is all-reduced once per step, and only in fp16"
    )


def calls_check(
    per_rank: list[dict], expected: dict[str, list], n: int, stage: int, mixed=None
) -> Check:
    """Every collective call of the last step on every rank: how many of each op, and the bytes
    each moved, against ``expected_calls``."""
    for r, got in enumerate(per_rank):
        measured = defaultdict(list)
        for op, payload in got["calls_last_step"]:
            measured[op].append(payload)
        for op in sorted(set(measured) | set(expected)):
            m = sorted(measured.get(op, []))
            e = expected.get(op, [])
            where = f"rank {r}, {op}, last step"
            if len(m) != len(e) and op == "all_reduce" and stage > 0:
                return Check(
                    "bytes per call",
                    False,
                    len(m),
                    len(e),
                    where=f"{where}: calls",
                    hint=_all_reduce_hint(m, e, expected, stage),
                )
            if len(m) != len(e):
                per_unit = (
                    "twice per unit (forward and backward)"
                    if "gather" in op and stage == 3
                    else "once per unit"
                )
                return Check(
                    "bytes per call",
                    False,
                    len(m),
                    len(e),
                    where=f"{where}: calls",
                    hint=f"{op}: {len(m)} calls where ZeRO-{stage} makes {len(e)}, {per_unit}:"
                    " is a collective skipped, or issued twice?",
                )
            for i, (a, b) in enumerate(zip(m, e)):
                if a != b:
                    hint = _dtype_hint(op, a / b, mixed) if b else ""
                    if hint:
                        return Check(
                            "bytes per call",
                            False,
                            a,
                            b,
                            where=f"{where}, call {i + 1} of {len(e)}",
                            hint=hint,
                        )
                    hint = scale_hint("the bytes of this call", a / b, n) if b else ""
                    return Check(
                        "bytes per call",
                        False,
                        a,
                        b,
                        where=f"{where}, call {i + 1} of {len(e)}",
                        hint=f"a call moved {a} bytes where a unit's flat buffer, padded to"
                        f" world·shard elements, is {b}: each call takes a whole unit's"
                        f" [padded] buffer (in) or gives one shard [S] (out). {hint}".strip(),
                    )
    calls = sum(len(v) for v in expected.values())
    return Check("bytes per call", True, calls, calls, where=f"{len(per_rank)} ranks, last step")


def sent_check(per_rank: list[dict], comm: dict, n: int) -> Check:
    """Bytes each rank sent per step, op by op, against the ring formulas (``comm_bytes``)."""
    for r, got in enumerate(per_rank):
        for op, ledger_op in LEDGER_OPS.items():
            m = got["sent_by_op"].get(ledger_op, 0.0)
            e = comm[op]
            if abs(m - e) > 1e-9 * max(e, 1.0):
                return compare_values(
                    "bytes sent per op",
                    m,
                    e,
                    tolerance=1e-9,
                    where=f"rank {r}, {ledger_op}, per step",
                    world_size=n,
                    what="bytes sent",
                    hint="" if e else f"{ledger_op} should not run in this stage at all",
                )
    return Check("bytes sent per op", True, comm["total"], comm["total"], 1e-9, "every rank")


def _state_hint(role: str, ratio: float, n: int, stage: int, mixed=None) -> str:
    near_n = abs(ratio - n) < 0.02 * n
    if mixed is not None and role == "optimizer" and ratio < 1:
        return (
            "less optimizer state than fp32 masters plus fp32 moments (12 bytes per element of"
            " the shard): does the inner optimizer step the bf16 shard instead of the fp32"
            " master (u.master)?"
        )
    if mixed is not None and role == "grads" and ratio > 1 and stage < 3:
        return (
            "more gradient bytes than bf16 gradients: are the masters' fp32 gradients dropped"
            " after the step (u.master.grad = None)?"
        )
    if role == "optimizer" and near_n:
        return (
            f"the optimizer holds {n}x the calculator's state: does it step the whole parameters"
            " rather than this rank's shard [lo, hi)?"
        )
    if role == "grads" and stage >= 2 and ratio > 1:
        return (
            "more gradient bytes than a shard per unit: after the reduce-scatter, are the whole"
            " gradients freed (every .grad set to None)?"
        )
    if role == "params" and stage == 3 and ratio > 1:
        return (
            "more parameter bytes than the shards after the step: is every unit's full buffer"
            " released after its backward (post_backward)?"
        )
    return (
        f"{role}: {ratio:.3g}x the theory's bytes: compare what this stage keeps between steps"
        " (labs.theory.zero.held_bytes' table) with the buffers the code allocates"
    )


def state_check(per_rank: list[dict], expected, n: int, stage: int, mixed=None) -> Check:
    """The bytes each rank holds after a step, by role, against the theory (per rank: a list)."""
    for r, got in enumerate(per_rank):
        want = expected[r] if isinstance(expected, list) else expected
        for role in ROLES:
            if got["held"][role] != want[role]:
                ratio = got["held"][role] / want[role] if want[role] else math.inf
                return Check(
                    "state held per rank",
                    False,
                    got["held"][role],
                    want[role],
                    where=f"rank {r}, {role}",
                    hint=_state_hint(role, ratio, n, stage, mixed),
                )
    first = expected[0] if isinstance(expected, list) else expected
    return Check(
        "state held per rank",
        True,
        per_rank[0]["held"]["total"],
        first["total"],
        where=f"{len(per_rank)} ranks",
    )


def calculator_check(per_rank: list[dict], calculator: int, stage: int) -> Check:
    """Mixed precision: every rank holds the memory calculator's bf16-mixed bytes in all
    (``labs.theory.memory.state_bytes(precision="bf16-mixed")``, 16 bytes per parameter split
    by the stage; ZeRO-3 lays them out as FSDP2 does, see ``labs.theory.zero``)."""
    for r, got in enumerate(per_rank):
        held = got["held"]["total"]
        if held != calculator:
            return Check(
                "state held = the calculator's bf16-mixed bytes",
                False,
                held,
                calculator,
                where=f"rank {r}, total",
                hint=f"ZeRO-{stage} in bf16-mixed holds bf16 weights and gradients and fp32 masters"
                " and moments (the calculator's 2 + 2 + 12 bytes per parameter, sharded by the"
                " stage): see which role the state check above names",
            )
    return Check(
        "state held = the calculator's bf16-mixed bytes",
        True,
        per_rank[0]["held"]["total"],
        calculator,
        where=f"{len(per_rank)} ranks",
    )


def skipped_check(per_rank: list[dict], reference: list[int]) -> Check:
    """fp16: every rank skipped exactly the steps whose scaled gradients overflowed in the
    reference (and took every other)."""
    for r, got in enumerate(per_rank):
        if got["skipped_steps"] != reference:
            return Check(
                "steps skipped for overflow",
                False,
                got["skipped_steps"],
                reference,
                where=f"rank {r}",
                hint="every rank must skip the steps whose scaled gradients overflowed anywhere:"
                " a rank sees only its shard, so the overflow flag must be all-reduced (MAX) over"
                " the group before deciding (ShardedOptimizer.unscale_grads)",
            )
    return Check(
        "steps skipped for overflow",
        True,
        per_rank[0]["skipped_steps"],
        reference,
        where=f"{len(per_rank)} ranks, scales {per_rank[0]['loss_scales']}",
    )


def peak_check(per_rank: list[dict], theory_peak: int) -> Check:
    """ZeRO-3: the most parameter bytes each rank held at once in forward (and in backward)."""
    for r, got in enumerate(per_rank):
        for phase in ("forward", "backward"):
            m = got["peak_param_bytes"].get(phase, 0)
            if m != theory_peak:
                hint = (
                    "more than every shard plus two units at once: is each unit released after"
                    " its forward (post_forward) and after its backward (post_backward)?"
                    if m > theory_peak
                    else "less than every shard plus two units: is the next unit prefetched"
                    " (gather(k + 1, async_op=True) in pre_forward, k - 1 in pre_backward)?"
                )
                return Check(
                    "peak parameter bytes",
                    False,
                    m,
                    theory_peak,
                    where=f"rank {r}, {phase}",
                    hint=hint,
                )
    return Check("peak parameter bytes", True, theory_peak, theory_peak, where="every rank, both")
