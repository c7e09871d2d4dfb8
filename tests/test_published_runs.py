"""The planner and the calculators against published training runs (labs.theory.planner.published):
the Llama 3 paper's Table 4, Narayanan et al. 2021's Table 2 (ZeRO-3 against PTD-P), Korthikanti
et al. 2022's Table 5 and the Ultra-Scale Playbook's 8B benchmark runs. ``published_table`` holds
each published figure beside ours with the tolerance asserted here, or the gap it documents; the
README's table "Against published runs" prints the same rows. Theory only: not marked
exercise."""

import pytest

from labs.theory import cli
from labs.theory.memory import memory_per_rank
from labs.theory.planner.published import (
    KORTHIKANTI,
    LLAMA3,
    NARAYANAN,
    PLAYBOOK,
    PUBLISHED,
    compare,
    evaluate_run,
    format_published,
    format_table,
    model,
    published_table,
)
from labs.theory.presets import GPUS

RUNS = {run.name: run for run in PUBLISHED}
GPU_COUNTS = (384, 768, 1536)


@pytest.fixture(scope="module")
def rows():
    return {run.name: compare(run) for run in PUBLISHED}


@pytest.fixture(scope="module")
def table(rows):
    return published_table(list(rows.values()))


def test_the_published_figures_are_consistent():
    """Each layout multiplies out to its GPU count (Llama 3's third row with DP 8, where the July
    2024 text prints 4: 8·16·16·4 = 8,192, not 16,384); 16M tokens per Llama 3 batch (2^24), 1M
    per Playbook batch (2^20), GPT-3's 1,536 sequences in Narayanan et al.'s comparison."""
    for run in PUBLISHED:
        layout = dict(part.split("=") for part in run.layout.split(","))
        product = 1
        for axis in ("dp", "tp", "pp", "cp"):
            product *= int(layout[axis])
        assert product == run.gpus, run.name
        tokens = run.global_batch * run.seq
        if run.source == LLAMA3:
            assert tokens == 2**24 and run.recompute == "none", run.name
        if run.source == PLAYBOOK:
            assert tokens == 2**20, run.name
        if run.source == NARAYANAN:
            assert run.global_batch == 1536 and run.recompute == "full" and run.gpu == "A100 80GB"
    third = RUNS["llama3-405b 128K, 16,384 GPUs"]
    assert "dp=8" in third.layout and 8 * 16 * 16 * 4 == 8192 != third.gpus
    assert [RUNS[n].reported["mfu"] for n in list(RUNS)[:3]] == [0.43, 0.41, 0.38]


def test_every_figure_with_a_tolerance_is_within_it(table):
    """The table's rows, each against its source within the stated tolerance."""
    checked = [r for r in table if r["tolerance"] is not None]
    assert len(checked) == 27  # 3 Llama 3, 9 Narayanan, 9 Korthikanti, 6 Playbook
    off = [
        f"{r['source']}, {r['figure']}: published {r['published']:.4g}, ours {r['ours']:.4g},"
        f" tolerance {r['tolerance']:.0%}"
        for r in checked
        if abs(r["ours"] / r["published"] - 1) > r["tolerance"]
    ]
    assert not off, "\n".join(off)
    assert {r["source"] for r in checked} >= {LLAMA3, NARAYANAN, KORTHIKANTI, PLAYBOOK}


def test_llama3_ran_without_recomputation_which_our_memory_model_cannot_fit(rows, table):
    """Llama 3 paper §3.3.2: "we could pre-train Llama 3 on sequences of 8K tokens without
    activation checkpointing". So we time the runs as run, with no recomputation: our MFU lands
    within 15 % of Table 4's 43 / 41 / 38 %. Our memory calculator counts the course's unfused
    implementation (every tensor autograd keeps, fp32 norms) and finds 119-162 GiB per GPU: the
    gap is ours, stated in the table, not a recomputation Meta did."""
    for name in list(RUNS)[:3]:
        r = rows[name]
        assert r["recompute"] == "none" and not r["fits"] and r["fits_with"] == "full", name
        assert r["memory_gib"] > GPUS["H100 80GB"].memory_gib
    gaps = [r for r in table if r["source"] == LLAMA3 and r["tolerance"] is None]
    assert len(gaps) == 3 and all("unfused" in r["note"] for r in gaps)


