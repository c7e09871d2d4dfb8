"""The parallelism planner (labs.theory.planner): the rule reproduces the seed example from the
calculators' figures, small models stay pure FSDP, long sequences get CP, a model that cannot be
data-parallel over every GPU gets PP; its byte counts agree with each lab's own theory module; bad
input is one line and exit 2. Theory only: not marked exercise."""

import json

import pytest

from labs.theory.comm import all_reduce_bytes
from labs.theory.context_parallel import kv_bytes, ring_bytes_per_rank
from labs.theory.dims import divisors
from labs.theory.memory import GIB, ModelSpec, memory_per_rank
from labs.theory.pipeline import bubble_fraction
from labs.theory.plan_report import format_scaling, summary
from labs.theory.planner import Cluster, comm_per_step, evaluate, plan, scaling
from labs.theory.presets import preset
from labs.theory.tensor_parallel import collectives
from labs.theory.zero import comm_bytes
from tests.helpers import assert_torch_free, find_widget, run_cli, run_json

SEED = dict(seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
L70 = preset("llama3-70b")


@pytest.fixture(scope="module")
def seed():
    return plan(L70, **SEED)


def test_seed_example_70b_32k_on_512_gpus(seed):
    assert (seed["tp"], seed["pp"], seed["cp"], seed["dp"]) == (8, 4, 4, 4)
    assert seed["zero"] == 1 and seed["sp"] and seed["fits"]
    assert seed["global_batch"] == 128 and seed["microbatches"] == 32  # 4M tokens / 32K; 128 / dp=4
    assert seed["bubble"] == bubble_fraction("1f1b", 4, 32)
    # MFU <= efficiency x matmul efficiency
    assert 0 < seed["mfu"] < seed["scaling_efficiency"] * 0.6 + 1e-12
    assert len(seed["rule"]) == 5 and seed["rule"][-1].startswith("PP/CP")


def test_seed_comes_from_the_rule_not_a_special_case(seed):
    """Redo the rule's arithmetic with the memory calculator alone: FSDP (+TP in a node) does not
    fit; every replica smaller than 8 x 4 x 4 = 128 GPUs needs more than the budget without DP
    sharding; the equal-size replicas that fit are slower."""
    budget = 80 * GIB * 0.9
    run = dict(seq=32768, mbs=1, precision="bf16-mixed", optimizer="adamw", recompute="none")
    for tp in (4, 8):  # tp 1 and 2 leave more DP ranks than the 128 sequences of the batch
        fsdp = memory_per_rank(
            L70, zero=3, dp=512 // tp, tp=tp, sp=tp > 1, microbatches=128 * tp // 512, **run
        )
        assert fsdp["total_bytes"] > budget
    for tp in divisors(8):
        for pp in divisors(512 // tp):
            for cp in divisors(512 // (tp * pp)):
                size = tp * pp * cp
                if pp * cp == 1 or size > 128 or size < 4 or pp > 80 or 32768 % (cp * tp):
                    # FSDP, larger than the plan, < 1 sequence per DP rank, > 1 stage per layer,
                    # uneven
                    continue
                replica = memory_per_rank(
                    L70, tp=tp, sp=tp > 1, pp=pp, cp=cp, microbatches=128 * size // 512, **run
                )
                if size < 128:
                    assert replica["total_bytes"] > budget, (tp, pp, cp)
                elif replica["total_bytes"] <= budget and (tp, pp, cp) != (8, 4, 4):
                    other = evaluate(
                        L70,
                        {"dp": 4, "tp": tp, "pp": pp, "cp": cp, "zero": 1},
                        seq=32768,
                        global_batch=128,
                        cluster=Cluster(512, 8, 80),
                    )
                    assert other["step_time_s"] > seed["step_time_s"], (tp, pp, cp)
    mine = memory_per_rank(L70, tp=8, sp=True, pp=4, cp=4, microbatches=32, **run)
    assert mine["total_bytes"] == seed["replica_bytes"] <= budget
    assert (
        memory_per_rank(L70, zero=1, dp=16, tp=8, sp=True, pp=4, cp=4, microbatches=32, **run)
        == seed["memory"]
    )


def test_seed_rejections_say_why(seed):
    by_name = {r["name"]: r for r in seed["rejected"]}
    assert "global_batch=128" in by_name["DP=512 (ZeRO-3)"]["reason"]
    assert "needs 125.6 GiB per GPU > 72.0 GiB" in by_name["DP=64 TP=8 (ZeRO-3)"]["reason"]
    # FSDP + TP + CP
    assert "fits only by sharding" in by_name["DP=16 TP=8 CP=4 (ZeRO-3)"]["reason"]
    assert "a replica needs 94.5 GiB" in by_name["DP=8 TP=8 PP=4 CP=2 (ZeRO-1)"]["reason"]
    assert "leaves DP=2" in by_name["DP=2 TP=8 PP=8 CP=4 (ZeRO-1)"]["reason"]


@pytest.mark.parametrize(
    "name,seq,gpus", [("llama3-8b", 4096, 64), ("tiny", 32, 8), ("llama3.2-1b", 4096, 8)]
)
def test_a_model_that_fits_stays_pure_fsdp(name, seq, gpus):
    p = plan(preset(name), seq=seq, gpus=gpus, gpus_per_node=8, gpu_mem_gib=80, global_batch=256)
    assert (p["dp"], p["tp"], p["pp"], p["cp"], p["zero"]) == (gpus, 1, 1, 1, 3)
    assert p["rule"] == [p["rule"][0]] and p["rule"][0].startswith("FSDP: fits")
    assert [r["reason"].split(";")[0] for r in p["rejected"]] == ["FSDP already fits"]


def test_tp_grows_inside_the_node_until_fsdp_fits():
    p = plan(L70, seq=8192, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
    assert (p["dp"], p["tp"], p["pp"], p["cp"], p["zero"]) == (128, 4, 1, 1, 3)
    smaller = evaluate(
        L70,
        {"dp": 256, "tp": 2, "pp": 1, "cp": 1, "zero": 3},
        seq=8192,
        global_batch=512,
        cluster=Cluster(512, 8, 80),
    )
    assert not smaller["fits"]


def test_a_long_sequence_gets_cp():
    p = plan(preset("llama3-8b"), seq=131072, gpus=64, gpus_per_node=8, gpu_mem_gib=80)
    assert (p["tp"], p["pp"], p["cp"], p["dp"], p["zero"]) == (8, 1, 2, 4, 3)


def test_a_model_that_cannot_be_data_parallel_over_every_gpu_gets_pp():
    """Four sequences per step cannot feed FSDP over 64 GPUs, nor over 8 nodes of TP=8; the model
    (1.1 TB of training state) does not fit a node either: PP across nodes."""
    p = plan(L70, seq=4096, gpus=64, gpus_per_node=8, gpu_mem_gib=80, global_batch=4)
    assert p["pp"] > 1 and p["cp"] == 1 and p["dp"] == 2 and p["zero"] == 1
    assert all("global_batch=4" in step for step in p["rule"][:4])


def test_assumptions_change_the_plan():
    # recomputation frees the activations: FSDP + TP
    assert plan(L70, **SEED, recompute="full")["pp"] == 1
    no_headroom = plan(L70, **SEED, headroom=0.0)
    # same size, the faster one
    assert no_headroom["tp"] * no_headroom["pp"] * no_headroom["cp"] == 128


def test_comm_agrees_with_each_labs_theory():
    """One micro-batch, fp32: TP bytes per layer = the TP lab's collectives of layer 0; CP = the
    ring's per-layer bytes; DP under ZeRO-1 and ZeRO-3 = the ZeRO lab's ring figures (one unit, no
    padding)."""
    spec = ModelSpec(vocab_size=256, hidden=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=128)
    tp_calls = [
        c
        for c in collectives(spec, tp=2, sp=True, batch=2, seq=32)
        if c["where"].startswith("layers.0.") and "norm weight" not in c["where"]
    ]
    layout = {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "zero": 3}
    got = comm_per_step(
        spec, layout, seq=32, mbs=2, microbatches=1, params=1024, layers=1, precision="fp32"
    )
    assert got["tp"] == pytest.approx(sum(c["sent_bytes"] for c in tp_calls))
    assert got["tp"] == 4 * all_reduce_bytes(2 * 32 * 64 * 4, 2)
    assert got["dp"] == pytest.approx(comm_bytes([1024], stage=3, dp=2)["total"])
    layout = {"dp": 2, "tp": 1, "pp": 2, "cp": 4, "zero": 1}
    got = comm_per_step(
        spec, layout, seq=32, mbs=2, microbatches=1, params=1024, layers=1, precision="fp32"
    )
    kv = kv_bytes(batch=2, seq_len=32, n_kv_head=4, head_dim=8)
    assert got["cp"] == pytest.approx(ring_bytes_per_rank(cp=4, kv=kv)["total"])
    # over dp x cp ranks
    assert got["dp"] == pytest.approx(comm_bytes([1024], stage=1, dp=8)["total"])
    assert got["pp"] == 2 * (32 // 4) * 64 * 4  # one boundary activation [2, 32/4, 64] fp32 forward


def test_groups_inside_a_node_use_the_fast_link(seed):
    assert seed["intra_node"] == {"tp": True, "cp": False, "pp": False, "dp": False}
    assert seed["comm_seconds"]["tp"] == seed["comm_bytes"]["tp"] / 450e9
    assert seed["comm_seconds"]["cp"] == seed["comm_bytes"]["cp"] / 50e9
    one_node = plan(
        preset("llama3-8b"), seq=65536, gpus=8, gpus_per_node=8, gpu_mem_gib=80, global_batch=8
    )
    assert all(one_node["intra_node"].values())


def test_cli_prints_the_plan(seed):
    out = run_json(
        "-m",
        "labs.theory",
        "plan",
        "--preset",
        "llama3-70b",
        "--seq",
        "32768",
        "--gpus",
        "512",
        "--gpus-per-node",
        "8",
        "--gpu-mem",
        "80",
        "--json",
    )
    assert {k: out[k] for k in ("dp", "tp", "pp", "cp")} == {"dp": 4, "tp": 8, "pp": 4, "cp": 4}
    assert out["memory_gib"]["total"] == pytest.approx(40.39, abs=0.01)
    text = run_cli(
        "-m",
        "labs.theory",
        "plan",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "8",
        "--kv-heads",
        "4",
        "--ffn",
        "128",
        "--vocab",
        "256",
        "--seq",
        "32",
        "--gpus",
        "8",
        "--global-batch",
        "16",
    )
    assert text.returncode == 0 and text.stdout.startswith("plan        DP=8 TP=1 PP=1 CP=1"), (
        text.stdout
    )
    assert json.loads(json.dumps(summary(seed)))  # plain JSON all the way down


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpus", "12"], "gpus=12 is not a whole number of nodes of gpus_per_node=8"),
        (["--gpus", "0"], "gpus must be an integer >= 1"),
        (["--seq", "0"], "seq must be an integer >= 1"),
        (["--gpu-mem", "-1"], "gpu_mem_gib must be a number > 0"),
        (["--gpu", "A100"], "gpu='A100' is not one of"),
        (["--headroom", "1.5"], "headroom must be in [0, 1)"),
        (["--preset", "llama9"], "preset='llama9' is not one of"),
        (["--gpus", "8", "--seq", "32768"], "no layout of gpus=8 fits the model"),
        (["--export", "accelerate"], "accelerate's FSDP has no pipeline parallelism"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    base = {"--preset": "llama3-70b", "--seq": "32768", "--gpus": "512", "--gpu-mem": "80"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    proc = run_cli("-m", "labs.theory", "plan", *[x for kv in base.items() for x in kv])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_theory_cli_and_exports_do_not_import_torch():
    assert_torch_free(
        "from labs.theory.__main__ import main\n"
        "for extra in ([], ['--export', 'torchrun'], ['--export', 'deepspeed', '--gpus', '64']):\n"
        "    main(['plan', '--preset', 'llama3-8b', '--seq', '4096', '--gpus', '512', *extra])\n"
        "from labs.theory.exports import accelerate_config\n"
        "accelerate_config({'dp': 8, 'tp': 1, 'pp': 1, 'cp': 1})",
        timeout=60,
    )


# ---------------------------------------------------------------- the widget's drawings, headless


def test_mesh_drawing_and_table():
    from labs.theory.dims import ParallelDims
    from labs.widgets.planner import draw_mesh, mesh_table

    dims = ParallelDims(dp=2, tp=2, pp=2)
    table = mesh_table(dims)
    assert [r["rank"] for r in table] == list(range(8))
    for axis in ("dp", "tp", "pp"):
        groups = {}
        for r in table:
            groups.setdefault(r["groups"][axis], []).append(r["rank"])
        assert sorted(groups.values()) == sorted(dims.groups(axis))
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp innermost: consecutive ranks
    fig = draw_mesh(dims, gpus_per_node=4)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert (
        labels.count("tp0") == 2
        and labels.count("dp0") == 2
        and "node 1" in labels
        and "cp0" not in labels
    )


def test_plan_drawing_and_the_widget_headless(seed):
    from labs.widgets.planner import draw_plan, planner_widget

    s = summary(seed, model="llama3-70b")
    fig = draw_plan(s)
    mem, comm, time = fig.axes
    assert len(mem.patches) == 4
    assert sum(p.get_height() for p in mem.patches) == pytest.approx(s["memory_gib"]["total"])
    assert [p.get_height() * 1e9 for p in comm.patches] == pytest.approx(
        [s["comm_bytes"][a] for a in ("tp", "cp", "pp", "dp")]
    )
    assert sum(p.get_width() for p in time.patches) == pytest.approx(s["step_time_s"])
    from labs.widgets.planner import draw_scaling

    rows = scaling(L70, [128, 512], seq=32768, gpus_per_node=8, gpu_mem_gib=80, global_batch=128)
    bars = draw_scaling(rows).axes[0].patches
    # two bars of 100% each
    assert len(bars) == 6 and sum(b.get_height() for b in bars) == pytest.approx(200)
    box = planner_widget()

    def find(css_class):
        return find_widget(box, css_class)

    result = find("labs-planner-result")
    exported = find("labs-planner-export-text")
    assert "DP=4 TP=8 PP=4 CP=4" in result.value and "--tp 8 --pp 4 --cp 4" in exported.value
    find("labs-planner-export").value = "accelerate"
    assert "cannot export: pp=4" in exported.value
    find("labs-planner-gpu").value = "H200 141GB"
    assert (
        "DP=64 TP=8 PP=1 CP=1" in result.value and "parallelism_config_tp_size: 8" in exported.value
    )
    find("labs-planner-gpus").value = 12
    assert "cannot plan: gpus=12" in result.value


def test_scaling_shows_where_the_time_goes(seed):
    """A fixed 128-sequence batch on more GPUs: the same replica, more DP, fewer micro-batches each,
    so the bubble's share grows and the throughput per GPU falls; each step is compute + bubble +
    exposed traffic."""
    rows = scaling(
        L70, [8, 128, 512, 2048], seq=32768, gpus_per_node=8, gpu_mem_gib=80, global_batch=128
    )
    assert "no layout of gpus=8 fits" in rows[0]["error"]
    rows = rows[1:]
    assert [(r["dp"], r["tp"], r["pp"], r["cp"]) for r in rows] == [
        (1, 8, 4, 4),
        (4, 8, 4, 4),
        (16, 8, 4, 4),
    ]
    for r in rows:
        assert r["step_time_s"] == pytest.approx(
            r["compute_s"] + r["bubble_s"] + r["exposed_comm_s"]
        )
        bubble = bubble_fraction("1f1b", 4, 128 // r["dp"])
        assert r["bubble_s"] / (r["compute_s"] + r["bubble_s"]) == pytest.approx(bubble)
        assert sum(r["exposed_by_axis"].values()) == pytest.approx(r["exposed_comm_s"])
    assert (
        rows[0]["vs_first"] == 1 and rows[0]["vs_first"] > rows[1]["vs_first"] > rows[2]["vs_first"]
    )
    assert rows[1]["scaling_efficiency"] == pytest.approx(seed["scaling_efficiency"])
    lines = format_scaling(rows).splitlines()
    assert lines[-1].split()[:2] == ["2048", "DP16"] and "bubble" in lines[-1]
