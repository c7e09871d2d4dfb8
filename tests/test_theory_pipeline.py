"""Pipeline theory (no processes): bubble formulas = the schedules run on paper; activations held;
layer plans; bytes; the `bubble` CLI; the bubble calculator's drawing, headless."""

import itertools
from collections import Counter

import pytest

from labs.theory import pipeline as th
from tests.helpers import run_cli, run_json

CASES = [
    (s, p, m, 1)
    for s in ("gpipe", "1f1b")
    for p in (1, 2, 3, 4, 8)
    for m in (1, 2, 3, 4, 5, 8, 16, 32)
] + [
    ("interleaved", p, m, v)
    for p in (1, 2, 4)
    for v in (1, 2, 3, 4)
    for m in (p, 2 * p, 4 * p, 8 * p)
]


@pytest.mark.parametrize("t_b", [0.5, 2.0, 3.0])
def test_bubble_formula_equals_the_schedule_run_on_paper(t_b):
    """(P-1)/(V·M+P-1) is what each schedule's own order of operations gives, for any t_b/t_f."""
    for schedule, p, m, v in CASES:
        sim = th.simulate(schedule, p, m, v, t_f=1.0, t_b=t_b)
        assert sim["bubble_fraction"] == pytest.approx(
            th.bubble_fraction(schedule, p, m, v), abs=1e-12
        ), (schedule, p, m, v)
        assert sim["makespan"] == pytest.approx(th.step_time(schedule, p, m, 1.0, t_b, v))
        ideal = m * (1.0 + t_b)
        assert sim["makespan"] / ideal - 1 == pytest.approx(
            th.bubble_over_ideal(schedule, p, m, v), abs=1e-12
        )


def test_known_values():
    assert th.bubble_fraction("1f1b", 4, 8) == 3 / 11
    assert th.bubble_fraction("gpipe", 4, 8) == th.bubble_fraction("afab", 4, 8) == 3 / 11
    assert th.bubble_fraction("interleaved", 4, 8, 2) == 3 / 19
    assert th.bubble_fraction("naive", 4, 1) == 0.75
    assert th.bubble_over_ideal("1f1b", 4, 8) == 3 / 8
    # the rule of thumb: M = 4P keeps the 1F1B bubble under 20 % of the step for any P
    assert all(th.bubble_fraction("1f1b", p, 4 * p) < 0.2 for p in range(1, 65))


def test_every_operation_once_in_a_valid_order():
    for schedule, p, m, v in CASES + [("naive", 4, 1, 1)]:
        for ops in th.schedule_ops(schedule, p, m, v):
            counts = Counter(ops)
            assert set(counts.values()) == {1}, (schedule, p, m, v)
            forwards = {(mb, c) for name, mb, c in ops if name == "F"}
            assert forwards == {(mb, c) for mb in range(m) for c in range(v)}
            for i, (name, mb, c) in enumerate(ops):
                if name == "B":
                    assert ("F", mb, c) in ops[:i], (
                        f"{schedule}: backward of {mb}.{c} before its forward"
                    )


def test_1f1b_phases():
    ops = th.schedule_ops("1f1b", 4, 8)
    for s in range(4):
        warmup = 4 - s - 1
        assert [n for n, *_ in ops[s][: warmup + 1]] == ["F"] * (warmup + 1)
        steady = [n for n, *_ in ops[s][warmup : warmup + 2 * (8 - warmup)]]
        assert steady == ["F", "B"] * (8 - warmup)
        assert [n for n, *_ in ops[s][len(ops[s]) - warmup :]] == ["B"] * warmup  # cool-down
    assert th.schedule_ops("gpipe", 2, 2)[0] == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]


