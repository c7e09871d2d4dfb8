"""Pipeline schedules on paper: bubble, activations held, bytes sent, and the Gantt chart.
Pure Python.

    python -m labs.theory bubble --schedule 1f1b --stages 4 --microbatches 8 --json
    simulate("interleaved", 4, 8, virtual=2)["bubble_fraction"]     # 3/19, from the schedule itself

Symbols: P stages (ranks), M micro-batches per step, V virtual stages (model chunks) per
rank for the interleaved schedule; t_f and t_b the forward and backward time of one
micro-batch through one rank's whole share of the layers (an interleaved chunk holds
1/V of it, so one chunk's forward takes t_f/V).

Bubble (the Ultra-Scale Playbook, "Pipeline parallelism"; Narayanan et al. 2021, §2.2):

    GPipe / AFAB, 1F1B:   idle time per rank (P-1)(t_f+t_b); ideal time M (t_f+t_b)
                          bubble / ideal = (P-1)/M;  idle share of the step = (P-1)/(M+P-1)
    interleaved 1F1B:     the idle time shrinks by V:  bubble / ideal = (P-1)/(V M);
                          idle share = (P-1)/(V M + P-1)
    naive (inference):    one forward of the whole batch, device after device: (P-1)/P idle
    zero bubble, ZB-H1:   the backward splits into B (the gradient for the input, which the
                          previous stage waits for) and W (the gradient for the weights, which
                          nothing waits for); stage s postpones its W's by s, so they fill the
                          cool-down. Idle time per rank (P-1)(t_f + t_b - 2 t_w) with t_w the W
                          part of t_b (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1,
                          their (p-1)(T_F + T_B - T_W) with T_B = t_b - t_w, when a W is no
                          longer than an F or a B); with F = B = W (t_b = 2 t_f, t_w = t_f) the
                          idle share is (P-1)/(3M + P-1). It needs M >= P.
    DualPipe (formula):   DeepSeek-V3 (2024), §3.2.1 and Table 2: two pipelines fed from both
                          ends, forward and backward chunks of different micro-batches overlapped;
                          idle time (S/2 - 1)(t_fb + t_b - 3 t_w) for S stages, in the times of
                          one stage's chunk, with t_fb one overlapped forward-and-backward pair,
                          at twice the parameters and S + 1 micro-batches of activations per rank
                          (``dualpipe_bubble_time``).
    DualPipeV:            DualPipe cut in half (DeepSeek's DualPipe repository; torch's
                          ``ScheduleDualPipeV``): one model in S = 2P stages laid out as a V, rank
                          r holds stages r and 2P-1-r (chunks 0 and 1), so the first and the last
                          stage share rank 0. Its order: a warm-up of forwards, then pairs of
                          a forward of one chunk with a full backward ("BW") of the other, and a
                          cool-down whose later backwards are split into B and W, the W's filling
                          its gaps. A pair is one operation: DeepSeek's ``_forward_backward_chunk``
                          receives both inputs, computes the two (overlapped on a GPU; one after
                          the other here, F&B = F + B) and only then sends both outputs, and
                          torch's runtime sends after the pair too. Run on paper that way, a rank
                          idles (P-1) t_f for t_w = t_b/2 and t_f <= t_b <= 2 t_f: ZB-H1's idle
                          time, a bubble of (P-1)/(3M + P-1) at F = B = W (11.1 % at P = 4,
                          M = 8). That is DeepSeek's own figure: its repository's table gives
                          DualPipeV DualPipe's bubble, (S/2 - 1)(F&B + B - 3W) in a chunk's
                          times, which with S = 2P and F&B = F + B is (P-1)·t_f at F = B = W.
                          (Scheduling the two halves of a pair independently, each as soon as its
                          own input exists, would halve the idle time to (P-1) t_f/2: no
                          implementation runs it so.) Other times: ``simulate``. It needs
                          M >= 2P.

Operation names: "F" forward, "B" backward (with a "W" after it somewhere: only the input's
gradient), "W" the weight gradient, "BW" a full backward where a schedule mixes both kinds
(DualPipeV). A rank's chunk c is virtual stage ``virtual_stage(schedule, P, rank, c)``.

The formulas assume every stage costs the same and an operation starts the moment its
input exists. ``simulate`` runs each rank's operations in the schedule's order, every
operation as soon as its input exists, and measures the idle share of the resulting chart:
it equals the formulas for any t_b/t_f (a test checks it). With ``t_delay`` every operation
starts that much later, as real ones do (message latency, a busy CPU); ``fit_timeline``
reads the operation times and that delay off a measured chart, which explains the gap
between a measured bubble and the formula.

Activation memory: AFAB runs every forward before any backward, so each stage holds
the activations of all M micro-batches; 1F1B starts backwards after a warm-up of P-s-1
forwards on stage s (0-based), so stage s holds at most min(P-s, M) (the first stage
holds the most, P). Interleaved (Megatron-LM's order) counts chunk micro-batches. ZB-H1 keeps
a micro-batch's activations until its W (the weight gradient needs the layers' inputs): stage
s holds its 1F1B share plus the s W's it postpones, min(P, M) on every stage. That is an upper
bound: a B already frees what its W does not need (the loss's log-softmax, for one), so the
last stages hold less than we count; stage 0 holds P as in 1F1B. DualPipeV: counted off its order
of operations (``peak_in_flight``), in chunk micro-batches: 2P + 1 on every rank, P + 1/2 of a
rank's micro-batches (DeepSeek's S + 1 with S = 2P stages).

Point-to-point bytes per step: every micro-batch's activation [B/M, T, H] crosses each
stage boundary forward and its gradient crosses it backward, so a rank sends
B·T·H·itemsize per boundary it feeds, per direction (``p2p_bytes_per_rank``).
"""