def test_zero3_stops_scaling_where_ptdp_does_not(rows):
    """Narayanan et al. 2021, Table 2: ZeRO-3 without model parallelism reaches 144 / 88 / 44
    TFLOP/s per GPU on 384 / 768 / 1,536 A100s, PTD-P (TP 8, PP 12) 153 / 149 / 141, because
    ZeRO-3's per-GPU traffic does not shrink as DP grows. The planner orders the two layouts as
    the paper does at every size, its ZeRO-3 falls with the GPU count as the paper's, and its
    PTD-P holds."""
    zero3 = [rows[f"gpt3-175b ZeRO-3, {g:,} GPUs"] for g in GPU_COUNTS]
    ptdp = [rows[f"gpt3-175b PTD-P, {g:,} GPUs"] for g in GPU_COUNTS]
    for z, p in zip(zero3, ptdp):
        assert p["step_time_s"] < z["step_time_s"], (z["name"], p["name"])
        assert z["fits"] and p["fits"]
    tflops = [z["tflops_per_gpu"] for z in zero3]
    assert tflops[0] > tflops[1] > tflops[2] and tflops[0] / tflops[2] > 2.5  # paper: 3.3
    held = [p["tflops_per_gpu"] for p in ptdp]
    assert max(held) / min(held) < 1.15  # paper: 153 / 141 = 1.09
    ratios = [z["step_time_s"] / p["step_time_s"] for z, p in zip(zero3, ptdp)]
    assert ratios == sorted(ratios)  # ZeRO-3 falls further behind as the machine grows


def test_the_playbook_runs_fit_with_nanotrons_fp32_gradients(rows):
    """The Playbook's 8B runs report "63.1 GB" and "59.1 GB"; Nanotron, which ran them, keeps fp32
    gradients (4 more bytes per parameter, the Playbook's note): with them we land within 8 % and
    2 % in GB (10^9 bytes), where without them we are 22-26 % under."""
    for name in ("playbook 8B, 1 node", "playbook 8B, 8 nodes"):
        run = RUNS[name]
        r = rows[name]
        assert r["fits"] and run.assumed["kw"] == {"fp32_grad_accum": True}
        assert abs(r["memory_ratio"] - 1) < 0.085
        layout = dict(part.split("=") for part in run.layout.split(","))
        dp, pp = int(layout["dp"]), int(layout["pp"])
        without = memory_per_rank(
            model(run.model),
            seq=run.seq,
            mbs=1,
            precision="bf16-mixed",
            zero=1,
            dp=dp,
            pp=pp,
            microbatches=run.global_batch // dp,
        )["total_bytes"]
        assert 0.21 < 1 - without / 1e9 / run.reported["memory_gb"] < 0.27, name


@pytest.mark.parametrize("name", list(RUNS))
def test_the_planner_finds_the_published_layout_or_a_faster_one(rows, name):
    """The search tries every published layout (with our assumed schedule and ZeRO stage) among its
    candidates, under the run's recomputation, so its pick is at least as fast."""
    r = rows[name]
    assert r["plan_step_time_s"] <= r["step_time_s"] * (1 + 1e-9), name


def test_layout_on_the_command_line_reproduces_a_published_run(rows):
    """Llama 3 paper, Table 4, 16,384 GPUs at 8K, as run: the CLI's --layout gives the same
    figures as ``evaluate_run``."""
    run = RUNS["llama3-405b 8K, 16,384 GPUs"]
    out = cli.run(
        ["plan", "--preset", run.model, "--seq", str(run.seq), "--gpus", str(run.gpus),
         "--global-batch", str(run.global_batch), "--fp32-grad-accum",
         "--layout", run.layout + ",zero=1,v=2"]
    )  # fmt: skip
    direct = evaluate_run(run)
    assert out["step_time_s"] == pytest.approx(direct["step_time_s"])
    assert out["mfu"] == pytest.approx(rows[run.name]["mfu"]) and not out["fits"]
    assert out["verdict"].startswith("does not fit:")


def test_the_tables_print(rows, table):
    text = format_published(list(rows.values()))
    assert all(name in text for name in RUNS) and "planner's pick" in text
    text = format_table(table)
    assert "Narayanan et al. 2021, Table 2" in text and "gap: ran in an H100's" in text
