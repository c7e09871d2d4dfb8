"""Published training runs against the planner's cost model and the course's calculators, and the
published formulas the calculators reproduce (notebook 08, the README, tests/test_published_runs.py
and tests/test_theory_references.py). Pure Python.

    print(format_table(published_table()))         # each published figure, ours, the tolerance
    print(format_published(compare_published()))   # each run: memory, MFU, the planner's pick
    python -m labs.theory plan --preset llama3-405b --seq 8192 --gpus 16384 --global-batch 2048 \\
        --fp32-grad-accum --layout tp=8,pp=16,cp=1,dp=128,zero=1,v=2

Each run is what its source reports, read there; what the source leaves out (a schedule's chunk
count, the ZeRO flavour, a batch size) is in ``assumed`` and is ours. The sources:

* Llama 3 405B (Grattafiori et al. 2024, "The Llama 3 Herd of Models", §3.3.2 and Table 4): H100s
  in nodes of 8, 16M tokens per batch. Table 4: 8,192 GPUs, TP 8, CP 1, PP 16, DP 64, 8K tokens:
  430 TFLOP/s per GPU, BF16 MFU 43 %; 16,384 GPUs, DP 128: 400, 41 %; 16,384 GPUs, CP 16, 131,072
  tokens: 380, 38 %. That third row prints DP 4 in the July 2024 text, which does not multiply out
  (8 x 16 x 16 x 4 = 8,192 GPUs, not 16,384; a later revision prints 8): we use DP 8. The text
  says "we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing",
  uses "FP32 gradient accumulation during backward computation over multiple micro-batches and
  also reduce-scatter gradients in FP32", an interleaved schedule (V not given) and an FSDP that
  "shards optimizer states and gradients" but does not reshard the weights after forward. We
  evaluate the runs as run: no recomputation (at 128K too, where the text says nothing), fp32
  gradients, V = 2, and ZeRO-1 for that FSDP (the whole weights and fp32 gradients through a step,
  the optimizer state sharded).
* Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", §5.2 and Table 2): GPT-3 175B (174.6B parameters), sequence 2,048, global batch
  1,536, on Selene's DGX A100 80GB nodes (8 GPUs on NVLink, eight 200 Gb/s HDR InfiniBand HCAs).
  ZeRO-3 without model parallelism: 144 / 88 / 44 TFLOP/s per GPU on 384 / 768 / 1,536 GPUs with
  micro-batches of 4 / 2 / 1; PTD-P with model-parallel size 96 (TP 8, PP 12) and micro-batch 1:
  153 / 149 / 141. Their FLOPs are eq. (3), 96·B·s·l·h²(1 + s/6h + V/16lh), which "assumes
  activation recomputation": we run both with full recomputation and count TFLOP/s their way. We
  assume 1F1B and Megatron's plain data parallelism (ZeRO-0) for PTD-P.
* Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
  Table 5's MFU and HFU, as NVIDIA's Megatron-LM README reprints them): GPT models of 22B, 175B,
  530B and 1T parameters with sequence parallelism and selective recomputation, data-parallel size
  one, A100 80GB: MFU 41.5 / 51.4 / 56.0 / 56.3 %, HFU 43.7 / 52.8 / 57.0 / 57.0 %. Their layouts
  (Table 3, as transcribed): 48 / 96 / 105 / 128 layers, hidden 6,144 / 12,288 / 20,480 / 25,600,
  64 / 96 / 128 / 160 heads, TP 8, PP 1 / 8 / 35 / 64 on 8 / 64 / 280 / 512 GPUs. Assumed: a
  global batch of 4 / 64 / 280 / 512 sequences (the batch for which Table 5's iteration times,
  1.10 / 13.75 / 37.83 / 71.49 s as transcribed, give its MFU), micro-batch 1, 1F1B. The paper
  puts selective recomputation's cost for GPT-3 at 2.7 % more FLOPs; ours is 0.9 %, the rerun
  attention core's forward against a whole step where theirs is against the forward pass, a
  third of it (``labs.theory.flops``); their HFU - MFU gaps show the same factor of three.
  Their Table 2 keeps 2sbh per layer under full recomputation; under sequence parallelism we keep
  2sbh/t, the layer's sequence-sharded input, as Megatron-LM does (``labs.theory.activations``).
* The Ultra-Scale Playbook's benchmarks (Tazi et al. 2025, "Finding the best training
  configuration": its heatmap of the best configuration per model size and node count, 8xH100
  nodes, sequence 4,096, global batch 1M tokens = 256 sequences; the data behind the chart,
  ``assets/data/benchmarks/benchmarks_interactive.html`` of the nanotron/ultrascale-playbook
  Space): the "8B" model's best run on 1 node, DP 2, TP 1, PP 4, micro-batch 1, 128 gradient
  accumulation steps, ZeRO-1: MFU 45.2%, 7,503 tokens/s per GPU, "GPU memory: 63.1 GB"; on 8
  nodes, DP 32, TP 1, PP 2, micro-batch 1, 8 steps, ZeRO-1: MFU 39.5%, 6,555 tokens/s per GPU,
  59.1 GB. The chart names the model "8B" only: we assume Llama-3 8B's dimensions. The Playbook
  (§ memory usage) says Nanotron, which ran them, stores gradients in fp32 besides bf16, 4 more
  bytes per parameter: we count them (``fp32_grad_accum``). We read its "GB" as 10^9 bytes and
  compare memory in GB.

``compare_published`` evaluates each published layout with the planner's cost model
(``labs.theory.planner.evaluate_layout``) under the recomputation the run used, says whether our
memory calculator fits it (and with which recomputation it would), and asks the planner for its
own pick on the same model, cluster and batch. ``published_table`` holds every published figure
beside ours with the tolerance the tests hold it to, or the gap it documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labs.theory.flops import flops_per_token
from labs.theory.memory import GIB
from labs.theory.model import ModelSpec
from labs.theory.planner.search import evaluate_layout, plan
from labs.theory.presets import GPUS, preset

RECOMPUTE_ORDER = ("none", "selective", "full")

# GPT models of the Megatron papers (Narayanan et al. 2021, Table 1; Korthikanti et al. 2022,
# Table 3): vocabulary 51,200, sequence 2,048, learned positions, tied head
_GPT = dict(arch="gpt", vocab_size=51200, tied_embeddings=True, max_positions=2048)
MODELS: dict[str, ModelSpec] = {
    "gpt-22b": ModelSpec(hidden=6144, n_layers=48, n_heads=64, **_GPT),
    "gpt3-175b": ModelSpec(hidden=12288, n_layers=96, n_heads=96, **_GPT),
    "gpt-530b": ModelSpec(hidden=20480, n_layers=105, n_heads=128, **_GPT),
    "gpt-1t": ModelSpec(hidden=25600, n_layers=128, n_heads=160, **_GPT),
}


def model(name: str) -> ModelSpec:
    """A model of ``MODELS`` or a preset of ``labs.theory.presets``."""
    return MODELS[name] if name in MODELS else preset(name)


@dataclass(frozen=True)
class PublishedRun:
    """One published configuration: the layout and figures its source reports, and what we
    assume where it says nothing."""

    name: str
    source: str
    model: str  # a key of MODELS or a preset of labs.theory.presets
    seq: int
    gpus: int
    layout: str  # as ``labs.theory.planner.parse_layout`` reads it
    global_batch: int  # sequences per step
    reported: dict  # mfu, hfu, tflops_per_gpu, tokens_per_s_per_gpu, memory_gb, as published
    recompute: str = "none"  # what the run did (or, where its source is silent, what we assume)
    assumed: dict = field(default_factory=dict)  # layout parts and planner keywords we chose
    gpus_per_node: int = 8
    gpu: str = "H100 80GB"
    tflops: str = "model"  # how the source counts TFLOP/s: "model" FLOPs or "megatron" eq. (3)


LLAMA3 = "Llama 3 paper, Table 4"
NARAYANAN = "Narayanan et al. 2021, Table 2"
KORTHIKANTI = "Korthikanti et al. 2022, Table 5"
PLAYBOOK = "Ultra-Scale Playbook benchmarks"
LLAMA3_ASSUMED = {
    "layout": "zero=1,v=2",
    "kw": {"fp32_grad_accum": True},
    "why": "interleaved V=2 and ZeRO-1 for its FSDP assumed; fp32 gradients as the paper says",
}
PLAYBOOK_ASSUMED = {
    "layout": "schedule=1f1b",
    "kw": {"fp32_grad_accum": True},
    "why": "1F1B and Llama-3 8B assumed; fp32 gradients as Nanotron keeps them",
}
PTDP_ASSUMED = {"layout": "zero=0,schedule=1f1b", "why": "1F1B and plain DP assumed"}
KORTHIKANTI_ASSUMED = {"layout": "zero=0,mbs=1,schedule=1f1b", "why": "batch, mbs 1, 1F1B assumed"}


def _llama3(gpus: int, cp: int, dp: int, seq: int, batch: int, tflops: int, mfu: float):
    return PublishedRun(
        name=f"llama3-405b {seq // 1024}K, {gpus:,} GPUs",
        source=LLAMA3,
        model="llama3-405b",
        seq=seq,
        gpus=gpus,
        layout=f"tp=8,cp={cp},pp=16,dp={dp}",
        global_batch=batch,  # 16M tokens
        reported={"tflops_per_gpu": tflops, "mfu": mfu},
        assumed=LLAMA3_ASSUMED,
    )


def _narayanan(gpus: int, zero3: bool, mbs: int, tflops: int) -> PublishedRun:
    layout = (
        f"dp={gpus},tp=1,pp=1,cp=1,zero=3,mbs={mbs}"
        if zero3
        else f"tp=8,pp=12,cp=1,dp={gpus // 96}"
    )
    return PublishedRun(
        name=f"gpt3-175b {'ZeRO-3' if zero3 else 'PTD-P'}, {gpus:,} GPUs",
        source=NARAYANAN,
        model="gpt3-175b",
        seq=2048,
        gpus=gpus,
        layout=layout if zero3 else layout + ",mbs=1",
        global_batch=1536,
        reported={"tflops_per_gpu": tflops},
        recompute="full",
        assumed={} if zero3 else PTDP_ASSUMED,
        gpu="A100 80GB",
        tflops="megatron",
    )


def _korthikanti(name: str, pp: int, gpus: int, batch: int, mfu: float, hfu: float):
    return PublishedRun(
        name=f"{name} TP8 PP{pp}, {gpus} GPUs",
        source=KORTHIKANTI,
        model=name,
        seq=2048,
        gpus=gpus,
        layout=f"tp=8,pp={pp},cp=1,dp=1",
        global_batch=batch,
        reported={"mfu": mfu, "hfu": hfu},
        recompute="selective",
        assumed=KORTHIKANTI_ASSUMED,
        gpu="A100 80GB",
    )


PUBLISHED = (
    _llama3(8192, 1, 64, 8192, 2048, 430, 0.43),
    _llama3(16384, 1, 128, 8192, 2048, 400, 0.41),
    _llama3(16384, 16, 8, 131072, 128, 380, 0.38),
    _narayanan(384, True, 4, 144),
    _narayanan(768, True, 2, 88),
    _narayanan(1536, True, 1, 44),
    _narayanan(384, False, 1, 153),
    _narayanan(768, False, 1, 149),
    _narayanan(1536, False, 1, 141),
    _korthikanti("gpt-22b", 1, 8, 4, 0.415, 0.437),
    _korthikanti("gpt3-175b", 8, 64, 64, 0.514, 0.528),
    _korthikanti("gpt-530b", 35, 280, 280, 0.560, 0.570),
    _korthikanti("gpt-1t", 64, 512, 512, 0.563, 0.570),
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


def cluster(run: PublishedRun) -> dict:
    """The planner's cluster keywords for ``run``: its GPU's memory, peak and links."""
    gpu = GPUS[run.gpu]
    return dict(
        seq=run.seq,
        gpus=run.gpus,
        gpus_per_node=run.gpus_per_node,
        gpu_mem_gib=gpu.memory_gib,
        peak_tflops=gpu.peak_tflops,
        intra_gbps=gpu.intra_gbps,
        inter_gbps=gpu.inter_gbps,
        global_batch=run.global_batch,
    )


def evaluate_run(run: PublishedRun, recompute: str | None = None) -> dict:
    """The planner's figures for the published layout (with our assumptions), under ``recompute``
    (default: the run's own)."""
    layout = ",".join(filter(None, (run.layout, run.assumed.get("layout", ""))))
    return evaluate_layout(
        model(run.model),
        layout,
        recompute=recompute or run.recompute,
        **run.assumed.get("kw", {}),
        **cluster(run),
    )


def megatron_flops(spec: ModelSpec, *, seq: int, batch: int) -> float:
    """FLOPs of a training step as Narayanan et al. 2021 count them, eq. (3): 96·B·s·l·h²·(1 + s/6h
    + V/16lh), the GEMMs of forward, backward and the forward that full recomputation repeats."""
    h, layers, v = spec.hidden, spec.n_layers, spec.vocab_size
    return 96 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + v / (16 * layers * h))


