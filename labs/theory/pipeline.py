"""Pipeline schedules on paper: bubble fraction and activations held per stage. Pure Python.

Symbols: P stages (ranks), M micro-batches per step, V virtual stages (model chunks) per
rank for the interleaved schedule; t_f and t_b the forward and backward time of one
micro-batch on one stage (one chunk's share for interleaved).

Bubble (the Ultra-Scale Playbook, "Pipeline parallelism"; Narayanan et al. 2021, §2.2):

    GPipe / AFAB, 1F1B:   idle time per rank (P-1)(t_f+t_b); ideal time M (t_f+t_b)
                          bubble / ideal = (P-1)/M;  idle share of the step = (P-1)/(M+P-1)
    interleaved 1F1B:     the idle time shrinks by V:  bubble / ideal = (P-1)/(V M);
                          idle share = (P-1)/(V M + P-1)

Activation memory: AFAB runs every forward before any backward, so each stage holds
the activations of all M micro-batches; 1F1B starts backwards after a warm-up of P-s
forwards on stage s (0-based), so stage s holds at most min(P-s, M) (the first stage
holds the most, P).
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "afab", "1f1b", "interleaved")


def _check(schedule: str, stages: int, microbatches: int, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if schedule != "interleaved" and virtual != 1:
        raise ValueError(f"virtual={virtual} only applies to schedule='interleaved'; use virtual=1")
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(f"interleaved 1F1B needs microbatches divisible by stages: microbatches={microbatches}, "
                         f"stages={stages}; use a multiple of {stages}")


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of the step's total time on each rank: (P-1)/(V·M + P-1)."""
    _check(schedule, stages, microbatches, virtual)
    v = virtual if schedule == "interleaved" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


def bubble_over_ideal(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Bubble time relative to the ideal (bubble-free) time: (P-1)/(V·M)."""
    _check(schedule, stages, microbatches, virtual)
    v = virtual if schedule == "interleaved" else 1
    return (stages - 1) / (v * microbatches)


def in_flight_microbatches(schedule: str, stages: int, microbatches: int, stage: int = 0, virtual: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` holds at the peak of a step.

    AFAB: all M. 1F1B: min(P - stage, M). Interleaved: each rank runs V chunks; its
    warm-up is (P - stage - 1)·2 + (V - 1)·P forwards (Megatron-LM's schedule), counted
    in chunk micro-batches, plus the one in its first steady-state step.
    """
    _check(schedule, stages, microbatches, virtual)
    if not 0 <= stage < stages:
        raise ValueError(f"stage={stage} is outside 0..{stages - 1}")
    if schedule in ("gpipe", "afab"):
        return microbatches
    if schedule == "1f1b":
        return min(stages - stage, microbatches)
    warmup = (stages - stage - 1) * 2 + (virtual - 1) * stages
    return min(warmup + 1, virtual * microbatches)


def step_time(schedule: str, stages: int, microbatches: int, t_f: float, t_b: float, virtual: int = 1) -> float:
    """Time of one step when every stage takes t_f / t_b per micro-batch (per chunk for
    interleaved, whose chunks are 1/V of a stage): ideal time plus the bubble."""
    _check(schedule, stages, microbatches, virtual)
    v = virtual if schedule == "interleaved" else 1
    per_microbatch = t_f + t_b
    return microbatches * per_microbatch + (stages - 1) * per_microbatch / v
