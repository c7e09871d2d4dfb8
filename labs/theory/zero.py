"""ZeRO on paper, buffer by buffer and moment by moment: what a rank holds and sends (notebook
03).

    held_bytes([16384, 36992, 36992, 16448], stage=3, dp=4)   # bytes a rank holds between steps
    peak_param_bytes(units, dp=4, prefetch=True)              # ZeRO-3 forward peak
    comm_bytes(units, stage=3, dp=4)                          # bytes a rank sends per step
    step_moments(3, units, dp=4)                              # the visualizer's frames

Pure Python (no torch). Symbols as in ``labs.theory.memory``: Ψ parameters, N data-parallel
ranks, fp32 training with AdamW (4 bytes per parameter and per gradient, 8 of optimizer
state). The model is cut into *units* (the embedding, each transformer block, the head);
each unit's trainable parameters are flattened into one buffer of Ψ_u elements, padded to
N·S_u with S_u = ceil(Ψ_u / N) so every rank owns an equal shard of S_u elements.

What a rank holds, per unit (the layout of ``solutions/zero.py``):

    stage  parameters     gradients                                 optimizer (AdamW)
    0      Ψ_u            Ψ_u                                       2 Ψ_u
    1      N·S_u (flat)   N·S_u (flat, reduce-scattered in place)   2 S_u
    2      N·S_u (flat)   S_u                                       2 S_u
    3      S_u            S_u                                       2 S_u

ZeRO-3's optimizer is the user's, on the pieces of the parameters a rank's shard holds: its moments
cover those elements only, not the padding at the end of the last ranks' shards (rank r's
parameter elements, ``shard_elements``: min(S_u, max(0, Ψ_u − r·S_u))); ``held_bytes(...,
rank=r)`` gives rank r's own figure, which is 2·4 bytes per padding element below the others'.

Per unit this is ``labs.theory.memory.state_bytes(Ψ_u, zero=stage, dp=N, exact_shards=True)``
plus the padding (N·S_u − Ψ_u < N elements) of the full flat buffers a collective writes or
reads (parameters in stages 1–2, gradients in stage 1). When N divides every Ψ_u (the
course model on 2 or 4 ranks) the padding is zero and the calculator's figure is exact.
With ``offload`` (ZeRO-Offload, Ren et al. 2021) the optimizer state leaves the device; the
host holds an fp32 copy of the parameter shard, the gradient shard and the moments
(16 S_u bytes) and every step moves 4 S_u bytes down (gradients) and 4 S_u up (parameters).

Bytes sent per rank per step (ring figures, ``labs.theory.comm``), P = Σ_u N·S_u · 4 bytes:

    stage 0     all-reduce of the gradients                               2 (N-1)/N · 4Ψ
    stage 1-2   reduce-scatter of gradients + all-gather of parameters    2 (N-1)/N · P
    stage 3     all-gather in forward, again in backward, reduce-scatter  3 (N-1)/N · P

ZeRO-3 keeps only shards between uses: during unit k's forward a rank holds every shard,
unit k in full and (with prefetch) unit k+1 in full: peak = Σ 4 S_u + max_k 4 N (S_k + S_k+1).

Mixed precision (``precision="bf16-mixed"`` or ``"fp16-mixed"``, same bytes): bf16 parameters
and gradients (2 bytes), fp32 master weights (4) and AdamW moments (8), gradients reduced in the
reduce dtype (4 bytes in fp32, 2 in bf16):

    stage  parameters        gradients         optimizer (master + moments)
    0      2 Ψ_u             2 Ψ_u             12 Ψ_u
    1      2 N·S_u (flat)    2 N·S_u (flat)    12 S_u
    2      2 N·S_u (flat)    2 S_u             12 S_u
    3      4 S_u (fp32)      4 S_u (fp32)       8 S_u        FSDP2's layout, see below

Stages 0-2 are the calculator's bf16-mixed rows (``state_bytes(precision="bf16-mixed")``) term by
term. ZeRO-3 holds the calculator's 16 S_u too, laid out as FSDP2 lays it out: the fp32 shard is
both the parameter a plain optimizer steps and its master copy (the bf16 unit is gathered from a
transient cast and freed after use), and its gradient is fp32 (the reduced gradient is never
rounded to bf16): 4 + 4 + 8 where the calculator counts 2 + 2 + (4 + 8). Bytes sent: the
reductions carry the reduce dtype, the all-gathers bf16.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), §5 and §7; Zhao et al., "PyTorch FSDP" (VLDB 2023), §3.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from labs.theory.comm import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from labs.theory.dims import check_positive
from labs.theory.memory import state_bytes
from labs.theory.model import ModelSpec, param_counts
from labs.theory.presets import PRESETS

STAGES = (0, 1, 2, 3)
BYTES = 4  # fp32: parameters, gradients and each of Adam's two moments
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
HALF = 2  # bf16 and fp16: a mixed-precision run's parameters and gradients
KINDS = ("params", "grads", "optimizer")
STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "total_bytes")


def _check(unit_numels: Iterable[int], stage: int = 0, dp: int = 1) -> list[int]:
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not one of {STAGES}")
    check_positive(dp=dp)
    if stage > 0 and dp == 1:
        raise ValueError(
            f"stage={stage} shards over data-parallel ranks but dp=1; use dp >= 2 or stage=0"
        )
    units = list(unit_numels)
    if not units or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in units):
        raise ValueError(
            f"unit_numels must be a non-empty list of integers >= 1, got {unit_numels!r}"
        )
    return units


def flat_layout(numel: int, dp: int) -> dict[str, int]:
    """One flat buffer of ``numel`` elements over ``dp`` ranks: ``shard`` = ceil(numel/dp)
    elements per rank, ``padded`` = dp·shard, ``padding`` = padded − numel (< dp)."""
    check_positive(numel=numel)
    _check([numel], 0, dp)
    shard = math.ceil(numel / dp)
    return {"numel": numel, "shard": shard, "padded": shard * dp, "padding": shard * dp - numel}


def shard_elements(numel: int, dp: int, rank: int) -> int:
    """The elements of rank ``rank``'s shard [S] of a flat buffer of ``numel`` elements that are
    parameters, not padding: min(S, max(0, numel − rank·S)). The padding sits at the end of the
    flat buffer, so only the last ranks' shards hold it (a rank past the end holds none)."""
    lay = flat_layout(numel, dp)
    if not 0 <= rank < dp:
        raise ValueError(f"rank={rank} is not in 0..{dp - 1} (dp={dp})")
    return min(lay["shard"], max(0, numel - rank * lay["shard"]))