def compare(run: PublishedRun, *, with_plan: bool = True) -> dict:
    """One run against the calculators: ``recompute`` (the run's), our ``memory_gib`` (and
    ``memory_gb``) under it, ``fits``, ``fits_with`` (the least recomputation under which our
    calculator fits it, None if none), ``step_time_s``, ``mfu``, ``hfu`` (hardware FLOPs, with
    what recomputation reruns), ``tflops_per_gpu`` (counted as the source counts them),
    ``tokens_per_s_per_gpu``, ``reported`` and the ratios ours / reported (``mfu_ratio``,
    ``tflops_ratio``, ``tokens_ratio``, ``memory_ratio``); with ``with_plan`` the planner's pick
    for the same model, cluster, batch and recomputation (``plan_name``, ``plan_step_time_s``,
    ``plan_mfu``, ``plan_explanation``)."""
    spec = model(run.model)
    results = {rc: evaluate_run(run, rc) for rc in RECOMPUTE_ORDER}
    r = results[run.recompute]
    peak = GPUS[run.gpu].peak_tflops * 1e12
    tokens = run.global_batch * run.seq
    hardware = flops_per_token(spec, seq=run.seq, recompute=run.recompute) * tokens
    if run.tflops == "megatron":
        counted = megatron_flops(spec, seq=run.seq, batch=run.global_batch)
    else:
        counted = flops_per_token(spec, seq=run.seq) * tokens
    out = {
        "name": run.name,
        "source": run.source,
        "layout": run.layout,
        "assumed": run.assumed.get("why", ""),
        "recompute": run.recompute,
        "memory_gib": r["memory"]["total_bytes"] / GIB,
        "memory_gb": r["memory"]["total_bytes"] / 1e9,
        "budget_gib": r["budget_bytes"] / GIB,
        "fits": r["fits"],
        "fits_with": next((rc for rc in RECOMPUTE_ORDER if results[rc]["fits"]), None),
        "schedule": r["schedule"],
        "virtual": r["virtual"],
        "step_time_s": r["step_time_s"],
        "mfu": r["mfu"],
        "hfu": hardware / (r["step_time_s"] * peak * run.gpus),
        "tflops_per_gpu": counted / (r["step_time_s"] * run.gpus) / 1e12,
        "tokens_per_s_per_gpu": r["tokens_per_s"] / run.gpus,
        "reported": dict(run.reported),
    }
    for key, ours in (
        ("mfu", "mfu"),
        ("tflops_per_gpu", "tflops"),
        ("tokens_per_s_per_gpu", "tokens"),
        ("memory_gb", "memory"),
    ):
        if key in run.reported:
            out[f"{ours}_ratio"] = out[key] / run.reported[key]
    if with_plan:
        p = _plan(run)
        out.update(
            plan_name=p["top"][0]["name"],
            plan_step_time_s=p["step_time_s"],
            plan_mfu=p["mfu"],
            plan_explanation=p["explanation"],
        )
    return out