from __future__ import annotations

from functools import lru_cache
from statistics import median

from labs.theory.dims import check_positive

SCHEDULES = ("naive", "gpipe", "afab", "1f1b", "interleaved", "zb-h1", "dualpipev")
OPERATIONS = ("F", "B", "W", "BW")  # forward, backward (input part if split), weights, full
SPLIT_BACKWARD = ("zb-h1", "dualpipev")  # schedules whose backwards split into B and W
CHUNKS = {"dualpipev": 2}  # chunks per rank where a schedule fixes them


def chunks_per_rank(schedule: str, virtual: int = 1) -> int:
    """Chunks (virtual stages) a rank holds: ``virtual`` for interleaved, 2 for DualPipeV's V,
    else 1."""
    return CHUNKS.get(schedule, virtual)


def virtual_stage(schedule: str, stages: int, rank: int, chunk: int) -> int:
    """The virtual stage rank ``rank``'s chunk ``chunk`` is: c·P + r when interleaved (a loop over
    the ranks per chunk), r or 2P-1-r in DualPipeV's V (down the ranks, then back up)."""
    if schedule == "dualpipev":
        return rank if chunk == 0 else 2 * stages - 1 - rank
    return chunk * stages + rank


def stage_rank(schedule: str, stages: int, stage: int) -> int:
    """The rank that holds virtual stage ``stage`` (the inverse of ``virtual_stage``)."""
    if schedule == "dualpipev":
        return min(stage, 2 * stages - 1 - stage)
    return stage % stages