def test_activations_held_formula_equals_the_schedule():
    for schedule, p, m, v in CASES:
        sim = th.simulate(schedule, p, m, v)
        for s in range(p):
            assert sim["in_flight"][s] == th.in_flight_microbatches(schedule, p, m, s, v), (
                schedule,
                p,
                m,
                v,
                s,
            )
    assert [th.in_flight_microbatches("gpipe", 4, 8, s) for s in range(4)] == [8] * 4
    assert [th.in_flight_microbatches("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert th.in_flight_microbatches("1f1b", 4, 2, 0) == 2  # M < P: never more than M


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: th.bubble_fraction("zb", 4, 8), "schedule='zb' is not one of"),
        (lambda: th.bubble_fraction("1f1b", 0, 8), "stages must be an integer >= 1"),
        (
            lambda: th.bubble_fraction("1f1b", 4, 8, 2),
            "virtual=2 only applies to schedule='interleaved'",
        ),
        (
            lambda: th.bubble_fraction("interleaved", 4, 6, 2),
            "microbatches divisible by stages: microbatches=6",
        ),
        (lambda: th.bubble_fraction("naive", 4, 8), "microbatches=8, use microbatches=1"),
        (lambda: th.in_flight_microbatches("1f1b", 4, 8, stage=4), "stage=4 is outside 0..3"),
        (lambda: th.simulate("1f1b", 4, 8, t_f=0), "t_f must be > 0"),
        (lambda: th.balanced_plan([1] * 4, 5), "stages=5 but the model has only 4 layers"),
        (
            lambda: th.fill_plan([10] * 4, 2, capacity=15),
            "capacity=15 is too small .* use capacity >= 20",
        ),
    ],
)
def test_bad_input_names_the_parameter(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_balanced_plan_minimises_the_largest_stage():
    costs = [5, 1, 1, 1, 7, 2, 2, 3]
    for stages in range(1, 6):
        plan = th.balanced_plan(costs, stages, first_extra=3, last_extra=4)
        assert sum(plan) == len(costs) and min(plan) >= 1
        best = min(
            max(th.plan_costs(costs, split, 3, 4))
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
            for split in [tuple(b - a for a, b in zip((0,) + cuts, cuts + (len(costs),)))]
        )
        assert max(th.plan_costs(costs, plan, 3, 4)) == best
    assert th.balanced_plan([10] * 8, 4, first_extra=4, last_extra=4) == (2, 2, 2, 2)


def test_fill_plan_fills_device_after_device():
    # device_map-style: a generous budget puts everything on the first device
    assert th.fill_plan([10] * 8, 4, capacity=1000, first_extra=5, last_extra=5) == (8, 0, 0, 0)
    assert th.fill_plan([10] * 8, 4, capacity=35, first_extra=5, last_extra=5) == (3, 3, 2, 0)
    plan = th.fill_plan([10] * 8, 4, capacity=25, first_extra=5, last_extra=5)
    assert plan == (2, 2, 2, 2) and max(th.plan_costs([10] * 8, plan, 5, 5)) <= 25


def test_p2p_bytes():
    kw = dict(batch=16, seq_len=32, hidden=64)
    per_boundary = 16 * 32 * 64 * 4
    assert [th.p2p_bytes_per_rank("1f1b", 4, r, **kw) for r in range(4)] == [
        per_boundary,
        2 * per_boundary,
        2 * per_boundary,
        per_boundary,
    ]
    assert [th.p2p_bytes_per_rank("naive", 4, r, **kw) for r in range(4)] == [per_boundary] * 3 + [
        0
    ]
    assert [th.p2p_bytes_per_rank("interleaved", 2, r, virtual=2, **kw) for r in range(2)] == [
        3 * per_boundary
    ] * 2


def test_fit_recovers_a_charts_times_and_delay():
    for schedule, p, m, v in [("1f1b", 4, 8, 1), ("gpipe", 2, 4, 1), ("interleaved", 4, 8, 2)]:
        sim = th.simulate(schedule, p, m, v, t_f=1.5, t_b=2.5, t_delay=0.2)
        fit = th.fit_timeline(sim["events"], schedule, p, m, v)
        assert (fit["t_forward"], fit["t_backward"]) == (pytest.approx(1.5), pytest.approx(2.5))
        assert fit["t_delay"] == pytest.approx(0.2)
        assert fit["bubble_fraction"] == pytest.approx(sim["bubble_fraction"])
        # delays only add idle time
        assert sim["bubble_fraction"] > th.bubble_fraction(schedule, p, m, v)


def test_idle_share_equals_the_timelines_idle_fraction():
    from labs.measure import Event, idle_fraction

    events = th.simulate("interleaved", 4, 8, 2, t_delay=0.1)["events"]
    assert th.idle_share(events) == pytest.approx(
        idle_fraction([Event(e["rank"], e["name"], e["start"], e["end"]) for e in events])
    )


def test_bubble_cli():
    r = run_json(
        "-m",
        "labs.theory",
        "bubble",
        "--schedule",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--json",
    )
    assert r["bubble_fraction"] == pytest.approx(3 / 11)
    assert r["simulated_bubble_fraction"] == pytest.approx(3 / 11)
    assert r["in_flight_microbatches"] == [4, 3, 2, 1] and r["rule_microbatches"] == 16
    r = run_json(
        "-m",
        "labs.theory",
        "bubble",
        "--schedule",
        "interleaved",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--virtual",
        "2",
        "--json",
    )
    assert r["bubble_fraction"] == pytest.approx(3 / 19)
    text = run_cli(
        "-m", "labs.theory", "bubble", "--schedule", "gpipe", "--stages", "2", "--microbatches", "3"
    ).stdout
    assert "bubble fraction     0.2500" in text
    bad = run_cli(
        "-m",
        "labs.theory",
        "bubble",
        "--schedule",
        "interleaved",
        "--stages",
        "4",
        "--microbatches",
        "6",
        "--virtual",
        "2",
    )
    assert (
        bad.returncode == 2
        and "microbatches divisible by stages" in bad.stderr
        and "Traceback" not in bad.stderr
    )


def test_bubble_calculator_draws_the_theory():
    from labs.widgets.pipeline import draw_schedule

    fig, r = draw_schedule("1f1b", 4, 8)
    assert r == th.figures("1f1b", 4, 8)
    gantt = fig.axes[0]
    # one hatched bar per backward
    assert len([b for b in gantt.patches if b.get_hatch() == "//"]) == 4 * 8
    with pytest.raises(ValueError, match="virtual=2 only applies"):
        draw_schedule("1f1b", 4, 8, virtual=2)
    # a measured run drawn below: here a chart made on paper stands in for it
    sim = th.simulate("gpipe", 2, 4, t_delay=0.1)
    summary = {
        "schedule": "gpipe",
        "nproc": 2,
        "microbatches": 4,
        "virtual": 1,
        "backend": "gloo",
        "op_time_s": 0.02,
        "timeline": sim["events"],
        "bubble_fraction": sim["bubble_fraction"],
        "measured_t_forward_s": 1.0,
        "measured_delay_s": 0.1,
        "delay_bubble_fraction": sim["bubble_fraction"],
        "microbatches_held": [4, 4],
    }
    fig, _ = draw_schedule("gpipe", 2, 4, measured=summary)
    assert len(fig.axes) == 4 and "measured on 2 ranks" in fig.axes[2].get_title(loc="left")


def test_bubble_calculator_widget_reports_invalid_settings(capsys):
    from labs.widgets.pipeline import bubble_calculator

    box = bubble_calculator("1f1b", stages=4, microbatches=8)
    schedule, _, microbatches, virtual = box.children[0].children
    overlay = box.children[1].children[2]
    assert virtual.disabled and not overlay.value
    schedule.value = "interleaved"
    microbatches.value = 6
    assert (
        "invalid: interleaved 1F1B needs microbatches divisible by stages"
        in capsys.readouterr().out
    )
    microbatches.value = 8
    assert not virtual.disabled and "bubble fraction" in capsys.readouterr().out


def test_pp_vs_tp_bytes():
    r = th.pp_vs_tp(layers=80, hidden=8192, seq_len=4096, batch=8, degree=8, bandwidth=50e9)
    activation = 8 * 4096 * 8192 * 2
    # PP: what a middle stage sends, the same count the lab's ledger checks
    assert (
        r["pp_bytes_per_rank"]
        == 2 * activation
        == th.p2p_bytes_per_rank("1f1b", 4, 1, batch=8, seq_len=4096, hidden=8192, itemsize=2)
    )
    # TP: 4 ring all-reduces of [B, T, H] per layer (2 forward, 2 backward), 2(N-1)/N each
    assert r["tp_bytes_per_rank"] == 80 * 4 * 2 * 7 / 8 * activation
    assert r["tp_over_pp"] == pytest.approx(280)
    assert r["tp_seconds"] == pytest.approx(r["tp_bytes_per_rank"] / 50e9)
    with pytest.raises(ValueError, match="degree must be an integer >= 1"):
        th.pp_vs_tp(layers=80, hidden=8192, seq_len=4096, batch=8, degree=0)


# ---------------------------------------------------------------- zero bubble (ZB-H1), DualPipe

ZB_CASES = [(p, m) for p in (2, 3, 4, 8) for m in (p, p + 1, 2 * p, 4 * p, 32) if m >= p]


@pytest.mark.parametrize("t_b", [1.0, 1.5, 2.0])
def test_zero_bubble_h1_formula_equals_its_schedule_run_on_paper(t_b):
    """Idle time (P-1)(t_f + t_b - 2 t_w) per rank, W = t_b / 2 (no longer than F or B): the
    schedule's own order of operations gives it; with F = B = W it is (P-1)/(3M+P-1)."""
    for p, m in ZB_CASES:
        sim = th.simulate("zb-h1", p, m, t_f=1.0, t_b=t_b)
        step = th.step_time("zb-h1", p, m, 1.0, t_b)
        assert sim["makespan"] == pytest.approx(step), (p, m)
        assert step == pytest.approx(m * (1 + t_b) + (p - 1) * (1 + t_b - t_b))  # 2 t_w = t_b
        assert sim["in_flight"] == [p] * p  # held until each W: min(P, M) on every stage
        if t_b == 2.0:  # F = B = W
            assert sim["bubble_fraction"] == pytest.approx(th.bubble_fraction("zb-h1", p, m))
            assert th.bubble_fraction("zb-h1", p, m) == (p - 1) / (3 * m + p - 1)
        # a third of 1F1B's idle time, with F = B = W
        assert sim["bubble_fraction"] < th.bubble_fraction("1f1b", p, m)


def test_zero_bubble_h1_runs_every_op_once_each_w_after_its_b():
    for p, m in ZB_CASES:
        for r, ops in enumerate(th.schedule_ops("zb-h1", p, m)):
            assert Counter(name for name, *_ in ops) == {"F": m, "B": m, "W": m}
            for i, (name, mb, _) in enumerate(ops):
                if name == "W":
                    assert ("B", mb, 0) in ops[:i]
            # rank r keeps its r latest W's back: they come last
            assert [n for n, *_ in ops[len(ops) - r :]] == ["W"] * r


def test_zero_bubble_cli_and_bad_input():
    r = run_json(
        "-m",
        "labs.theory",
        "bubble",
        "--schedule",
        "zb-h1",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--json",
    )
    assert r["bubble_fraction"] == pytest.approx(3 / 27) == r["simulated_bubble_fraction"]
    assert r["in_flight_microbatches"] == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="zb-h1 needs at least as many micro-batches as stages"):
        th.bubble_fraction("zb-h1", 4, 3)
    with pytest.raises(ValueError, match=r"t_w=5 needs schedule in \('zb-h1', 'dualpipev'\)"):
        th.simulate("1f1b", 4, 8, t_w=5)