_PLANS: dict[tuple, dict] = {}


def _plan(run: PublishedRun) -> dict:
    """The planner's pick for the run's model, cluster, batch, recomputation and keywords (one
    search per distinct question: Narayanan's ZeRO-3 and PTD-P rows share theirs)."""
    kw = {**cluster(run), "recompute": run.recompute, **run.assumed.get("kw", {})}
    key = (run.model, *sorted(kw.items()))
    if key not in _PLANS:
        _PLANS[key] = plan(model(run.model), **kw)
    return _PLANS[key]


def compare_published(*, with_plan: bool = True) -> list[dict]:
    """``compare`` for every run of ``PUBLISHED``."""
    return [compare(run, with_plan=with_plan) for run in PUBLISHED]


def format_published(rows: list[dict]) -> str:
    """The comparison as a table: each published layout, its memory by our calculator under the
    run's recomputation (and what would fit), our MFU and TFLOP/s beside the reported ones, and
    the planner's own pick."""
    lines = [
        f"{'run':<31}{'recompute':<10}{'memory (ours)':<25}{'MFU':>6}{'rep.':>6}"
        f"{'TFLOP/s':>9}{'rep.':>6}  planner's pick (its MFU)"
    ]
    for r in rows:
        if r["fits"]:
            memory = f"{r['memory_gib']:.0f} GiB, fits"
        elif r["fits_with"]:
            memory = f"{r['memory_gib']:.0f} GiB; {r['fits_with']} fits"
        else:
            memory = f"{r['memory_gib']:.0f} GiB, does not fit"
        rep = r["reported"]
        mfu = f"{rep['mfu']:.1%}" if "mfu" in rep else "-"
        tflops = f"{rep['tflops_per_gpu']:.0f}" if "tflops_per_gpu" in rep else "-"
        pick = f"{r['plan_name']} ({r['plan_mfu']:.0%})" if "plan_name" in r else ""
        lines.append(
            f"{r['name']:<31}{r['recompute']:<10}{memory:<25}{r['mfu']:>6.1%}{mfu:>6}"
            f"{r['tflops_per_gpu']:>9.0f}{tflops:>6}  {pick}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Every published figure beside ours, with the tolerance the tests hold it to.


def published_table(rows: list[dict] | None = None) -> list[dict]:
    """One row per published figure the cost model or a calculator is held against: ``source``,
    ``figure`` (what), ``published``, ``ours``, ``unit``, ``tolerance`` (relative; None where
    ``note`` states a gap instead) and ``note`` (why they differ, or how we count). ``rows``:
    ``compare_published(with_plan=False)``'s, computed when not given."""
    rows = rows if rows is not None else compare_published(with_plan=False)
    runs = {r["name"]: r for r in rows}
    table = []

    def add(source, figure, published, ours, unit="", tolerance=None, note=""):
        table.append(
            {
                "source": source,
                "figure": figure,
                "published": published,
                "ours": ours,
                "unit": unit,
                "tolerance": tolerance,
                "note": note,
            }
        )

    for run in PUBLISHED:
        r = runs[run.name]
        if run.source == LLAMA3:
            add(LLAMA3, f"{run.name}: BF16 MFU", run.reported["mfu"], r["mfu"], "", 0.15)
            add(
                LLAMA3,
                f"{run.name}: GiB per GPU, no recomputation",
                GPUS[run.gpu].memory_gib,
                r["memory_gib"],
                "GiB",
                None,
                "ran in an H100's 79.6 GiB; ours counts the course's unfused implementation",
            )
        elif run.source == NARAYANAN:
            tflops = run.reported["tflops_per_gpu"]
            add(NARAYANAN, f"{run.name}: TFLOP/s", tflops, r["tflops_per_gpu"], "TFLOP/s", 0.20)
        elif run.source == KORTHIKANTI:
            add(KORTHIKANTI, f"{run.name}: MFU", run.reported["mfu"], r["mfu"], "", 0.25)
            share = r["hfu"] / r["mfu"] - 1
            add(
                KORTHIKANTI,
                f"{run.name}: HFU/MFU - 1, its count",
                run.reported["hfu"] / run.reported["mfu"] - 1,
                3 * share,
                "",
                0.15,
                f"3 x ours ({share:.2%}): recomputed FLOPs over the forward pass, not the step",
            )
        else:
            rep = run.reported
            add(PLAYBOOK, f"{run.name}: GB per GPU", rep["memory_gb"], r["memory_gb"], "GB", 0.10)
            add(PLAYBOOK, f"{run.name}: MFU", rep["mfu"], r["mfu"], "", 0.15)
            tokens = rep["tokens_per_s_per_gpu"]
            add(PLAYBOOK, f"{run.name}: tokens/s/GPU", tokens, r["tokens_per_s_per_gpu"], "", 0.30)
    # Narayanan et al.: the ordering, ZeRO-3's step over PTD-P's at each GPU count
    for gpus in (384, 768, 1536):
        z = runs[f"gpt3-175b ZeRO-3, {gpus:,} GPUs"]
        p = runs[f"gpt3-175b PTD-P, {gpus:,} GPUs"]
        add(
            NARAYANAN,
            f"gpt3-175b {gpus:,} GPUs: PTD-P / ZeRO-3 throughput",
            p["reported"]["tflops_per_gpu"] / z["reported"]["tflops_per_gpu"],
            z["step_time_s"] / p["step_time_s"],
            "",
            0.10,
        )
    # Korthikanti et al. §5: GPT-3's selective recomputation costs 2.7 % more FLOPs
    gpt3 = MODELS["gpt3-175b"]
    share = flops_per_token(gpt3, seq=2048, recompute="selective") / flops_per_token(gpt3, seq=2048)
    add(
        "Korthikanti et al. 2022, §5",
        "gpt3-175b: selective recomputation's FLOPs, its count",
        0.027,
        3 * (share - 1),
        "",
        0.05,
        f"3 x ours ({share - 1:.2%} of a step): the rerun attention core over the forward pass",
    )
    return table


def format_table(rows: list[dict]) -> str:
    """``published_table`` as text: source, figure, published, ours, ours / published, the
    tolerance."""
    lines = [f"{'source':<33}{'figure':<52}{'published':>10}{'ours':>10}{'ratio':>7}  tolerance"]
    for r in rows:
        ratio = r["ours"] / r["published"] if r["published"] else float("nan")
        tol = f"±{r['tolerance']:.0%}" if r["tolerance"] is not None else "gap: " + r["note"]
        lines.append(
            f"{r['source']:<33}{r['figure']:<52}{r['published']:>10.4g}{r['ours']:>10.4g}"
            f"{ratio:>7.2f}  {tol}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The calculators against the published references they reproduce exactly.


def reference_checks() -> list[dict]:
    """One row per published figure the calculators reproduce: ``reference`` (source and what),
    ``published`` (as printed, in the source's unit), ``ours`` (ours, rounded the way the source
    rounds) and ``unit``. Decimal GB only where the source uses them."""
    from labs.theory.activations import layer_terms, terms_bytes
    from labs.theory.comm import all_reduce_bytes, collective_seconds
    from labs.theory.memory import param_count, state_bytes
    from labs.theory.moe import MIXTRAL_8X7B, moe_param_counts
    from labs.theory.pipeline import bubble_fraction, dualpipe_bubble_time, idle_time

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
    # Narayanan et al. 2021, Table 1 (eq. 2 plus the final norm: 2h more than the table counts)
    for name, published in (("gpt3-175b", 174.6), ("gpt-530b", 529.6), ("gpt-1t", 1008.0)):
        ours = round(param_count(MODELS[name]) / 1e9, 1)
        row(f"{name} parameters (Narayanan et al. 2021, Table 1)", published, ours, "B")
    mixtral = moe_param_counts(MIXTRAL_8X7B)
    row("Mixtral 8x7B parameters (Jiang et al. 2024)", 46.7, round(mixtral["total"] / 1e9, 1), "B")
    row("Mixtral 8x7B active per token", 12.9, round(mixtral["active"] / 1e9, 1), "B")
    # bubbles (Playbook; Narayanan et al. 2021; Qi et al. 2024) at P = 4, M = 8
    row("1F1B bubble (P-1)/(M+P-1), P=4 M=8", 3 / 11, bubble_fraction("1f1b", 4, 8), "")
    row("interleaved (P-1)/(VM+P-1), V=2", 3 / 19, bubble_fraction("interleaved", 4, 8, 2), "")
    row("ZB-H1 (P-1)/(3M+P-1), F=B=W", 3 / 27, bubble_fraction("zb-h1", 4, 8), "")
    # DeepSeek's DualPipe repository: DualPipeV idles (PP/2-1)(F&B+B-3W) for PP stages, in a
    # chunk's times; P = 4 ranks hold PP = 8 stages, F = B = W = 1/2 of a rank's forward
    deepseek = dualpipe_bubble_time(8, 0.5, 1.0, 0.5)
    row(
        "DualPipeV idle (PP/2-1)(F&B+B-3W), PP=8, F=B=W",
        deepseek,
        idle_time("dualpipev", 4, 1.0, 2.0, 2),
        "t_f",
    )
    row(
        "DualPipeV bubble, P=4 M=8 (DeepSeek's table)",
        deepseek / (24 + deepseek),
        bubble_fraction("dualpipev", 4, 8, 2),
        "",
    )
    # ring all-reduce (Playbook appendix A0): 2(N-1)/N·K per rank
    row("ring all-reduce bytes per rank, N=8, K=1", 2 * 7 / 8, all_reduce_bytes(1.0, 8), "K")
    # nccl-tests doc/PERFORMANCE.md: a broadcast's bus factor is 1, t = K/B
    row(
        "broadcast time, K=1 at B=1 (nccl-tests)",
        1.0,
        collective_seconds("broadcast", 1.0, 8, 1.0),
        "K/B",
    )
    # Korthikanti et al. 2022, Table 2: full recomputation keeps 2sbh per layer (no TP)
    gpt = preset("gpt2-small")
    full = terms_bytes(layer_terms(gpt, seq=1024, dtype_bytes=2, recompute="full"), seq=1024, mbs=4)
    row("full recomputation 2sbh per layer (Korthikanti Table 2)", 2 * 1024 * 4 * 768, full, "B")
    return rows


def format_references(rows: list[dict]) -> str:
    """``reference_checks`` as a table."""
    lines = [f"{'reference':<56}{'published':>11}{'ours':>11}  unit"]
    for r in rows:
        lines.append(f"{r['reference']:<56}{r['published']:>11.4g}{r['ours']:>11.4g}  {r['unit']}")
    return "\n".join(lines)
