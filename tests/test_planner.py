"""The parallelism planner (labs.theory.planner): the playbook's rule (``rule_plan``) reproduces
the seed example from the calculators' figures, small models stay pure FSDP, long sequences get
CP, a model that cannot be data-parallel over every GPU gets PP; the search (``plan``) returns the
fastest layout that fits, checked by brute force, with the rule as its explanation; a given
layout is evaluated (``--layout``); its byte counts agree with each lab's own theory module; bad
input is one line and exit 2, with the memory calculator's messages. Theory only: not marked
exercise."""

import json

import pytest

from labs.theory import cli
from labs.theory.comm import all_reduce_bytes
from labs.theory.context_parallel import kv_bytes, ring_bytes_per_rank
from labs.theory.dims import divisors
from labs.theory.memory import GIB, ModelSpec, memory_per_rank
from labs.theory.pipeline import bubble_fraction
from labs.theory.planner import (
    ASSUMPTIONS,
    Cluster,
    candidates,
    comm_per_step,
    evaluate,
    evaluate_layout,
    parse_layout,
    plan,
    rule_plan,
    scaling,
)
from labs.theory.planner.report import format_result, format_scaling, summary
from labs.theory.presets import preset
from labs.theory.tensor_parallel import collectives
from labs.theory.zero import comm_bytes
from tests.helpers import TINY_MODEL_ARGS, assert_torch_free, find_widget, run_cli, run_json