def test_dualpipe_is_the_deepseek_v3_table():
    """(P/2-1)(F&B + B - 3W) beside 1F1B's (P-1)(F+B) and ZB1P's (P-1)(F+B-2W) (DeepSeek-V3,
    Table 2); with nothing overlapped F&B = F + B."""
    p, f, b, w = 8, 1.0, 2.0, 1.0
    assert th.dualpipe_bubble_time(p, f, b, w) == (8 / 2 - 1) * ((f + b) + b - 3 * w)
    assert th.dualpipe_bubble_time(p, f, b, w, t_fb=2.4) == 3 * (2.4 + 2.0 - 3.0)
    one_f_one_b = th.step_time("1f1b", p, 16, f, b) - 16 * (f + b)
    zb1p = th.step_time("zb-h1", p, 16, f, b, t_w=w) - 16 * (f + b)
    assert one_f_one_b == (p - 1) * (f + b) and zb1p == (p - 1) * (f + b - 2 * w)
    assert th.dualpipe_bubble_time(p, f, b, w) < zb1p < one_f_one_b
    with pytest.raises(ValueError, match="DualPipe needs an even number of stages"):
        th.dualpipe_bubble_time(3, f, b, w)


def test_bubble_calculator_draws_zero_bubble_weight_gradients():
    from labs.widgets.pipeline import draw_schedule

    fig, r = draw_schedule("zb-h1", 4, 8)
    gantt = fig.axes[0]
    assert len([b for b in gantt.patches if b.get_hatch() == ".."]) == 4 * 8  # one W each
    assert r["bubble_fraction"] == pytest.approx(3 / 27)