def course_units(spec: ModelSpec | None = None) -> list[tuple[str, int]]:
    """(name, Ψ_u) for the course model's units: embedding, each block, final norm + head."""
    spec = spec or PRESETS["tiny"]  # the course model
    c = param_counts(spec)
    return (
        [("embedding", c["embedding"])]
        + [(f"block {i}", c["per_layer"]) for i in range(spec.n_layers)]
        + [("norm + head", c["final_norm"] + c["head"])]
    )


def held_bytes(
    unit_numels: Iterable[int],
    *,
    stage: int,
    dp: int,
    offload: bool = False,
    frozen_numel: int = 0,
    gradless_numel: int = 0,
    itemsize: int = BYTES,
    precision: str = "fp32",
    stepped: bool = True,
    rank: int | None = None,
) -> dict:
    """Bytes a rank holds between steps (after the optimizer step, gradients still held).

    ``params``, ``grads``, ``optimizer`` and ``total`` are device bytes; ``host`` the bytes
    offloaded to the CPU; ``calculator`` the sum over units of
    ``labs.theory.memory.state_bytes(Ψ_u, zero=stage, dp=N, exact_shards=True)["total_bytes"]``
    (optimizer included even when offloaded); ``padding`` the bytes of padding held in full
    flat buffers; ``frozen_numel`` parameters are replicated and never trained;
    ``gradless_numel`` trainable parameters never get a gradient (unused in forward), so in
    stage 0 they hold neither a gradient nor AdamW state (inside a flat buffer they do).
    ``itemsize``: bytes per element (8 for a float64 check run; the calculator's fp32 figures scale
    with it). ``precision``: "bf16-mixed" or "fp16-mixed" gives the mixed-precision table of the
    module docstring (and ``calculator`` the calculator's bf16-mixed figure); ``stepped=False``
    (fp16 skipped every step so far): AdamW has no moments yet (it makes them at its first step).
    ``rank`` (ZeRO-3): rank ``rank``'s own figure, whose AdamW moments cover its shard's parameter
    elements only (``shard_elements``; the last ranks' shards end in padding); None: every rank
    alike, moments for whole shards (the calculator's ceil(Ψ_u/N)).
    """
    units = _check(unit_numels, stage, dp)
    if rank is not None and stage != 3:
        raise ValueError(
            f"rank={rank} with stage={stage}: only ZeRO-3's figure differs by rank (its optimizer"
            " keeps moments for the parameters of a shard, not its padding); pass rank=None"
        )
    if offload and stage == 0:
        raise ValueError(
            "offload=True needs stage 1, 2 or 3: stage 0 keeps the whole optimizer on every rank"
        )
    _check_precision(precision, itemsize, offload)
    if precision != "fp32":
        return _mixed_held_bytes(units, stage, dp, frozen_numel, gradless_numel, stepped, rank)
    out = dict.fromkeys(("params", "grads", "optimizer", "host", "calculator", "padding"), 0)
    for n in units:
        lay = flat_layout(n, dp)
        calc = state_bytes(
            n, precision="fp32", optimizer="adamw", zero=stage, dp=dp, exact_shards=True
        )
        calc = {k: v * itemsize // BYTES for k, v in calc.items()}
        out["calculator"] += calc["total_bytes"]
        pad = lay["padding"] * itemsize
        out["params"] += calc["param_bytes"]
        out["grads"] += calc["grad_bytes"]
        if stage in (1, 2):  # the full flat parameter buffer
            out["params"] += pad
            out["padding"] += pad
        if stage == 1:  # the full flat gradient buffer
            out["grads"] += pad
            out["padding"] += pad
        # AdamW's two moments: for the whole shard, or (ZeRO-3, ``rank``) its parameter elements
        moments = 2 * itemsize * (lay["shard"] if rank is None else shard_elements(n, dp, rank))
        if offload:
            # fp32 parameter shard, gradient shard, two moments
            out["host"] += 2 * lay["shard"] * itemsize + moments
        elif rank is not None:
            out["optimizer"] += moments
        else:
            out["optimizer"] += calc["optimizer_bytes"]
    out["params"] += frozen_numel * itemsize
    if stage == 0:
        out["grads"] -= gradless_numel * itemsize
        out["optimizer"] -= 2 * gradless_numel * itemsize
        out["calculator"] -= 3 * gradless_numel * itemsize
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _check_precision(precision: str, itemsize: int, offload: bool) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    if precision != "fp32" and itemsize != BYTES:
        raise ValueError(
            f"precision={precision!r} fixes the bytes (bf16 or fp16 weights, fp32 masters):"
            f" leave itemsize at {BYTES}, got {itemsize}"
        )
    if precision != "fp32" and offload:
        raise ValueError(
            f"offload=True with precision={precision!r} is not modelled here (the host would"
            " hold the fp32 masters): use offload with precision='fp32'"
        )


def _mixed_held_bytes(
    units: list[int],
    stage: int,
    dp: int,
    frozen_numel: int,
    gradless_numel: int,
    stepped: bool = True,
    rank: int | None = None,
) -> dict:
    """``held_bytes`` for a mixed-precision run (the module docstring's second table)."""
    out = dict.fromkeys(("params", "grads", "optimizer", "host", "calculator", "padding"), 0)
    moments = 0  # AdamW's two fp32 moments: 8 bytes per element it steps
    for n in units:
        lay = flat_layout(n, dp)
        pieces = lay["shard"] if rank is None else shard_elements(n, dp, rank)
        moments += 2 * BYTES * (n if stage == 0 else pieces)
        calc = state_bytes(
            n, precision="bf16-mixed", optimizer="adamw", zero=stage, dp=dp, exact_shards=True
        )
        out["calculator"] += calc["total_bytes"]
        if stage == 3:  # FSDP2's layout: fp32 shard (the master), fp32 gradient shard, moments
            out["params"] += BYTES * lay["shard"]
            out["grads"] += BYTES * lay["shard"]
            out["optimizer"] += 2 * BYTES * pieces
            continue
        pad = lay["padding"] * HALF
        out["params"] += calc["param_bytes"]
        out["grads"] += calc["grad_bytes"]
        out["optimizer"] += calc["optimizer_bytes"]
        if stage in (1, 2):  # the full flat parameter buffer, in bf16
            out["params"] += pad
            out["padding"] += pad
        if stage == 1:  # the full flat gradient buffer, in bf16
            out["grads"] += pad
            out["padding"] += pad
    out["params"] += frozen_numel * HALF
    if stage == 0:  # no gradient and no moments for a parameter never used (its master stays)
        out["grads"] -= gradless_numel * HALF
        out["optimizer"] -= 2 * BYTES * gradless_numel
        out["calculator"] -= (HALF + 2 * BYTES) * gradless_numel
        moments -= 2 * BYTES * gradless_numel
    if not stepped:
        out["optimizer"] -= moments
        out["calculator"] -= moments
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def peak_param_bytes(
    unit_numels: Iterable[int],
    *,
    dp: int,
    prefetch: bool = True,
    itemsize: int = BYTES,
    shard_itemsize: int | None = None,
) -> int:
    """ZeRO-3: most parameter bytes a rank holds during forward: every shard, the unit being
    computed in full and, with ``prefetch``, the next unit's all-gather output too. Mixed
    precision: the gathered units in bf16 (``itemsize=2``), the shards fp32 (``shard_itemsize=4``;
    default: ``itemsize``)."""
    units = _check(unit_numels, 3, dp)
    lays = [flat_layout(n, dp) for n in units]
    shards = sum(lay["shard"] for lay in lays)
    full = [lay["padded"] for lay in lays]
    window = [a + b for a, b in zip(full, full[1:])] if prefetch and len(full) > 1 else full
    return shards * (shard_itemsize or itemsize) + max(window) * itemsize


def comm_bytes(
    unit_numels: Iterable[int],
    *,
    stage: int,
    dp: int,
    itemsize: int = BYTES,
    reduce_itemsize: int | None = None,
    overflow_flag: bool = False,
) -> dict[str, float]:
    """Bytes a rank sends per step, by collective (ring model), and ``psi_equivalent``: the total
    in units of (N-1)/N · itemsize·Ψ, i.e. 2 for stages 0-2 and 3 for stage 3 (padding aside).
    Mixed precision: the all-gathers carry the parameters' ``itemsize`` (2), the all-reduce and
    reduce-scatter the reduce dtype's ``reduce_itemsize`` (4 for fp32; default: ``itemsize``).
    ``overflow_flag`` (fp16's loss scaling, stages 1-3): a rank sees only its gradient shard, so
    one all-reduce of a 4-byte flag tells every rank whether any overflowed."""
    units = _check(unit_numels, stage, dp)
    reduce_itemsize = reduce_itemsize or itemsize
    grads = sum(units) * itemsize
    padded = sum(flat_layout(n, dp)["padded"] for n in units)
    out = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if stage == 0:
        out["all_reduce"] = all_reduce_bytes(sum(units) * reduce_itemsize, dp)
    else:
        out["reduce_scatter"] = reduce_scatter_bytes(padded * reduce_itemsize, dp)
        out["all_gather"] = all_gather_bytes(padded * itemsize, dp) * (2 if stage == 3 else 1)
        if overflow_flag:
            out["all_reduce"] = all_reduce_bytes(BYTES, dp)
    out["total"] = sum(out.values())
    out["psi_equivalent"] = out["total"] / ((dp - 1) / dp * grads) if dp > 1 else 0.0
    return out


def offload_bytes(unit_numels: Iterable[int], *, dp: int, itemsize: int = BYTES) -> dict[str, int]:
    """Bytes crossing the host link per step with ZeRO-Offload: gradient shards down, parameter
    shards up."""
    shards = sum(flat_layout(n, dp)["shard"] for n in _check(unit_numels, 1, dp)) * itemsize
    return {"to_host": shards, "to_device": shards, "total": 2 * shards}


def stage_table(n_params: int, dp: int, precision: str = "bf16-mixed") -> list[dict]:
    """The memory wall, stage by stage: state bytes per rank for ``n_params`` on ``dp`` ranks
    (the calculator's textbook figures; rows for stages 0-3)."""
    rows = []
    for stage in STAGES:
        b = state_bytes(
            n_params, precision=precision, optimizer="adamw", zero=stage if dp > 1 else 0, dp=dp
        )
        rows.append({"stage": stage, **{k: b[k] for k in STATE_KEYS}})
    return rows


def format_stage_table(
    n_params: int, dp: int, precision: str = "bf16-mixed", gpu_gib: float = 79.6
) -> str:
    """``stage_table`` as text, in GiB per rank (2^30 bytes, the unit of every memory figure in
    the course), with whether the state alone fits in a ``gpu_gib`` GPU (79.6 GiB: an H100
    "80 GB", as nvidia-smi reports it)."""
    lines = [
        f"{n_params / 1e9:.2f}B parameters, {precision}, AdamW, {dp} data-parallel ranks"
        f" ({gpu_gib:.1f} GiB GPUs)",
        f"{'stage':<8}{'params':>9}{'grads':>9}{'optim':>9}{'total':>9}   state alone fits?",
        f"{'':<8}{'(GiB per rank)':>36}",
    ]
    for r in stage_table(n_params, dp, precision):
        fits = "yes" if r["total_bytes"] <= gpu_gib * 2**30 else "no"
        gib = "".join(f"{r[k] / 2**30:>9.1f}" for k in STATE_KEYS)
        lines.append(f"ZeRO-{r['stage']:<3}{gib}   {fits}")
    return "\n".join(lines)


def offload_tradeoff(
    n_params: int, dp: int, *, stage: int = 3, link_gb_per_s: float = 25.0
) -> dict:
    """ZeRO-Offload in bf16-mixed training, per rank per step: device bytes freed (fp32 master
    and moments, 12 Ψ/N), bytes over the host link (bf16 gradient shard down, bf16 parameter
    shard up: 4 Ψ/N) and the seconds that takes at ``link_gb_per_s`` (PCIe 4 x16 ~25 GB/s
    each way in practice) if nothing overlaps it. The CPU's AdamW time comes on top."""
    b = state_bytes(n_params, precision="bf16-mixed", optimizer="adamw", zero=stage, dp=dp)
    moved = 2 * 2 * n_params / dp
    return {
        "freed_device_bytes": b["optimizer_bytes"],
        "left_device_bytes": b["total_bytes"] - b["optimizer_bytes"],
        "host_link_bytes": moved,
        "host_link_s": moved / (link_gb_per_s * 1e9),
    }


def format_offload_tradeoff(n_params: int, dp: int, **kw: object) -> str:
    """``offload_tradeoff`` in words: device memory freed and left in GiB, traffic over the host
    link in GB (10^9 bytes, the unit link speeds are quoted in) and its seconds."""
    t = offload_tradeoff(n_params, dp, **kw)
    return "\n".join(
        [
            f"device memory freed  {t['freed_device_bytes'] / 2**30:6.2f} GiB per GPU"
            " (fp32 master + moments)",
            f"device state left    {t['left_device_bytes'] / 2**30:6.2f} GiB per GPU"
            " (bf16 weights + gradients)",
            f"host link per step   {t['host_link_bytes'] / 1e9:6.2f} GB"
            f" -> {t['host_link_s']:.3f} s if nothing overlaps it",
        ]
    )


# --- the visualizer's model of one step ------------------------------------------------------
# A state is "full", "shard", "prefetch" (full, being gathered ahead of use), "host" or "none".


def _moment(
    label: str, collective: str, params: list[str], grads: list[str], optim: list[str]
) -> dict:
    return {
        "label": label,
        "collective": collective,
        "params": list(params),
        "grads": list(grads),
        "optimizer": list(optim),
    }


def step_moments(
    stage: int,
    unit_numels: Iterable[int],
    *,
    dp: int,
    prefetch: bool = True,
    offload: bool = False,
    names: list[str] | None = None,
) -> list[dict]:
    """The moments of one training step, in order, each with every unit's parameter, gradient
    and optimizer state on a rank (all ranks alike; rank r's shard is the r-th of N), the
    collective running, and the rank's device ``bytes`` at that moment. The last moment is
    the end of the step: its bytes equal :func:`held_bytes`."""
    units = _check(unit_numels, stage, dp)
    if offload and stage == 0:
        raise ValueError(
            "offload=True needs stage 1, 2 or 3: stage 0 keeps the whole optimizer on every rank"
        )
    u = len(units)
    names = names or [f"unit {k}" for k in range(u)]
    if len(names) != u:
        raise ValueError(f"names has {len(names)} entries for {u} units")
    opt = ["host" if offload else ("full" if stage == 0 else "shard")] * u
    rest_p = "shard" if stage == 3 else "full"
    rest_g = {0: "full", 1: "full"}.get(stage, "shard")
    params = [rest_p] * u
    grads = [rest_g] * u
    frames = []
    for k in range(u):
        p = list(params)
        if stage == 3:
            p[k] = "full"
            if prefetch and k + 1 < u:
                p[k + 1] = "prefetch"
        coll = "none"
        if stage == 3:
            coll = f"all-gather {names[k]}"
            if prefetch and k + 1 < u:
                coll += f", prefetch {names[k + 1]}"
        frames.append(_moment(f"forward {names[k]}", coll, p, grads, opt))
    for k in reversed(range(u)):
        p = list(params)
        if stage == 3:
            p[k] = "full"
            if prefetch and k > 0:
                p[k - 1] = "prefetch"
        grads = list(grads)
        grads[k] = "full"
        coll = "none"
        if stage == 3:
            coll = f"all-gather {names[k]}"
            if prefetch and k > 0:
                coll += f", prefetch {names[k - 1]}"
        frames.append(_moment(f"backward {names[k]}", coll, p, grads, opt))
        if stage >= 2:
            # the state right after: unit k's gradient sharded (stage 3: its parameters freed)
            grads = list(grads)
            grads[k] = "shard"
            after = [s if s != "full" or stage < 3 else "shard" for s in p]
            frames.append(
                _moment(
                    f"reduce-scatter {names[k]}",
                    f"reduce-scatter grads of {names[k]}",
                    after,
                    grads,
                    opt,
                )
            )
    if stage == 0:
        frames.append(_moment("all-reduce", "all-reduce every gradient", params, grads, opt))
    if stage == 1:
        frames.append(
            _moment(
                "reduce-scatter", "reduce-scatter every gradient (in place)", params, grads, opt
            )
        )
    frames.append(
        _moment(
            "optimizer step",
            "copy grad shards to host, params back" if offload else "none",
            params,
            grads,
            opt,
        )
    )
    if stage in (1, 2):
        frames.append(
            _moment("all-gather", "all-gather the updated parameter shards", params, grads, opt)
        )
    for f in frames:
        f["bytes"] = _frame_bytes(f, units, stage, dp)
    return frames


def _frame_bytes(frame: dict, units: list[int], stage: int, dp: int) -> dict[str, int]:
    """Device bytes of one moment (and ``host``): a full ZeRO-3 unit sits beside its shard, a
    stage 2-3 full gradient (autograd's) beside the persistent gradient shard."""
    out = dict.fromkeys(KINDS + ("host",), 0)
    for k, n in enumerate(units):
        lay = flat_layout(n, dp)
        shard = lay["shard"]
        flat = lay["padded"] if stage >= 1 else n
        p = frame["params"][k]
        g = frame["grads"][k]
        o = frame["optimizer"][k]
        out["params"] += {"full": flat, "prefetch": flat, "shard": 0}[p]
        if stage == 3:  # the persistent shard, beside a gathered unit
            out["params"] += shard
        if stage >= 2:
            out["grads"] += shard + (n if g == "full" else 0)
        else:
            out["grads"] += lay["padded"] if stage == 1 else n
        out["optimizer"] += {"full": 2 * n, "shard": 2 * shard, "host": 0}[o]
        out["host"] += 4 * shard if o == "host" else 0
    out = {k: v * BYTES for k, v in out.items()}
    out["total"] = sum(out[k] for k in KINDS)
    return out