SEED = dict(seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
L70 = preset("llama3-70b")


@pytest.fixture(scope="module")
def seed():
    """The playbook's rule on the 70B / 32K / 512-GPU example."""
    return rule_plan(L70, **SEED)


@pytest.fixture(scope="module")
def fastest():
    """The search on the same example."""
    return plan(L70, **SEED)


def test_seed_example_70b_32k_on_512_gpus(seed):
    assert (seed["tp"], seed["pp"], seed["cp"], seed["dp"]) == (8, 4, 4, 4)
    assert seed["zero"] == 1 and seed["sp"] and seed["fits"]
    assert seed["global_batch"] == 128 and seed["microbatches"] == 32  # 4M tokens / 32K; 128 / dp=4
    assert seed["bubble"] == bubble_fraction("1f1b", 4, 32)
    assert seed["schedule"] == "1f1b" and seed["mbs"] == 1  # the rule's own assumptions
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
def test_a_model_that_fits_stays_pure_fsdp_under_the_rule(name, seq, gpus):
    p = rule_plan(
        preset(name), seq=seq, gpus=gpus, gpus_per_node=8, gpu_mem_gib=80, global_batch=256
    )
    assert (p["dp"], p["tp"], p["pp"], p["cp"], p["zero"]) == (gpus, 1, 1, 1, 3)
    assert p["rule"] == [p["rule"][0]] and p["rule"][0].startswith("FSDP: fits")
    assert [r["reason"].split(";")[0] for r in p["rejected"]] == ["FSDP already fits"]


def test_tp_grows_inside_the_node_until_fsdp_fits():
    p = rule_plan(L70, seq=8192, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
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
    p = rule_plan(preset("llama3-8b"), seq=131072, gpus=64, gpus_per_node=8, gpu_mem_gib=80)
    assert (p["tp"], p["pp"], p["cp"], p["dp"], p["zero"]) == (8, 1, 2, 4, 3)


def test_a_model_that_cannot_be_data_parallel_over_every_gpu_gets_pp():
    """Four sequences per step cannot feed FSDP over 64 GPUs, nor over 8 nodes of TP=8; the model
    (1.1 TB of training state) does not fit a node either: PP across nodes."""
    p = rule_plan(L70, seq=4096, gpus=64, gpus_per_node=8, gpu_mem_gib=80, global_batch=4)
    assert p["pp"] > 1 and p["cp"] == 1 and p["dp"] == 2 and p["zero"] == 1
    assert all("global_batch=4" in step for step in p["rule"][:4])


def test_assumptions_change_the_plan():
    # recomputation frees the activations: FSDP + TP
    assert rule_plan(L70, **SEED, recompute="full")["pp"] == 1
    no_headroom = rule_plan(L70, **SEED, headroom=0.0)
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
    # H100 links (NVLink 450 GB/s, InfiniBand 50 GB/s per GPU), at the share a collective reaches
    efficiency = ASSUMPTIONS["comm_efficiency"]
    assert seed["comm_seconds"]["tp"] == pytest.approx(
        seed["comm_bytes"]["tp"] / 450e9 / efficiency
    )
    assert seed["comm_seconds"]["cp"] == pytest.approx(seed["comm_bytes"]["cp"] / 50e9 / efficiency)
    one_node = rule_plan(
        preset("llama3-8b"), seq=65536, gpus=8, gpus_per_node=8, gpu_mem_gib=80, global_batch=8
    )
    assert all(one_node["intra_node"].values())


def test_cli_prints_the_plan(fastest):
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
    degrees = ("dp", "tp", "pp", "cp", "zero", "mbs", "schedule")
    assert {k: out[k] for k in degrees} == {k: fastest[k] for k in degrees}
    assert out["memory_gib"]["total"] == pytest.approx(fastest["memory"]["total_bytes"] / GIB)
    assert out["rule_layout"]["name"].startswith("DP=4 TP=8 PP=4 CP=4 (ZeRO-1)")
    assert len(out["top"]) == 5 and out["explanation"].startswith("the rule picks")
    text = run_cli(
        "-m",
        "labs.theory",
        "plan",
        *TINY_MODEL_ARGS,
        "--seq",
        "32",
        "--gpus",
        "8",
        "--global-batch",
        "16",
    )
    assert text.returncode == 0 and text.stdout.startswith("plan        DP="), text.stdout
    assert "fastest layouts that fit" in text.stdout and "the playbook's rule" in text.stdout
    assert json.loads(json.dumps(summary(fastest)))  # plain JSON all the way down


def test_the_text_shows_the_choice_the_reason_and_the_top_five(fastest):
    lines = format_result(summary(fastest, model="llama3-70b")).splitlines()
    assert lines[0].startswith(f"plan        DP={fastest['dp']} TP={fastest['tp']}")
    why = next(line for line in lines if line.startswith("why"))
    assert "the rule picks DP=4 TP=8 PP=4 CP=4" in why and "because" in why
    table = lines[lines.index(next(x for x in lines if x.startswith("fastest layouts"))) + 2 :]
    assert [row.split()[0] for row in table[:5]] == ["1", "2", "3", "4", "5"]
    steps = [float(row.split()[-2]) for row in table[:5]]
    assert steps == sorted(steps)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpus", "12"], "gpus=12 is not a whole number of nodes of gpus_per_node=8"),
        (["--gpus", "0"], "gpus must be an integer >= 1"),
        (["--seq", "0"], "seq must be an integer >= 1"),
        (["--gpu-mem", "-1"], "gpu_mem must be > 0 GiB"),
        (["--gpu-mem", "lots"], "gpu_mem='lots' is not a number of GiB"),
        (["--gpu", "A100"], "gpu='A100' is not one of"),
        (["--headroom", "1.5"], "headroom must be in [0, 1)"),
        (["--preset", "llama9"], "preset='llama9' is not one of"),
        (["--gpus", "8", "--seq", "32768"], "no layout of gpus=8 fits the model"),
        # the memory calculator's own messages, before any layout is tried
        (["--recompute", "foo"], "recompute='foo' is not one of ('none', 'selective', 'full')"),
        (["--optimizer", "lion"], "optimizer='lion' is not one of"),
        (["--precision", "fp7"], "precision='fp7' is not one of ('fp32', 'bf16-mixed')"),
        (["--schedule", "zb"], "schedule='zb' is not one of"),
        (["--mbs", "3"], "global_batch=128 is not divisible by mbs=3"),
        (["--seq", "4097"], "seq=4097 is not divisible by tp in {2,4,8}"),
        (["--preset", "tiny", "--seq", "32", "--schedule", "interleaved"], "n_layer=2"),
        (["--layout", "tp=8,pp=4"], "the layout lacks ['dp', 'cp']"),
        (["--layout", "tp=8,pp=4,cp=4,dp=4,x=1"], "unknown layout key(s) ['x']"),
        (["--layout", "tp=8,pp=4,cp=4,dp=8"], "dp*tp*pp*cp = 8*8*4*4 = 1024 but world_size=512"),
        (
            ["--layout", "tp=8,pp=4,cp=4,dp=4", "--export", "accelerate"],
            "accelerate's FSDP has no pipeline parallelism",
        ),
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


@pytest.mark.parametrize(
    "key, value",
    [("recompute", "foo"), ("optimizer", "lion"), ("precision", "fp7"), ("schedule", "zb")],
)
def test_the_planner_and_the_memory_calculator_say_the_same(key, value):
    with pytest.raises(ValueError) as planner_error:
        plan(L70, **SEED, **{key: value})
    with pytest.raises(ValueError) as memory_error:
        memory_per_rank(L70, seq=4096, mbs=1, pp=2, **{key: value})
    assert str(planner_error.value) == str(memory_error.value)


# ---------------------------------------------------------------- the search


def test_the_plan_is_the_fastest_layout_that_fits_by_brute_force():
    """Every candidate evaluated one by one: none that fits is faster than the plan, the top five
    are the five fastest in order, and every layout the rule could pick was a candidate."""
    spec = preset("llama3-8b")
    kw = dict(seq=4096, global_batch=64)
    cluster = Cluster(16, 8, 80)
    p = plan(spec, gpus=16, gpus_per_node=8, gpu_mem_gib=80, **kw)
    a = {**p["assumptions"]}
    results = []
    for layout in candidates(spec, seq=4096, batch=64, cluster=cluster, a=a):
        r = evaluate(spec, layout, cluster=cluster, **kw, **a)
        if r["fits"]:
            results.append(r)
    steps = sorted(r["step_time_s"] for r in results)
    assert p["fitting"] == len(results) and p["step_time_s"] == pytest.approx(steps[0])
    assert [t["step_time_s"] for t in p["top"]] == pytest.approx(steps[:5])
    schedules = {(r["schedule"], r["virtual"]) for r in results if r["layout"]["pp"] > 1}
    assert {("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)} <= schedules
    assert {r["layout"]["zero"] for r in results} == {0, 1, 2, 3}
    assert {r["mbs"] for r in results} >= {1, 2, 4}


def test_405b_on_16384_gpus_no_longer_takes_a_79_percent_bubble():
    """The issue's reproduction: the rule's PP=32 with 8 micro-batches is 79% bubble; the search
    finds a layout several times faster and says why."""
    kw = dict(seq=8192, gpus=16384, gpus_per_node=8, gpu_mem_gib=80)
    rule = rule_plan(preset("llama3-405b"), **kw)
    assert (rule["tp"], rule["pp"]) == (8, 32) and rule["bubble"] > 0.79
    p = plan(preset("llama3-405b"), **kw)
    assert p["fits"] and p["bubble"] < 0.2
    assert rule["step_time_s"] > 2.4 * p["step_time_s"]
    assert "the pipeline bubble costs" in p["explanation"]
    assert p["rule_layout"]["step_time_s"] == pytest.approx(rule["step_time_s"])


def test_gpt2_small_on_8_gpus_is_plain_data_parallelism_not_zero3():
    """ZeRO-3 re-gathers the weights for each of 512 micro-batches (~334 GB per step); plain data
    parallelism, or ZeRO-1, sends the gradients once (~0.44 GB)."""
    kw = dict(seq=1024, gpus=8, gpus_per_node=8, gpu_mem_gib=80)
    p = plan(preset("gpt2-small"), **kw)
    assert (p["dp"], p["tp"], p["pp"], p["cp"]) == (8, 1, 1, 1) and p["zero"] in (0, 1)
    assert p["comm_bytes"]["dp"] / 1e9 == pytest.approx(0.436, abs=0.001)
    fsdp = evaluate(
        preset("gpt2-small"),
        {"dp": 8, "tp": 1, "pp": 1, "cp": 1, "zero": 3},
        seq=1024,
        global_batch=4096,
        cluster=Cluster(8, 8, 80),
    )
    assert fsdp["comm_bytes"]["dp"] / 1e9 == pytest.approx(334, abs=1)
    assert p["step_time_s"] <= fsdp["step_time_s"]


def test_fsdp_with_many_micro_batches_exposes_its_traffic():
    """ZeRO-3 gathers the weights for every micro-batch: on InfiniBand with small micro-batches
    the gathers outlast the compute beside them, where ZeRO-1's one reduce-scatter + all-gather
    hides behind the last backward and the next first forward. What runs beside compute still
    costs ``overlap_penalty`` of the time they share."""
    spec = preset("llama3-8b")
    cluster = Cluster(64, 8, 80)
    figures = {
        zero: evaluate(
            spec,
            {"dp": 64, "tp": 1, "pp": 1, "cp": 1, "zero": zero},
            seq=4096,
            global_batch=256,
            cluster=cluster,
        )
        for zero in (1, 3)
    }
    assert figures[3]["exposed_by_axis"]["dp"] > 1.0 > figures[1]["exposed_by_axis"]["dp"]
    t_mb = figures[3]["compute_s"] / 4  # 4 micro-batches per DP rank
    gather = figures[3]["comm_seconds"]["dp"] / 3 / 4  # one all-gather of one micro-batch
    k = ASSUMPTIONS["overlap_penalty"]

    def overlapped(comm: float, compute: float) -> float:
        return max(0, comm - compute) + k * min(comm, compute)

    want = 4 * (overlapped(gather, t_mb / 3) + overlapped(2 * gather, 2 * t_mb / 3))
    assert figures[3]["exposed_by_axis"]["dp"] == pytest.approx(want)


def test_a_given_layout_is_evaluated():
    layout = "tp=8,pp=4,cp=4,dp=4"
    given = evaluate_layout(L70, layout, **SEED)
    rule = rule_plan(L70, **SEED)
    assert parse_layout(layout) == {"tp": 8, "pp": 4, "cp": 4, "dp": 4, "zero": 1}
    assert given["step_time_s"] == rule["step_time_s"] and given["given"]
    assert given["verdict"].startswith("fits: 40.4 GiB per GPU against a 72.0 GiB budget")
    tight = evaluate_layout(L70, "tp=8,pp=4,cp=1,dp=16", **SEED)
    assert (
        tight["verdict"].startswith("does not fit")
        and "largest part is activation" in (tight["verdict"])
    )
    interleaved = parse_layout("tp=8,pp=4,cp=4,dp=4,zero=1,v=2")
    assert interleaved["schedule"] == "interleaved" and interleaved["virtual"] == 2
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
        "--gpu-mem",
        "80",
        "--layout",
        "tp=8,pp=4,cp=4,dp=4,v=2",
        "--json",
    )
    assert (out["schedule"], out["virtual"]) == ("interleaved", 2)
    assert out["bubble"] == bubble_fraction("interleaved", 4, 32, 2) and "verdict" in out


def test_gpu_memory_takes_gib_or_labelled_decimal_gb():
    from labs.theory.memory_report import gpu_memory_gib

    assert gpu_memory_gib("79.6") == gpu_memory_gib("79.6GiB") == 79.6
    assert gpu_memory_gib("80GB") == pytest.approx(80e9 / GIB)  # 74.5 GiB
    a = run_json(
        "-m",
        "labs.theory",
        "plan",
        "--preset",
        "llama3-8b",
        "--seq",
        "4096",
        "--gpus",
        "8",
        "--gpu-mem",
        "80GB",
        "--json",
    )
    assert a["cluster"]["gpu_mem_gib"] == pytest.approx(74.51, abs=0.01)


def test_a_gpu_brings_its_own_links():
    """``--gpu "A100 80GB"`` plans with an A100 cluster's links (NVLink 300 GB/s each way, a
    200 Gb/s HDR NIC per GPU, as Selene's DGX A100 nodes), not the H100 defaults; --intra-bw and
    --inter-bw override them."""
    a100 = cli.run(
        ["plan", "--preset", "llama3-8b", "--seq", "4096", "--gpus", "64", "--gpu", "A100 80GB"]
    )
    assert (a100["cluster"]["intra_gbps"], a100["cluster"]["inter_gbps"]) == (300.0, 25.0)
    assert a100["cluster"]["peak_tflops"] == 312.0 and a100["cluster"]["gpu_mem_gib"] == 80.0
    h100 = cli.run(["plan", "--preset", "llama3-8b", "--seq", "4096", "--gpus", "64"])
    assert (h100["cluster"]["intra_gbps"], h100["cluster"]["inter_gbps"]) == (450.0, 50.0)
    given = cli.run(
        ["plan", "--preset", "llama3-8b", "--seq", "4096", "--gpus", "64", "--gpu", "A100 80GB",
         "--intra-bw", "600", "--inter-bw", "50"]
    )  # fmt: skip
    assert (given["cluster"]["intra_gbps"], given["cluster"]["inter_gbps"]) == (600.0, 50.0)


def test_plan_ties_the_head_with_tied():
    """``plan --tied`` ties the output head to the embedding, as ``memory --tied`` does: V·h fewer
    parameters."""
    argv = [
        "plan",
        "--preset",
        "llama3-8b",
        "--seq",
        "4096",
        "--gpus",
        "8",
        "--layout",
        "tp=1,pp=1,cp=1,dp=8",
    ]
    untied = cli.run(argv)
    tied = cli.run([*argv, "--tied"])
    assert untied["total_params"] - tied["total_params"] == 128256 * 4096
    assert tied["memory_gib"]["param"] < untied["memory_gib"]["param"]


def test_fsdp_with_pp_is_a_candidate():
    """ZeRO-2/3 with pipeline parallelism (torchtitan and Llama 3 shard with FSDP under PP) is in
    the search; the course's mesh lab stops at ZeRO-1 with PP, a limit of the lab, not a rule."""
    cluster = Cluster(64, 8, 80)
    tried = candidates(L70, seq=4096, batch=64, cluster=cluster, a={**ASSUMPTIONS, "mbs": 1})
    assert {(c["pp"] > 1, c["zero"]) for c in tried} >= {(True, 2), (True, 3), (False, 3)}
    r = evaluate(
        L70,
        {"dp": 8, "tp": 8, "pp": 1, "cp": 1, "zero": 3},
        seq=4096,
        global_batch=64,
        cluster=cluster,
    )
    piped = evaluate(
        L70,
        {"dp": 2, "tp": 8, "pp": 4, "cp": 1, "zero": 3},
        seq=4096,
        global_batch=64,
        cluster=cluster,
    )
    # ZeRO-3 shards the stage's bf16 weights over its dp ranks, as it shards the whole model's
    assert piped["memory"]["param_bytes"] == piped["memory"]["params"] * 2 / 2
    assert r["memory"]["param_bytes"] == r["memory"]["params"] * 2 / 8
    assert piped["comm_bytes"]["dp"] > 0 and piped["exposed_by_axis"]["dp"] >= 0


def test_theory_cli_and_exports_do_not_import_torch():
    assert_torch_free(
        "from labs.theory.__main__ import main\n"
        "for extra in ([], ['--export', 'torchrun'], ['--export', 'deepspeed', '--gpus', '64']):\n"
        "    main(['plan', '--preset', 'llama3-8b', '--seq', '4096', '--gpus', '512', *extra])\n"
        "main(['plan', '--preset', 'llama3-70b', '--seq', '32768', '--gpus', '512',"
        " '--layout', 'tp=8,pp=4,cp=4,dp=4,v=2'])\n"
        "from labs.theory.published import compare_published, reference_checks\n"
        "compare_published(with_plan=False); reference_checks()\n"
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


def test_plan_drawing_and_the_widget_headless(seed, fastest):
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
    # four parts per bar, two bars of 100% each
    assert len(bars) == 8 and sum(b.get_height() for b in bars) == pytest.approx(200)
    box = planner_widget()

    def find(css_class):
        return find_widget(box, css_class)

    result = find("labs-planner-result")
    exported = find("labs-planner-export-text")
    best = summary(plan(L70, seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=79.6))
    head = f"DP={best['dp']} TP={best['tp']} PP={best['pp']} CP={best['cp']}"
    assert head in result.value and "the rule picks DP=4 TP=8 PP=4 CP=4" in result.value
    assert f"--tp {best['tp']}" in exported.value
    find("labs-planner-layout").value = "tp=8,pp=4,cp=4,dp=4"
    assert "layout      DP=4 TP=8 PP=4 CP=4" in result.value and "verdict" in result.value
    find("labs-planner-export").value = "accelerate"
    assert "cannot export: pp=4" in exported.value
    find("labs-planner-layout").value = ""
    find("labs-planner-schedule").value = "zb-h1"
    assert "plan        DP=" in result.value
    find("labs-planner-gpus").value = 12
    assert "cannot plan: gpus=12" in result.value
    find("labs-planner-gpus").value = 512
    find("labs-planner-gpu").value = "A100 80GB"  # an A100 cluster's links come with it
    assert (find("labs-planner-intra").value, find("labs-planner-inter").value) == (300.0, 25.0)
    assert "on 512 GPUs" in result.value and "of 80.0 GiB" in result.value


def test_scaling_shows_where_the_time_goes(seed):
    """A fixed 128-sequence batch on more GPUs. The rule keeps the same replica and adds DP, so
    each DP rank gets fewer micro-batches, the bubble's share grows and the throughput per GPU
    falls; the search avoids the pipeline. Each step is compute + imbalance + bubble + exposed
    traffic."""
    kw = dict(seq=32768, gpus_per_node=8, gpu_mem_gib=80, global_batch=128)
    rows = scaling(L70, [8, 128, 512, 2048], rule=True, **kw)
    assert "no layout of gpus=8 fits" in rows[0]["error"]
    rows = rows[1:]
    assert [(r["dp"], r["tp"], r["pp"], r["cp"]) for r in rows] == [
        (1, 8, 4, 4),
        (4, 8, 4, 4),
        (16, 8, 4, 4),
    ]
    for r in rows:
        assert r["step_time_s"] == pytest.approx(
            r["compute_s"] + r["imbalance_s"] + r["bubble_s"] + r["exposed_comm_s"]
        )
        bubble = bubble_fraction("1f1b", 4, 128 // r["dp"])
        piped = r["compute_s"] + r["imbalance_s"] + r["bubble_s"]
        assert r["bubble_s"] / piped == pytest.approx(bubble)
        assert sum(r["exposed_by_axis"].values()) == pytest.approx(r["exposed_comm_s"])
    assert (
        rows[0]["vs_first"] == 1 and rows[0]["vs_first"] > rows[1]["vs_first"] > rows[2]["vs_first"]
    )
    assert rows[1]["scaling_efficiency"] == pytest.approx(seed["scaling_efficiency"])
    lines = format_scaling(rows).splitlines()
    assert lines[-1].split()[:2] == ["2048", "DP16"] and "bubble" in lines[-1]
    fastest = scaling(L70, [128, 512, 2048], **kw)
    for rule_row, best in zip(rows, fastest):
        assert best["step_time_s"] <= rule_row["step_time_s"]