# ---------------------------------------------------------------- ZB-H1 and DualPipeV vs torch
def torch_order(cls_name: str, stages: int, microbatches: int, rank: int, chunks: int) -> list:
    """The compute actions torch's schedule ``cls_name`` plans for ``rank``, in our vocabulary:
    (name, micro-batch, chunk), an overlapped forward-backward pair as its two operations. Read
    off the schedule's planning method without building stages (white box: torch 2.13)."""
    import torch.distributed.pipelining.schedules as ts

    names = {
        ts._ComputationType.FORWARD: "F",
        ts._ComputationType.BACKWARD_INPUT: "B",
        ts._ComputationType.BACKWARD_WEIGHT: "W",
        ts._ComputationType.FULL_BACKWARD: "BW",
    }
    schedule = object.__new__(getattr(ts, cls_name))
    schedule.pp_group_size = stages
    schedule._n_microbatches = microbatches
    schedule.n_local_stages = chunks
    schedule.number_of_rounds = max(1, microbatches // stages)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    out = []
    for action in schedule._calculate_single_rank_operations(rank):
        for a in (action.sub_actions or (action,)) if action is not None else ():
            out.append((names[a.computation_type], a.microbatch_index, int(a.stage_index != rank)))
    return out


def test_zero_bubble_h1_is_torchs_zero_bubble_with_one_stage_per_rank():
    for p, m in ZB_CASES:
        for r, ops in enumerate(th.schedule_ops("zb-h1", p, m)):
            assert ops == torch_order("ScheduleInterleavedZeroBubble", p, m, r, 1), (p, m, r)


DUALPIPE_CASES = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p, 32)]