def check_schedule(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise ValueError naming the parameter when the combination is not a valid schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    check_positive(stages=stages, microbatches=microbatches, virtual=virtual)
    if schedule in CHUNKS and virtual != CHUNKS[schedule]:
        raise ValueError(
            f"virtual={virtual}: {schedule} holds {CHUNKS[schedule]} chunks per rank;"
            f" use virtual={CHUNKS[schedule]}"
        )
    if schedule not in CHUNKS and schedule != "interleaved" and virtual != 1:
        raise ValueError(f"virtual={virtual} only applies to schedule='interleaved'; use virtual=1")
    if schedule == "naive" and microbatches != 1:
        raise ValueError(
            f"schedule='naive' runs the whole batch as one: microbatches={microbatches},"
            " use microbatches=1 (or schedule='gpipe' to split the batch)"
        )
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(
            "interleaved 1F1B needs microbatches divisible by stages:"
            f" microbatches={microbatches}, stages={stages}; use a multiple of {stages}"
        )
    if schedule == "zb-h1" and microbatches < stages:
        raise ValueError(
            "zb-h1 needs at least as many micro-batches as stages (its W's fill the cool-down):"
            f" microbatches={microbatches}, stages={stages}; use microbatches >= {stages}"
        )
    if schedule == "dualpipev" and microbatches < 2 * stages:
        raise ValueError(
            "dualpipev needs at least two micro-batches per rank (one per stage of its V):"
            f" microbatches={microbatches}, stages={stages}; use microbatches >= {2 * stages}"
        )


# With F = B = W (t_b = 2 t_f, t_w = t_f) the split schedules' bubble is 1F1B's with the
# micro-batches counted this many times: (P-1)/(k·M + P-1).
SPLIT_FACTOR = {"zb-h1": 3, "dualpipev": 3}


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of the step's total time on each rank: (P-1)/(V·M + P-1); with F = B = W,
    zb-h1 and dualpipev (P-1)/(3M + P-1)."""
    check_schedule(schedule, stages, microbatches, virtual)
    k = SPLIT_FACTOR.get(schedule, virtual)
    return (stages - 1) / (k * microbatches + stages - 1)


def bubble_over_ideal(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Bubble time relative to the ideal (bubble-free) time: (P-1)/(V·M); with F = B = W, zb-h1
    and dualpipev (P-1)/(3M)."""
    check_schedule(schedule, stages, microbatches, virtual)
    k = SPLIT_FACTOR.get(schedule, virtual)
    return (stages - 1) / (k * microbatches)


def dualpipe_bubble_time(
    stages: int, t_f: float, t_b: float, t_w: float, t_fb: float | None = None
) -> float:
    """DeepSeek-V3's DualPipe (Table 2): idle time per rank (P/2 - 1)(t_fb + t_b - 3 t_w), beside
    1F1B's (P-1)(t_f + t_b) and ZB-H1's (P-1)(t_f + t_b - 2 t_w). t_f, t_b: a chunk's forward and
    full backward; t_w: the weight-gradient part of t_b; t_fb: a forward and a backward chunk run
    overlapped (default t_f + t_b: no overlap gain, as the paper's schedule figure draws them).
    P must be even (the two directions share the ranks)."""
    check_positive(stages=stages)
    if stages % 2:
        raise ValueError(f"stages={stages}: DualPipe needs an even number of stages")
    if not (t_f > 0 and t_b >= t_w >= 0):
        raise ValueError(f"need t_f > 0 and t_b >= t_w >= 0; got {t_f!r}, {t_b!r}, {t_w!r}")
    fb = t_f + t_b if t_fb is None else t_fb
    return (stages / 2 - 1) * (fb + t_b - 3 * t_w)


def in_flight_microbatches(
    schedule: str, stages: int, microbatches: int, stage: int = 0, virtual: int = 1
) -> int:
    """Micro-batches whose activations stage ``stage`` holds at the peak of a step.

    AFAB: all M. 1F1B: min(P - stage, M). Interleaved: each rank runs V chunks; its
    warm-up is (P - stage - 1)·2 + (V - 1)·P forwards (Megatron-LM's schedule), counted
    in chunk micro-batches, plus the one in its first steady-state step. ZB-H1: min(P, M)
    (1F1B's min(P - stage, M) plus the ``stage`` W's it postpones). DualPipeV: 2P + 1 chunk
    micro-batches on every rank, counted off its order (``peak_in_flight``). Naive: 1.
    """
    check_schedule(schedule, stages, microbatches, virtual)
    if not 0 <= stage < stages:
        raise ValueError(f"stage={stage} is outside 0..{stages - 1}")
    if schedule in ("gpipe", "afab", "naive"):
        return microbatches
    if schedule == "1f1b":
        return min(stages - stage, microbatches)
    if schedule == "zb-h1":
        return min(stages, microbatches)
    if schedule == "dualpipev":
        return peak_in_flight(schedule_ops(schedule, stages, microbatches, virtual)[stage])
    return min(interleaved_warmup(stages, microbatches, stage, virtual) + 1, virtual * microbatches)


def interleaved_peak(
    stages: int, microbatches: int, stage: int, virtual: int, chunk_bytes: list[float]
) -> tuple[float, int]:
    """(peak bytes, chunk micro-batches held at that peak) of rank ``stage`` in interleaved 1F1B,
    walking its order of operations: a forward of chunk c adds ``chunk_bytes[c]``, its backward
    frees them. Exact where chunks differ (the first chunk of the first stage also keeps the
    embedding's, the last chunk of the last stage the loss's)."""
    check_schedule("interleaved", stages, microbatches, virtual)
    if len(chunk_bytes) != virtual:
        raise ValueError(f"chunk_bytes needs one figure per chunk ({virtual}), got {chunk_bytes}")
    return max(
        (sum(n * b for n, b in zip(counts, chunk_bytes)), sum(counts))
        for counts in _held_counts(stages, microbatches, stage, virtual)
    )


def _held_counts(
    stages: int, microbatches: int, stage: int, virtual: int
) -> tuple[tuple[int, ...], ...]:
    """The chunk micro-batches rank ``stage`` holds, per chunk, after each of its interleaved
    forwards, those another moment does not beat on every chunk: where the peak must be."""
    return _held_counts_all(stages, microbatches, virtual)[stage]


@lru_cache(maxsize=256)
def _held_counts_all(
    stages: int, microbatches: int, virtual: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    out = []
    for rank in range(stages):
        # the rank's interleaved order (``schedule_ops``), counted: after its warm-up every
        # forward follows the backward of the micro-batch ``warm`` forwards behind it. Both
        # visit the chunks with period P·V, so past the warm-up the counts repeat every P·V
        # forwards: the first period shows them all.
        warm = interleaved_warmup(stages, microbatches, rank, virtual)
        counts = [0] * virtual
        seen = set()
        for j in range(min(virtual * microbatches, warm + 1 + stages * virtual)):
            counts[interleaved_op(j, stages, virtual, True)[1]] += 1
            if j > warm:
                counts[interleaved_op(j - warm - 1, stages, virtual, False)[1]] -= 1
            seen.add(tuple(counts))
        # the moments no other beats on every chunk: one that beats another has a larger sum,
        # so it comes first, or something that beats it does
        frontier = []
        for c in sorted(seen, key=sum, reverse=True):
            if not any(all(x >= y for x, y in zip(o, c)) for o in frontier):
                frontier.append(c)
        out.append(tuple(frontier))
    return tuple(out)


def step_time(
    schedule: str,
    stages: int,
    microbatches: int,
    t_f: float,
    t_b: float,
    virtual: int = 1,
    t_w: float | None = None,
) -> float:
    """Time of one step when every stage takes t_f / t_b per micro-batch: the ideal time
    M (t_f + t_b) plus the idle time of a rank (``idle_time``). Naive runs forwards only:
    P t_f."""
    check_schedule(schedule, stages, microbatches, virtual)
    if schedule == "naive":
        return stages * t_f
    return microbatches * (t_f + t_b) + idle_time(schedule, stages, t_f, t_b, virtual, t_w)


def idle_time(
    schedule: str,
    stages: int,
    t_f: float,
    t_b: float,
    virtual: int = 1,
    t_w: float | None = None,
) -> float:
    """A rank's idle time in one training step (the bubble, in time), t_f / t_b a rank's forward
    / backward of one micro-batch, t_w (default t_b / 2) the weight-gradient part of t_b:

        GPipe, 1F1B     (P-1)(t_f + t_b)
        interleaved     (P-1)(t_f + t_b)/V
        zb-h1           (P-1)(t_f + t_b - 2 t_w), exact when a W is no longer than a forward or
                        the B before it (t_w <= t_f and t_w <= t_b - t_w)
        dualpipev       (P-1) t_f, exact for t_w = t_b/2 and t_f <= t_b <= 2 t_f (a forward and
                        a backward paired as one operation, see the module docstring)

    ``simulate`` runs each schedule and confirms these (tests)."""
    check_positive(stages=stages, virtual=virtual)
    if schedule not in SCHEDULES or schedule == "naive":
        raise ValueError(f"schedule={schedule!r}: idle_time needs a training schedule")
    w = t_b / 2 if t_w is None else t_w
    if schedule not in SPLIT_BACKWARD and t_w is not None:
        raise ValueError(f"t_w={t_w!r} needs schedule in {SPLIT_BACKWARD}")
    if schedule == "zb-h1":
        return (stages - 1) * (t_f + t_b - 2 * w)
    if schedule == "dualpipev":
        if t_w is not None and t_w != t_b / 2:
            raise ValueError(
                f"t_w={t_w!r}: dualpipev's idle time is known in closed form for t_w = t_b/2 only;"
                " run the schedule with simulate(..., t_w=...) instead"
            )
        return (stages - 1) * t_f
    return (stages - 1) * (t_f + t_b) / virtual


# --- the schedules, operation by operation -------------------------------------------------


def interleaved_warmup(stages: int, microbatches: int, rank: int, virtual: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Megatron-LM): 2(P-r-1) + (V-1)P."""
    return min(2 * (stages - rank - 1) + (virtual - 1) * stages, virtual * microbatches)


def interleaved_op(k: int, stages: int, virtual: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward (or backward) in interleaved 1F1B: groups of
    P micro-batches go through chunk 0, then chunk 1, ...; backwards visit the chunks in reverse."""
    group, within = divmod(k, stages * virtual)
    chunk = within // stages
    return group * stages + within % stages, (chunk if forward else virtual - 1 - chunk)


def schedule_ops(
    schedule: str, stages: int, microbatches: int, virtual: int = 1
) -> list[list[tuple]]:
    """Each rank's operations in the order it runs them: ``[("F", mb, chunk), ("B", mb, chunk),
    ...]``; zb-h1 also has ("W", mb, 0), each after its B.

    Chunk c of rank r is virtual stage c·P + r (chunk 0 unless interleaved). ZB-H1 is 1F1B's
    order with every B followed by its W, except that rank r keeps its r latest W's back and runs
    them once its B's are done: they fill the cool-down, where 1F1B waits."""
    check_schedule(schedule, stages, microbatches, virtual)
    M = microbatches
    order = []
    for r in range(stages):
        if schedule == "naive":
            ops = [("F", 0, 0)]
        elif schedule in ("gpipe", "afab"):
            ops = [("F", i, 0) for i in range(M)] + [("B", i, 0) for i in range(M)]
        elif schedule == "1f1b":
            warmup = min(stages - r - 1, M)
            ops = [("F", i, 0) for i in range(warmup)]  # warm-up
            for i in range(M - warmup):  # steady state
                ops += [("F", warmup + i, 0), ("B", i, 0)]
            ops += [("B", i, 0) for i in range(M - warmup, M)]  # cool-down
        elif schedule == "zb-h1":
            ops = _zero_bubble_h1(stages, M, r)
        elif schedule == "dualpipev":
            ops = _dualpipe_v(stages, M, r)
        else:
            total = virtual * M
            warmup = interleaved_warmup(stages, M, r, virtual)
            fwd = [("F", *interleaved_op(k, stages, virtual, True)) for k in range(total)]
            bwd = [("B", *interleaved_op(k, stages, virtual, False)) for k in range(total)]
            ops = fwd[:warmup]
            for k in range(total - warmup):
                ops += [fwd[warmup + k], bwd[k]]
            ops += bwd[total - warmup :]
        order.append(ops)
    return order


def paired_operations(
    schedule: str, stages: int, microbatches: int, virtual: int = 1
) -> list[frozenset[int]]:
    """Per rank, the positions i in its ``schedule_ops`` where operations i and i+1 run as one
    (DualPipeV's overlapped forward-and-backward pairs: both inputs first, both outputs after);
    empty for every other schedule."""
    check_schedule(schedule, stages, microbatches, virtual)
    if schedule != "dualpipev":
        return [frozenset()] * stages
    return [_dualpipe_v_walk(stages, microbatches, r)[1] for r in range(stages)]


def _zero_bubble_h1(stages: int, microbatches: int, rank: int) -> list[tuple]:
    """Rank ``rank``'s ZB-H1 order: 1F1B's F's and B's, each B followed by a W, the ``rank``
    latest W's held back until the end."""
    warmup = min(stages - rank - 1, microbatches)
    ops = [("F", i, 0) for i in range(warmup)]
    order = []  # 1F1B's steady state and cool-down
    for i in range(microbatches - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(microbatches - warmup, microbatches)]
    postponed = []
    for op in order:
        ops.append(op)
        if op[0] == "B":
            postponed.append(("W", op[1], 0))
            if len(postponed) > rank:
                ops.append(postponed.pop(0))
    return ops + postponed


def _dualpipe_v(stages: int, microbatches: int, rank: int) -> list[tuple]:
    """Rank ``rank``'s DualPipeV order (``_dualpipe_v_walk``'s operations)."""
    return list(_dualpipe_v_walk(stages, microbatches, rank)[0])


@lru_cache(maxsize=256)
def _dualpipe_v_walk(stages: int, microbatches: int, rank: int) -> tuple[tuple, frozenset]:
    """Rank ``rank``'s DualPipeV order, and the positions i where operations i and i+1 are one
    overlapped pair (a forward and a full backward). Chunk 0 is stage r, chunk 1 stage 2P-1-r
    (the V's way back). Each chunk takes its micro-batches in order; a split backward's W waits
    in a queue until a phase below runs the oldest one. Phases (torch's ``ScheduleDualPipeV``):

    1. 2(P-r-1) forwards of chunk 0: the ranks further down the V need them first
    2. r+1 times: a forward of chunk 0, then of chunk 1
    3. P-r-1 times: chunk 1's B and at once its W, then a forward of chunk 1
    4. M-2P+r+1 times: F of chunk 0 with a full backward BW of chunk 1, then F of chunk 1 with
       BW of chunk 0: each a pair, one operation (overlapped on a GPU: one's communication under
       the other's compute); the last rank runs its first F-of-0-then-BW-of-1 unpaired, as
       DeepSeek's code does, "to further reduce bubble size"
    5. P-r-1 times: BW of chunk 1, then the pair F of chunk 1 with BW of chunk 0
    6. r+1 times: a backward of chunk 1, then of chunk 0; from the middle of this phase on
       (before chunk 1's on odd ranks, before chunk 0's on even ones) they split: B now, W later
    7. P-r-1 times: a postponed W, then chunk 0's B
    8. r+1 times: a postponed W (the last of them)"""
    P = stages
    r = rank
    M = microbatches
    done = {}  # (kind, chunk) -> micro-batches done: forwards "F", backwards "B"
    postponed = []  # the W's of split backwards, oldest first
    ops = []
    pairs = set()  # positions of the pairs' forwards

    def run(name: str, chunk: int) -> None:
        kind = "F" if name == "F" else "B"
        mb = done.get((kind, chunk), 0)
        done[(kind, chunk)] = mb + 1
        ops.append((name, mb, chunk))
        if name == "B":
            postponed.append(("W", mb, chunk))

    def weight() -> None:
        if postponed:
            ops.append(postponed.pop(0))

    def pair(forward_chunk: int, backward_chunk: int) -> None:
        pairs.add(len(ops))
        run("F", forward_chunk)
        run("BW", backward_chunk)

    for _ in range(2 * (P - r - 1)):
        run("F", 0)
    for _ in range(r + 1):
        run("F", 0)
        run("F", 1)
    for _ in range(P - r - 1):
        run("B", 1)
        weight()
        run("F", 1)
    for i in range(M - 2 * P + r + 1):
        if i == 0 and r == P - 1:
            run("F", 0)
            run("BW", 1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(P - r - 1):
        run("BW", 1)
        pair(1, 0)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        run("B" if split else "BW", 1)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        run("B" if split else "BW", 0)
    for _ in range(P - r - 1):
        weight()
        run("B", 0)
    for _ in range(r + 1):
        weight()
    return tuple(ops), frozenset(pairs)


def _needs(name: str, mb: int, vs: int, last: int) -> list[tuple]:
    """The operations whose results (name, micro-batch, virtual stage) an operation needs; a full
    backward "BW" counts as its stage's "B" for the stage before it."""
    if name == "F":
        return [("F", mb, vs - 1)] if vs > 0 else []
    if name == "W":
        return [("B", mb, vs)]
    return [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs < last else [])


def simulate(
    schedule: str,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    t_f: float | list = 1.0,
    t_b: float | list = 2.0,
    t_delay: float = 0.0,
    t_w: float | None = None,
    paired: bool = True,
) -> dict:
    """Run the schedule on paper: each rank takes its operations in order, each as soon as its
    input exists (the previous virtual stage's forward, the next one's backward), plus ``t_delay``
    (what holds a real operation up: a message's latency, a busy CPU). A DualPipeV pair
    (``paired_operations``) waits for both its inputs and hands on both outputs when both are
    done; ``paired=False`` runs its two halves as independent operations instead, which no
    implementation does (it halves DualPipeV's idle time). ``t_f`` / ``t_b``: one rank's
    forward / backward of a micro-batch, the same for every rank or a list with one time per rank.
    zb-h1 and dualpipev split backwards into B (t_b - t_w) and W (t_w, default t_b / 2); a full
    backward "BW" takes t_b. A rank's chunk takes 1/V (dualpipev: 1/2) of each time. Returns
    ``events`` (dicts with rank, name, microbatch, chunk, start, end), ``makespan``,
    ``bubble_fraction`` (idle share of ranks x makespan) and ``in_flight`` (peak micro-batches held,
    per rank)."""
    t_fs = list(t_f) if isinstance(t_f, (list, tuple)) else [t_f] * stages
    t_bs = list(t_b) if isinstance(t_b, (list, tuple)) else [t_b] * stages
    if len(t_fs) != stages or len(t_bs) != stages:
        raise ValueError(
            f"t_f and t_b need one time per stage ({stages}); got t_f={t_f!r}, t_b={t_b!r}"
        )
    if not (min(t_fs) > 0 and min(t_bs) >= 0 and t_delay >= 0):
        raise ValueError(
            f"t_f must be > 0, t_b and t_delay >= 0; got t_f={t_f!r}, t_b={t_b!r},"
            f" t_delay={t_delay!r}"
        )
    order = schedule_ops(schedule, stages, microbatches, virtual)
    chunks = chunks_per_rank(schedule, virtual)
    # per rank; a split backward's W takes its share of the backward
    split = schedule in SPLIT_BACKWARD
    w_share = (0.5 if t_w is None else t_w / t_bs[0]) if split else 0.0
    if t_w is not None and (not split or not 0 <= t_w <= min(t_bs)):
        raise ValueError(f"t_w={t_w!r} needs schedule in {SPLIT_BACKWARD} and 0 <= t_w <= t_b")
    cost = {
        "F": [t / chunks for t in t_fs],
        "B": [t * (1 - w_share) / chunks for t in t_bs],
        "W": [t * w_share / chunks for t in t_bs],
        "BW": [t / chunks for t in t_bs],
    }
    last = stages * chunks - 1
    pairs = paired_operations(schedule, stages, microbatches, virtual)
    if not paired:
        pairs = [frozenset()] * stages
    end = {}  # (name, micro-batch, virtual stage) -> when that operation's output exists
    free = [0.0] * stages  # when each rank is next free
    nxt = [0] * stages  # each rank's next operation in ``order``
    events = []
    while any(nxt[r] < len(order[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            while nxt[r] < len(order[r]):
                # one operation, or a pair run as one: both inputs first, both outputs after
                ops = order[r][nxt[r] : nxt[r] + (2 if nxt[r] in pairs[r] else 1)]
                keys = [(n, mb, virtual_stage(schedule, stages, r, c)) for n, mb, c in ops]
                needs = [x for key in keys for x in _needs(*key, last) if x not in keys]
                if any(n not in end for n in needs):
                    break  # its input is not computed yet: the next rank in line may be able to go
                finish = max([free[r]] + [end[n] for n in needs])
                for name, mb, chunk in ops:
                    start = finish + t_delay
                    finish = start + cost[name][r]
                    events.append(
                        {
                            "rank": r,
                            "name": name,
                            "microbatch": mb,
                            "chunk": chunk,
                            "start": start,
                            "end": finish,
                        }
                    )
                for name, mb, vs in keys:
                    end[(name, mb, vs)] = finish
                    if name == "BW":  # the input's gradient is ready when the full backward ends
                        end[("B", mb, vs)] = finish
                free[r] = finish
                nxt[r] += len(ops)
                progressed = True
        # an internal invariant, tested for every schedule
        assert progressed, f"schedule {schedule} deadlocks"
    return {
        "events": events,
        "makespan": max(e["end"] for e in events),
        "bubble_fraction": idle_share(events),
        "in_flight": [peak_in_flight(ops) for ops in order],
    }


def idle_share(events: list[dict]) -> float:
    """1 - busy / (ranks x makespan) over "F"/"B"/"W"/"BW" events: the bubble fraction of a
    chart."""
    work = [e for e in events if e["name"] in OPERATIONS]
    ranks = {e["rank"] for e in work}
    span = max(e["end"] for e in work) - min(e["start"] for e in work)
    return 1.0 - sum(e["end"] - e["start"] for e in work) / (len(ranks) * span)


def fit_timeline(
    events: list[dict], schedule: str, stages: int, microbatches: int, virtual: int = 1
) -> dict:
    """What a measured chart says about its machine: the median forward and backward time of a
    rank's share of the layers (``t_forward``, ``t_backward``; a split backward's B and W added
    up, ``t_weight`` its W); the mean delay of an operation, how long after it could have started
    (its rank free, its input computed) it did start (``t_delay``: a message's latency, a busy
    CPU, a neighbour slow to take a blocking send); and the bubble the schedule has with exactly
    those (``bubble_fraction``)."""
    check_schedule(schedule, stages, microbatches, virtual)
    chunks = chunks_per_rank(schedule, virtual)
    last = stages * chunks - 1
    done = {}  # (name, micro-batch, virtual stage) -> its event
    delays = []
    durations = {name: [] for name in OPERATIONS}
    for e in events:
        vs = virtual_stage(schedule, stages, e["rank"], e["chunk"])
        done[(e["name"], e["microbatch"], vs)] = e
        if e["name"] == "BW":  # a full backward gives the stage before it its gradient
            done[("B", e["microbatch"], vs)] = e
        durations[e["name"]].append(e["end"] - e["start"])
    for rank in range(stages):
        previous_end = None
        for e in sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start"]):
            vs = virtual_stage(schedule, stages, rank, e["chunk"])
            ready = [
                done[n]["end"] for n in _needs(e["name"], e["microbatch"], vs, last) if n in done
            ] + ([previous_end] if previous_end is not None else [])
            if ready:  # a rank's very first operation without inputs starts when the rank does
                delays.append(max(0.0, e["start"] - max(ready)))
            previous_end = e["end"]

    def typical(name: str) -> float:  # a rank's whole share: a chunk's time x chunks
        return median(durations[name] or [0.0]) * chunks

    t_f = typical("F")
    t_w = typical("W") if schedule in SPLIT_BACKWARD else None
    if schedule not in SPLIT_BACKWARD:
        t_b = typical("B")
    elif durations["BW"]:
        t_b = typical("BW")
    else:
        t_b = typical("B") + t_w
    t_w = None if t_w is None else min(t_w, t_b)
    t_delay = sum(delays) / len(delays) if delays else 0.0
    sim = simulate(schedule, stages, microbatches, virtual, t_f, t_b, t_delay, t_w=t_w)
    return {
        "t_forward": t_f,
        "t_backward": t_b,
        "t_weight": t_w,
        "t_delay": t_delay,
        "bubble_fraction": sim["bubble_fraction"],
    }


def peak_in_flight(ops: list[tuple]) -> int:
    """Most forwards done whose backward is not (with split backwards, whose W is not): the
    micro-batches (chunk micro-batches) held at once. A micro-batch is let go by its full
    backward ("B" where no "W" follows, or "BW") or by its W."""
    release = ("W", "BW") if any(name == "W" for name, *_ in ops) else ("B", "BW")
    held = 0
    peak = 0
    for name, *_ in ops:
        if name == "F":
            held += 1
        elif name in release:
            held -= 1
        peak = max(peak, held)
    return peak


# --- splitting the layers into stages ------------------------------------------------------


def balanced_plan(
    layer_costs: list[int], stages: int, *, first_extra: int = 0, last_extra: int = 0
) -> tuple[int, ...]:
    """Layers per stage, contiguous, minimising the largest stage's cost (e.g. parameters);
    the first stage also carries ``first_extra`` (the embedding), the last ``last_extra``
    (final norm and head). Every stage gets at least one layer."""
    check_positive(stages=stages)
    n = len(layer_costs)
    if stages > n:
        raise ValueError(f"stages={stages} but the model has only {n} layers; use stages <= {n}")
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: (largest stage cost, plan) splitting the first i layers into s stages
    best = {(0, 0): (0, ())}
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            options = []
            for j in range(s - 1, i):
                if (s - 1, j) in best:
                    cost = (
                        prefix[i]
                        - prefix[j]
                        + (first_extra if s == 1 else 0)
                        + (last_extra if s == stages else 0)
                    )
                    prev_cost, plan = best[(s - 1, j)]
                    options.append((max(prev_cost, cost), plan + (i - j,)))
            best[(s, i)] = min(options)
    return best[(stages, n)][1]


def fill_plan(
    layer_costs: list[int],
    stages: int,
    *,
    capacity: int,
    first_extra: int = 0,
    last_extra: int = 0,
) -> tuple[int, ...]:
    """Fill device 0 up to ``capacity``, then device 1, ... (the sequential placement behind
    ``device_map="auto"``). The first device also holds ``first_extra``, the last ``last_extra``;
    devices after the fill ends hold no layers (only the last one's head)."""
    check_positive(stages=stages, capacity=capacity)
    plan = _fill(layer_costs, stages, capacity, first_extra, last_extra)
    if plan is None:
        lo = 1
        hi = sum(layer_costs) + first_extra + last_extra
        while lo < hi:  # the smallest capacity that fits: filling is monotone in capacity
            mid = (lo + hi) // 2
            if _fill(layer_costs, stages, mid, first_extra, last_extra):
                hi = mid
            else:
                lo = mid + 1
        raise ValueError(
            f"capacity={capacity} is too small to place the model on {stages} devices; "
            f"use capacity >= {lo}"
        )
    return plan


def _fill(
    layer_costs: list[int], stages: int, capacity: int, first_extra: int, last_extra: int
) -> tuple[int, ...] | None:
    plan = [0] * stages
    used = [0] * stages
    used[0] += first_extra
    used[-1] += last_extra
    if max(used) > capacity:
        return None
    s = 0
    for cost in layer_costs:
        while used[s] + cost > capacity:
            s += 1
            if s == stages:
                return None
        plan[s] += 1
        used[s] += cost
    return tuple(plan)


def plan_costs(
    layer_costs: list[int], plan: tuple[int, ...], first_extra: int = 0, last_extra: int = 0
) -> list[int]:
    """Cost of each stage under ``plan`` (layers per stage)."""
    if sum(plan) != len(layer_costs) or any(n < 0 for n in plan):
        raise ValueError(
            f"plan={tuple(plan)} must assign all {len(layer_costs)} layers, >= 0 per stage"
        )
    out = []
    i = 0  # the stage's first layer
    for s, n in enumerate(plan):
        out.append(
            sum(layer_costs[i : i + n])
            + (first_extra if s == 0 else 0)
            + (last_extra if s == len(plan) - 1 else 0)
        )
        i += n
    return out


def p2p_bytes_per_rank(
    schedule: str,
    stages: int,
    rank: int,
    *,
    batch: int,
    seq_len: int,
    hidden: int,
    itemsize: int = 4,
    virtual: int = 1,
) -> int:
    """Bytes rank ``rank`` sends in one step: B·T·H·itemsize for every chunk whose output goes on
    to another virtual stage (forward) and every chunk whose input came from one (backward). In
    DualPipeV's V the two middle stages share rank P-1, which passes between them in memory."""
    if not 0 <= rank < stages:
        raise ValueError(f"rank={rank} is outside 0..{stages - 1}")
    per_boundary = batch * seq_len * hidden * itemsize
    if schedule == "dualpipev":
        last = 2 * stages - 1
        mine = (virtual_stage(schedule, stages, rank, c) for c in range(2))
        messages = sum(
            (s < last and stage_rank(schedule, stages, s + 1) != rank)
            + (s > 0 and stage_rank(schedule, stages, s - 1) != rank)
            for s in mine
        )
        return messages * per_boundary
    forward = virtual - (1 if rank == stages - 1 else 0)
    backward = 0 if schedule == "naive" else virtual - (1 if rank == 0 else 0)
    return (forward + backward) * per_boundary


def pp_vs_tp(
    *,
    layers: int,
    hidden: int,
    seq_len: int,
    batch: int,
    degree: int,
    itemsize: int = 2,
    bandwidth: float = 50e9,
) -> dict:
    """Bytes one rank sends per step when ``degree`` ranks split a model's ``layers`` by pipeline
    or by tensor parallelism, and the seconds that takes at ``bandwidth`` (bytes/s per rank;
    50e9 = 400 Gb/s, one InfiniBand NIC per GPU, the usual link *between* nodes).

    PP (a middle stage): the batch's activations [B, T, H] forward and their gradients
    backward, once per step whatever M: 2·B·T·H·itemsize.
    TP (Megatron): two all-reduces of [B, T, H] per layer in forward and two in backward, each
    2(N-1)/N·B·T·H·itemsize on a ring, on every one of the L layers: 8·L·(N-1)/N·B·T·H·itemsize.
    """
    check_positive(
        layers=layers, hidden=hidden, seq_len=seq_len, batch=batch, degree=degree, itemsize=itemsize
    )
    activation = batch * seq_len * hidden * itemsize
    pp = 2 * activation
    tp = 8 * layers * (degree - 1) / degree * activation
    return {
        "pp_bytes_per_rank": pp,
        "tp_bytes_per_rank": tp,
        "tp_over_pp": tp / pp,
        "pp_seconds": pp / bandwidth,
        "tp_seconds": tp / bandwidth,
        "tp_collectives_per_step": 4 * layers,
        "bandwidth": bandwidth,
    }


def format_pp_vs_tp(r: dict) -> str:
    """``pp_vs_tp``'s result in three lines."""
    pp_gb = r["pp_bytes_per_rank"] / 1e9
    tp_gb = r["tp_bytes_per_rank"] / 1e9
    return "\n".join(
        [
            f"pipeline parallel: {pp_gb:8.2f} GB per rank per step -> {r['pp_seconds']:7.3f} s"
            f" at {r['bandwidth'] / 1e9:g} GB/s"
            " (point to point, overlaps with other micro-batches' compute)",
            f"tensor parallel:   {tp_gb:8.2f} GB per rank per step -> {r['tp_seconds']:7.3f} s"
            f" ({r['tp_collectives_per_step']} all-reduces on the critical path)",
            f"TP sends {r['tp_over_pp']:.0f}x the bytes of PP",
        ]
    )


def figures(
    schedule: str,
    stages: int,
    microbatches: int,
    virtual: int | None = None,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float | None = None,
) -> dict:
    """Everything the calculator (``python -m labs.theory bubble``) shows: formula and simulated
    bubble, step times, activations
    held. ``virtual``: default 1 (dualpipev: 2); ``t_w``: the W part of t_b for the split
    schedules (default t_b / 2)."""
    virtual = chunks_per_rank(schedule, 1) if virtual is None else virtual
    t_b = 0.0 if schedule == "naive" else t_b  # inference: forwards only
    sim = simulate(schedule, stages, microbatches, virtual, t_f, t_b, t_w=t_w)
    held = [
        in_flight_microbatches(schedule, stages, microbatches, s, virtual) for s in range(stages)
    ]
    rule_bubble = (
        None
        if schedule == "naive"
        else bubble_fraction(schedule, stages, max(microbatches, 4 * stages), virtual)
    )
    step = step_time(schedule, stages, microbatches, t_f, t_b, virtual, t_w)
    if schedule in SPLIT_BACKWARD:  # the formula for the given times, not only F = B = W
        ideal = microbatches * (t_f + t_b)
        bubble = 1 - ideal / step
        over_ideal = step / ideal - 1
    else:
        bubble = bubble_fraction(schedule, stages, microbatches, virtual)
        over_ideal = bubble_over_ideal(schedule, stages, microbatches, virtual)
    return {
        "schedule": schedule,
        "stages": stages,
        "microbatches": microbatches,
        "virtual": virtual,
        "t_forward": t_f,
        "t_backward": t_b,
        "t_weight": (t_b / 2 if t_w is None else t_w) if schedule in SPLIT_BACKWARD else None,
        "bubble_fraction": bubble,
        "bubble_over_ideal": over_ideal,
        "simulated_bubble_fraction": sim["bubble_fraction"],
        "step_time": step,
        "simulated_step_time": sim["makespan"],
        "in_flight_microbatches": held,
        # activations held, in units of one micro-batch's activations on one whole stage
        "activation_microbatches_per_stage": [h / virtual for h in held],
        # the rule of thumb: at least 4 micro-batches per stage keeps the bubble small
        "rule_microbatches": 4 * stages,
        "rule_bubble_fraction": rule_bubble,
    }


def format_result(r: dict) -> str:
    """``figures``' result, one figure per line (``python -m labs.theory bubble``)."""
    v = f", V={r['virtual']}" if r["schedule"] == "interleaved" else ""
    w = f", t_w={r['t_weight']:g}" if r.get("t_weight") is not None else ""
    lines = [
        f"{r['schedule']}: P={r['stages']}, M={r['microbatches']}{v},"
        f" t_f={r['t_forward']:g}, t_b={r['t_backward']:g}{w}",
        f"bubble fraction     {r['bubble_fraction']:.4f}  (idle share of the step; simulated "
        f"{r['simulated_bubble_fraction']:.4f})",
        f"bubble / ideal      {r['bubble_over_ideal']:.4f}",
        f"step time           {r['step_time']:g}  (simulated {r['simulated_step_time']:g})",
        f"micro-batches held  {r['in_flight_microbatches']}  (per rank, first to last"
        + ("; chunk micro-batches)" if r["virtual"] > 1 else ")"),
    ]
    if r["rule_bubble_fraction"] is not None:
        lines.append(
            f"rule of thumb       M >= 4P = {r['rule_microbatches']} micro-batches:"
            f" bubble fraction {r['rule_bubble_fraction']:.4f}"
        )
    return "\n".join(lines)
