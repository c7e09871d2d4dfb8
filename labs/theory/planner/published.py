"""Published training runs, and what the course's calculators say about them (notebook 08,
the README). Pure Python.

    compare_published()                    # one row per run: fits?, MFU ours vs reported, gap
    print(format_published(compare_published()))
    python -m labs.theory plan --preset llama3-405b --seq 8192 --gpus 16384 --global-batch 2048 \\
        --recompute selective --layout tp=8,pp=16,cp=1,dp=128,zero=1,v=2

Each run is what its source reports, nothing more; what the source leaves out (the schedule's
chunk count, the recomputation, the ZeRO flavour, a model's exact dimensions) is listed in
``assumed`` and is ours. The reported figures:

* Llama 3 405B pre-training (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 4;
  the same figures on P. Balaji's SC'24 slide "Herding Llamas"): H100s in nodes of 8, 16M
  tokens per batch; 8,192 GPUs with TP 8, CP 1, PP 16 (DP 64) at 8K tokens: 430 TFLOP/s per
  GPU; 16,384 GPUs with TP 8, CP 1, PP 16 (DP 128) at 8K: 400; 16,384 GPUs with TP 8, CP 16,
  PP 16 (DP 8) at 128K: 380. DP follows from the others. Secondary sources confirm the paper's
  BF16 MFU only as "38-43%"; we compare TFLOP/s per GPU and derive the reported MFU as
  TFLOP/s / 989 (the H100 SXM dense bf16 peak).
* The Ultra-Scale Playbook's benchmarks (Tazi et al. 2025, "Finding the best training
  configuration": its heatmap of the best configuration per model size and node count, 8xH100
  nodes, sequence 4,096, global batch 1M tokens = 256 sequences; the data behind the chart,
  ``assets/data/benchmarks/benchmarks_interactive.html`` of the nanotron/ultrascale-playbook
  Space): the "8B" model's best run on 1 node, DP 2, TP 1, PP 4, micro-batch 1, 128 gradient
  accumulation steps, ZeRO-1: MFU 45.2%, 7,503 tokens/s per GPU, "GPU memory: 63.1 GB"; on 8
  nodes, DP 32, TP 1, PP 2, micro-batch 1, 8 steps, ZeRO-1: MFU 39.5%, 6,555 tokens/s per GPU,
  59.1 GB. The chart names the model "8B" only; we assume Llama-3 8B's dimensions, and the
  playbook's MFU counts FLOPs its own way, so we also convert its tokens/s with ours.

``compare_published`` evaluates each published layout with the planner's cost model
(``labs.theory.planner.evaluate_layout``), with the least recomputation under which our memory
calculator fits it, and asks the planner for its own pick on the same model, cluster and batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labs.theory.flops import flops_per_token
from labs.theory.memory import GIB
from labs.theory.planner.search import evaluate_layout, plan
from labs.theory.presets import GPUS, preset

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class PublishedRun:
    """One published configuration: the layout and figures its source reports, and what we
    assume where it says nothing."""

    name: str
    source: str
    model: str  # a preset of labs.theory.presets
    seq: int
    gpus: int
    layout: str  # as ``labs.theory.planner.parse_layout`` reads it
    global_batch: int  # sequences per step
    reported: dict  # tflops_per_gpu, or mfu / tokens_per_s_per_gpu / memory_gb, as published
    assumed: dict = field(default_factory=dict)  # planner keywords and layout parts we chose
    gpus_per_node: int = 8
    gpu: str = "H100 80GB"


LLAMA3 = "Llama 3 paper, Table 4 (Grattafiori et al. 2024)"
PLAYBOOK = "Ultra-Scale Playbook benchmarks (nanotron, 2025)"
LLAMA3_ASSUMED = {"layout": "zero=1,v=2", "why": "interleaved 1F1B, V=2 assumed; ZeRO-1 for FSDP"}
PLAYBOOK_ASSUMED = {"layout": "schedule=1f1b", "why": "1F1B assumed; Llama-3 8B dimensions"}

PUBLISHED = (
    PublishedRun(
        name="llama3-405b 8K, 8,192 GPUs",
        source=LLAMA3,
        model="llama3-405b",
        seq=8192,
        gpus=8192,
        layout="tp=8,cp=1,pp=16,dp=64",
        global_batch=2048,  # 16M tokens
        reported={"tflops_per_gpu": 430},
        assumed=LLAMA3_ASSUMED,
    ),
    PublishedRun(
        name="llama3-405b 8K, 16,384 GPUs",
        source=LLAMA3,
        model="llama3-405b",
        seq=8192,
        gpus=16384,
        layout="tp=8,cp=1,pp=16,dp=128",
        global_batch=2048,
        reported={"tflops_per_gpu": 400},
        assumed=LLAMA3_ASSUMED,
    ),
    PublishedRun(
        name="llama3-405b 128K, 16,384 GPUs",
        source=LLAMA3,
        model="llama3-405b",
        seq=131072,
        gpus=16384,
        layout="tp=8,cp=16,pp=16,dp=8",
        global_batch=128,
        reported={"tflops_per_gpu": 380},
        assumed=LLAMA3_ASSUMED,
    ),
    PublishedRun(
        name="playbook 8B, 1 node",
        source=PLAYBOOK,
        model="llama3-8b",
        seq=4096,
        gpus=8,
        layout="tp=1,cp=1,pp=4,dp=2,zero=1,mbs=1",
        global_batch=256,  # 1M tokens
        reported={"mfu": 0.452, "tokens_per_s_per_gpu": 7503, "memory_gb": 63.1},
        assumed=PLAYBOOK_ASSUMED,
    ),
    PublishedRun(
        name="playbook 8B, 8 nodes",
        source=PLAYBOOK,
        model="llama3-8b",
        seq=4096,
        gpus=64,
        layout="tp=1,cp=1,pp=2,dp=32,zero=1,mbs=1",
        global_batch=256,
        reported={"mfu": 0.395, "tokens_per_s_per_gpu": 6555, "memory_gb": 59.1},
        assumed=PLAYBOOK_ASSUMED,
    ),
)


def _cluster(run: PublishedRun) -> dict:
    gpu = GPUS[run.gpu]
    return dict(
        seq=run.seq,
        gpus=run.gpus,
        gpus_per_node=run.gpus_per_node,
        gpu_mem_gib=gpu.memory_gib,
        peak_tflops=gpu.peak_tflops,
        global_batch=run.global_batch,
    )


def evaluate_run(run: PublishedRun, recompute: str = "none") -> dict:
    """The planner's figures for the published layout (with our assumptions), under
    ``recompute``."""
    layout = ",".join(filter(None, (run.layout, run.assumed.get("layout", ""))))
    return evaluate_layout(preset(run.model), layout, recompute=recompute, **_cluster(run))


def reported_mfu(run: PublishedRun) -> float:
    """The run's MFU as published, or derived from its TFLOP/s per GPU and the GPU's peak."""
    if "mfu" in run.reported:
        return run.reported["mfu"]
    return run.reported["tflops_per_gpu"] / GPUS[run.gpu].peak_tflops


def compare(run: PublishedRun, *, with_plan: bool = True) -> dict:
    """One run against the calculators: ``fits`` (under no recomputation), ``recompute`` (the
    least that fits, None if none does), our ``memory_gib``, ``step_time_s``, ``mfu`` and
    ``tflops_per_gpu`` under it, the reported ``reported_mfu`` (and ``reported_tflops``,
    ``reported_tokens_per_s_per_gpu`` where published), ``mfu_ratio`` (ours / reported),
    ``tokens_ratio`` (where tokens/s are published), and with ``with_plan`` the planner's pick
    for the same model, cluster and batch (``plan_name``, ``plan_step_time_s``, ``plan_mfu``)."""
    results = {rc: evaluate_run(run, rc) for rc in RECOMPUTE_ORDER}
    fitting = [rc for rc in RECOMPUTE_ORDER if results[rc]["fits"]]
    chosen = fitting[0] if fitting else "full"
    r = results[chosen]
    peak = GPUS[run.gpu].peak_tflops
    out = {
        "name": run.name,
        "source": run.source,
        "layout": run.layout,
        "assumed": run.assumed.get("why", ""),
        "fits": results["none"]["fits"],
        "recompute": fitting[0] if fitting else None,
        "memory_gib": r["memory"]["total_bytes"] / GIB,
        "memory_gib_no_recompute": results["none"]["memory"]["total_bytes"] / GIB,
        "schedule": r["schedule"],
        "virtual": r["virtual"],
        "step_time_s": r["step_time_s"],
        "mfu": r["mfu"],
        "tflops_per_gpu": r["mfu"] * peak,
        "tokens_per_s_per_gpu": r["tokens_per_s"] / run.gpus,
        "reported_mfu": reported_mfu(run),
        "reported": dict(run.reported),
    }
    out["mfu_ratio"] = out["mfu"] / out["reported_mfu"]
    if "tokens_per_s_per_gpu" in run.reported:
        reported = run.reported["tokens_per_s_per_gpu"]
        out["tokens_ratio"] = out["tokens_per_s_per_gpu"] / reported
        # the published throughput with our FLOP count
        flops = flops_per_token(preset(run.model), seq=run.seq)
        out["reported_mfu_our_flops"] = reported * flops / (peak * 1e12)
    if with_plan:
        p = plan(preset(run.model), recompute=chosen, **_cluster(run))
        out.update(
            plan_name=p["top"][0]["name"],
            plan_step_time_s=p["step_time_s"],
            plan_mfu=p["mfu"],
            plan_explanation=p["explanation"],
        )
    return out


def compare_published(*, with_plan: bool = True) -> list[dict]:
    """``compare`` for every run of ``PUBLISHED``."""
    return [compare(run, with_plan=with_plan) for run in PUBLISHED]


def format_published(rows: list[dict]) -> str:
    """The comparison as a table: the published layout, whether our calculator fits it (and
    with which recomputation), our MFU beside the reported one, and the planner's own pick."""
    lines = [
        f"{'run':<30}{'fits (ours)':<30}{'MFU ours':>9}{'reported':>10}{'ours/rep':>9}"
        f"  planner's pick (its MFU)",
    ]
    for r in rows:
        if r["fits"]:
            fit = f"yes, {r['memory_gib']:.0f} GiB"
        elif r["recompute"]:
            fit = f"{r['recompute']} recompute, {r['memory_gib']:.0f} GiB"
        else:
            fit = f"no ({r['memory_gib']:.0f} GiB)"
        pick = f"{r['plan_name']} ({r['plan_mfu']:.0%})" if "plan_name" in r else ""
        lines.append(
            f"{r['name']:<30}{fit:<30}{r['mfu']:>9.1%}{r['reported_mfu']:>10.1%}"
            f"{r['mfu_ratio']:>9.2f}  {pick}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The calculators against the published references they reproduce.


def reference_checks() -> list[dict]:
    """One row per published figure the calculators reproduce: ``reference`` (source and what),
    ``published`` (as printed, in the source's unit), ``ours`` (ours, rounded the way the source
    rounds) and ``unit``. Decimal GB only where the source uses them."""
    from labs.theory.comm import all_reduce_bytes
    from labs.theory.memory import param_count, state_bytes
    from labs.theory.moe import MIXTRAL_8X7B, moe_param_counts
    from labs.theory.pipeline import bubble_fraction

    rows = []

    def row(reference: str, published: float, ours: float, unit: str) -> None:
        rows.append({"reference": reference, "published": published, "ours": ours, "unit": unit})

    # The Ultra-Scale Playbook, "Memory usage in Transformers": weights + gradients + Adam
    # states, in decimal GB
    for billions in (1, 7, 70, 405):
        n = billions * 10**9
        plain = state_bytes(n, precision="bf16-mixed")["total_bytes"] / 1e9
        accum = state_bytes(n, precision="bf16-mixed", fp32_grad_accum=True)["total_bytes"] / 1e9
        row(f"Playbook memory table, {billions}B, bf16 + fp32 master", 16 * billions, plain, "GB")
        row(f"Playbook memory table, {billions}B, + fp32 grad accum", 20 * billions, accum, "GB")
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, 64 ranks, K = 12, decimal GB
    n = 7_500_000_000
    for stage, published in zip(range(4), (120, 31.4, 16.6, 1.9)):
        total = state_bytes(n, precision="bf16-mixed", zero=stage, dp=64)["total_bytes"] / 1e9
        row(f"ZeRO paper, Fig. 1, stage {stage} (7.5B, 64 GPUs)", published, round(total, 1), "GB")
    # parameter counts (transformers' models, built from the published configs, in the tests)
    for name, published, digits in (
        ("llama3-8b", 8.03, 2),
        ("llama3-70b", 70.6, 1),
        ("llama3-405b", 405.9, 1),
    ):
        ours = round(param_count(preset(name)) / 1e9, digits)
        row(f"{name} parameters (transformers, published config)", published, ours, "B")
    mixtral = moe_param_counts(MIXTRAL_8X7B)
    row("Mixtral 8x7B parameters (Jiang et al. 2024)", 46.7, round(mixtral["total"] / 1e9, 1), "B")
    row("Mixtral 8x7B active per token", 12.9, round(mixtral["active"] / 1e9, 1), "B")
    # bubbles (Playbook; Narayanan et al. 2021; Qi et al. 2024) at P = 4, M = 8
    row("1F1B bubble (P-1)/(M+P-1), P=4 M=8", 3 / 11, bubble_fraction("1f1b", 4, 8), "")
    row("interleaved (P-1)/(VM+P-1), V=2", 3 / 19, bubble_fraction("interleaved", 4, 8, 2), "")
    row("ZB-H1 (P-1)/(3M+P-1), F=B=W", 3 / 27, bubble_fraction("zb-h1", 4, 8), "")
    # ring all-reduce (Playbook appendix A0): 2(N-1)/N·K per rank
    row("ring all-reduce bytes per rank, N=8, K=1", 2 * 7 / 8, all_reduce_bytes(1.0, 8), "K")
    return rows


def format_references(rows: list[dict]) -> str:
    """``reference_checks`` as a table."""
    lines = [f"{'reference':<52}{'published':>11}{'ours':>11}  unit"]
    for r in rows:
        lines.append(f"{r['reference']:<52}{r['published']:>11.4g}{r['ours']:>11.4g}  {r['unit']}")
    return "\n".join(lines)