def test_dualpipev_order_is_torchs_schedule_dualpipev():
    for p, m in DUALPIPE_CASES:
        for r, ops in enumerate(th.schedule_ops("dualpipev", p, m, 2)):
            assert ops == torch_order("ScheduleDualPipeV", p, m, r, 2), (p, m, r)


def test_dualpipev_runs_every_op_once_in_a_v():
    for p, m in DUALPIPE_CASES:
        assert [th.virtual_stage("dualpipev", p, r, c) for c in (0, 1) for r in range(p)] == [
            *range(p),
            *reversed(range(p, 2 * p)),
        ]
        assert all(th.stage_rank("dualpipev", p, s) == min(s, 2 * p - 1 - s) for s in range(2 * p))
        for ops in th.schedule_ops("dualpipev", p, m, 2):
            for chunk in (0, 1):
                mine = [(n, mb) for n, mb, c in ops if c == chunk]
                assert [mb for n, mb in mine if n == "F"] == list(range(m))  # in order
                assert sorted(mb for n, mb in mine if n in ("B", "BW")) == list(range(m))
                split = {mb for n, mb in mine if n == "B"}
                assert {mb for n, mb in mine if n == "W"} == split  # each split one gets its W
                for i, (name, mb, c) in enumerate(ops):
                    if name == "W":
                        assert ("B", mb, c) in ops[:i]


@pytest.mark.parametrize("t_b", [1.0, 1.5, 2.0])
def test_dualpipev_bubble_is_zero_bubbles_run_on_paper(t_b):
    """DeepSeek's DualPipeV order with each forward-and-backward pair run as one operation (both
    inputs first, both outputs after, as DeepSeek's ``_forward_backward_chunk`` and torch's
    runtime do), W = t_b / 2: a rank idles (P-1) t_f, ZB-H1's idle time; with F = B = W that is
    (P-1)/(3M+P-1) of the step, DeepSeek's own table's (PP/2-1)(F&B+B-3W) with PP = 2P stages and
    F&B = F + B; every rank holds 2P+1 chunk micro-batches (DeepSeek's PP+1)."""
    for p, m in DUALPIPE_CASES:
        sim = th.simulate("dualpipev", p, m, 2, t_f=1.0, t_b=t_b)
        step = th.step_time("dualpipev", p, m, 1.0, t_b, virtual=2)
        assert sim["makespan"] == pytest.approx(step) == m * (1 + t_b) + (p - 1), (p, m)
        assert th.idle_time("dualpipev", p, 1.0, t_b, virtual=2) == th.idle_time("zb-h1", p, 1, t_b)
        assert sim["in_flight"] == [2 * p + 1] * p
        if t_b == 2.0:
            assert sim["bubble_fraction"] == pytest.approx(th.bubble_fraction("dualpipev", p, m, 2))
            assert th.bubble_fraction("dualpipev", p, m, 2) == (p - 1) / (3 * m + p - 1)
            # DeepSeek's table in a chunk's times (F = 1/2, B = 1, W = 1/2, F&B = F + B)
            deepseek = th.dualpipe_bubble_time(2 * p, 0.5, 1.0, 0.5)
            assert th.idle_time("dualpipev", p, 1.0, t_b, virtual=2) == deepseek


def test_dualpipev_pairs_wait_for_both_inputs():
    """The pairs are DeepSeek's: in phases 4 and 5 every forward runs with a full backward of the
    other chunk, except the last rank's first one. Run as two independent operations instead,
    the same order idles half as long, a bubble of (P-1)/(6M+P-1): the figure the course taught
    before, which no implementation reaches (notebook 05 measured 0.128 at P = 4, M = 8)."""
    p, m = 4, 8
    pairs = th.paired_operations("dualpipev", p, m, 2)
    for r, ops in enumerate(th.schedule_ops("dualpipev", p, m, 2)):
        assert all(ops[i][0] == "F" and ops[i + 1][0] == "BW" for i in pairs[r])
        assert len(pairs[r]) == 2 * (m - 2 * p + r + 1) + (p - r - 1) - (r == p - 1)
    assert th.paired_operations("zb-h1", p, m) == [frozenset()] * p
    assert th.simulate("dualpipev", p, m, 2)["bubble_fraction"] == pytest.approx(3 / 27)
    unpaired = th.simulate("dualpipev", p, m, 2, paired=False)
    assert unpaired["bubble_fraction"] == pytest.approx(3 / 51)
    assert unpaired["makespan"] == m * 3 + (p - 1) / 2


def test_dualpipev_bytes_and_held():
    kw = dict(batch=8, seq_len=4, hidden=2, itemsize=4)
    per = 8 * 4 * 2 * 4
    # rank 0: chunk 0 sends on, chunk 1 (the last stage) sends a gradient back; middle ranks
    # both ways for both chunks; rank P-1 hands its two stages' tensors over in memory
    assert [th.p2p_bytes_per_rank("dualpipev", 4, r, virtual=2, **kw) for r in range(4)] == [
        2 * per,
        4 * per,
        4 * per,
        2 * per,
    ]
    assert th.in_flight_microbatches("dualpipev", 4, 8, 0, 2) == 9


def test_split_schedules_cli_general_times_and_bad_input():
    # ZB-H1 for given F, B and W: idle (P-1)(t_f + t_b - 2 t_w), the schedule agrees
    r = th.figures("zb-h1", 4, 8, t_f=1.0, t_b=2.0, t_w=0.5)
    assert r["step_time"] == 8 * 3 + 3 * (1 + 2 - 1) == pytest.approx(r["simulated_step_time"])
    assert r["bubble_fraction"] == pytest.approx(1 - 24 / 30) and r["t_weight"] == 0.5
    r = run_json(
        "-m",
        "labs.theory",
        "bubble",
        "--schedule",
        "dualpipev",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--json",
    )
    assert r["virtual"] == 2 and r["in_flight_microbatches"] == [9, 9, 9, 9]
    assert r["bubble_fraction"] == pytest.approx(3 / 27) == r["simulated_bubble_fraction"]
    out = run_cli(
        "-m", "labs.theory", "bubble", "--schedule", "zb-h1", "--stages", "4",
        "--microbatches", "8", "--t-weight", "0.5",
    ).stdout  # fmt: skip
    assert "t_w=0.5" in out and "0.2000" in out
    with pytest.raises(ValueError, match="use microbatches >= 8"):
        th.bubble_fraction("dualpipev", 4, 6, 2)
    with pytest.raises(ValueError, match="dualpipev holds 2 chunks per rank; use virtual=2"):
        th.schedule_ops("dualpipev", 4, 8)
    with pytest.raises(ValueError, match="closed form for t_w = t_b/2 only"):
        th.step_time("dualpipev", 4, 8, 1.0, 2.0, virtual=2, t_w=0.5)


def test_bubble_calculator_draws_dualpipev():
    from labs.widgets.pipeline import draw_schedule

    fig, r = draw_schedule("dualpipev", 4, 8)
    ops = [op for rank in th.schedule_ops("dualpipev", 4, 8, 2) for op in rank]
    hatches = [b.get_hatch() for b in fig.axes[0].patches]
    assert hatches.count("xx") == sum(name == "BW" for name, *_ in ops)
    assert hatches.count("..") == sum(name == "W" for name, *_ in ops) > 0
    assert r["bubble_fraction"] == pytest.approx(3 / 27)
