"""Encoder theory (labs.theory.multimodal) against the real model: parameters, saved activations and
FLOPs measured on labs.models.vision; the heterogeneous 1F1B simulation against
labs.theory.pipeline's; the split search against brute force; the calculator and planner with an
encoder against theirs without it. Theory and harness only (no exercise code): not marked
exercise."""

import itertools
import json

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from labs.data.shapes import global_batches
from labs.experiments.multimodal import SIZES, specs
from labs.measure import SavedActivations
from labs.models.transformer import ModelConfig, count_params
from labs.models.vision import MultimodalConfig, VisionConfig, build_multimodal, fuse, run_blocks
from labs.theory import cli, pipeline
from labs.theory import multimodal as theory
from labs.theory.activations import stage_activation_bytes
from labs.theory.memory import memory_per_rank, param_counts_per_rank, state_bytes
from labs.theory.planner import multimodal as multimodal_plan
from labs.theory.presets import preset
from tests.helpers import assert_torch_free

OTHER = MultimodalConfig(
    vision=VisionConfig(
        image_size=16, patch_size=2, n_layer=3, n_embd=48, n_head=3, mlp_hidden=80, channels=3
    ),
    decoder=ModelConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=96, seq_len=96),
)
CONFIGS = {"tiny": SIZES["tiny"], "other": OTHER}


def batch(cfg, mbs):
    return global_batches(
        steps=1, batch_size=mbs, n_prefix=cfg.n_prefix, image_size=cfg.vision.image_size
    )[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_encoder_parameters_equal_the_model(name):
    cfg = CONFIGS[name]
    model = build_multimodal(cfg)
    spec, enc = specs(cfg)
    counts = theory.encoder_param_counts(enc, text_hidden=spec.hidden)
    assert counts["encoder"] == count_params(model.encoder)
    assert counts["projector"] == count_params(model.projector)
    assert counts["total"] + param_counts_per_rank(spec)["total"] == count_params(model)


@pytest.mark.parametrize("name, mbs", [("tiny", 2), ("other", 3)])
def test_encoder_activations_equal_saved_tensors(name, mbs):
    cfg = CONFIGS[name]
    model = build_multimodal(cfg)
    spec, enc = specs(cfg)
    images, tokens, targets = batch(cfg, mbs)
    with SavedActivations(exclude=model) as encoder_part:
        model.projector(model.encoder(images))
    with SavedActivations(exclude=model) as whole:
        model(images, tokens, targets)
    expected = theory.encoder_activation_bytes(enc, mbs=mbs, text_hidden=spec.hidden)
    assert encoder_part.bytes == expected["total"]
    # the whole model: encoder + the course decoder's exact formula at T = P + C
    decoder = stage_activation_bytes(
        spec, seq=cfg.seq_len, mbs=mbs, dtype_bytes=4, layers=spec.n_layers
    )
    assert whole.bytes == expected["total"] + decoder["total"]


@pytest.mark.parametrize("name", CONFIGS)
def test_encoder_flops_equal_the_flop_counter(name):
    cfg = CONFIGS[name]
    model = build_multimodal(cfg)
    spec, enc = specs(cfg)
    images = batch(cfg, 2)[0]
    # the math kernel's matmuls are counted (the CPU flash kernel's are not)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            out = model.projector(model.encoder(images))
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
    expected = theory.encoder_flops(enc, mbs=2, text_hidden=spec.hidden)
    assert forward.get_total_flops() == expected["forward"]
    assert backward.get_total_flops() == expected["backward"]


@pytest.mark.parametrize("split", [(0, 2, 1, 1), (2, 0, 1, 1), (1, 3)])
def test_stage_costs_equal_the_stage(split):
    cfg = SIZES["tiny"]
    model = build_multimodal(cfg)
    spec, enc = specs(cfg)
    mbs = 2
    images, tokens, _ = batch(cfg, 2)
    costs = theory.stage_costs(spec, enc, split=split, text_tokens=cfg.caption_len, mbs=mbs)
    assert sum(c["params"] for c in costs) == count_params(model)

    def stage0():  # stage 0 as the lab builds it: encoder, projector, fusion, its decoder layers
        h = fuse(model.decoder, model.projector(model.encoder(images)), tokens)
        return run_blocks(model.decoder.layers[: split[0]], h, cfg.decoder)

    with SavedActivations(exclude=model) as saved:  # the default (flash) kernel, as in training
        stage0()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as flops:
        stage0()
    stage0_params = (
        count_params(model.encoder)
        + count_params(model.projector)
        + model.decoder.tok_emb.weight.numel()
        + split[0] * count_params(model.decoder.layers[0])
    )
    assert costs[0]["params"] == stage0_params
    assert flops.get_total_flops() == costs[0]["forward_flops"]
    assert saved.bytes == costs[0]["activation_bytes"]


@pytest.mark.parametrize("P, M", [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_uniform_stages_reproduce_the_pipeline_simulation(P, M):
    ours = theory.simulate_stages([1.0] * P, [2.0] * P, M)
    theirs = pipeline.simulate("1f1b", P, M, t_f=1.0, t_b=2.0)
    assert ours["makespan"] == pytest.approx(theirs["makespan"])
    assert ours["bubble_fraction"] == pytest.approx(pipeline.bubble_fraction("1f1b", P, M))
    delayed = theory.simulate_stages([1.0] * P, [2.0] * P, M, t_delay=0.25)
    theirs = pipeline.simulate("1f1b", P, M, t_f=1.0, t_b=2.0, t_delay=0.25)
    assert delayed["makespan"] == pytest.approx(theirs["makespan"])
    assert delayed["bubble_fraction"] == pytest.approx(theirs["bubble_fraction"])


def test_the_slowest_stage_sets_the_pace():
    M = 8
    slow = theory.simulate_stages([1.0, 3.0], [2.0, 6.0], M)
    assert slow["busy"] == [M * 3.0, M * 9.0]
    # the slow stage computes back to back once the first micro-batch reaches it: start at t_f0,
    # then M·(f1 + b1),
    # then stage 0's last backward
    assert slow["makespan"] == pytest.approx(1.0 + M * 9.0 + 2.0)
    assert slow["bubble_fraction"] > pipeline.bubble_fraction("1f1b", 2, M)
    with pytest.raises(ValueError, match="one time per stage"):
        theory.simulate_stages([1.0, 1.0], [1.0], 2)


def brute_force(spec, enc, stages, **kw):
    n = spec.n_layers
    best = None
    for cut in itertools.combinations_with_replacement(range(n + 1), stages - 1):
        split = tuple(b - a for a, b in zip((0,) + cut, cut + (n,)))
        worst = max(
            c["forward_flops"] + c["backward_flops"]
            for c in theory.stage_costs(spec, enc, split=split, **kw)
        )
        best = min(best or (worst, split), (worst, split), key=lambda x: x[0])
    return best


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("enc_layers", [1, 6, 24])
def test_balanced_split_minimises_the_slowest_stage(stages, enc_layers):
    spec, enc = specs(SIZES["tiny"])
    enc = theory.EncoderSpec(
        tokens=enc.tokens,
        hidden=enc.hidden,
        n_layers=enc_layers,
        n_heads=enc.n_heads,
        ffn_hidden=enc.ffn_hidden,
        patch_dim=enc.patch_dim,
    )
    kw = dict(text_tokens=24, mbs=2)
    split = theory.balanced_split(spec, enc, stages=stages, **kw)
    worst = max(
        c["forward_flops"] + c["backward_flops"]
        for c in theory.stage_costs(spec, enc, split=split, **kw)
    )
    assert worst == brute_force(spec, enc, stages, **kw)[0]
    if enc_layers == 24:  # a heavy encoder keeps stage 0 to itself
        assert split[0] == 0


def test_rebalancing_the_course_pipeline():
    spec, enc = specs(SIZES["tiny"])
    kw = dict(text_tokens=24, mbs=2, microbatches=4)
    alone = theory.pipeline_balance(spec, enc, split=(0, 4), **kw)
    fixed = theory.pipeline_balance(
        spec, enc, split=theory.balanced_split(spec, enc, stages=2, text_tokens=24, mbs=2), **kw
    )
    assert alone["imbalance"] > 1.5 and fixed["imbalance"] < alone["imbalance"]
    assert (
        fixed["step_time"] < alone["step_time"]
        and fixed["bubble_fraction"] < alone["bubble_fraction"]
    )
    # equal stages are the floor
    assert fixed["bubble_fraction"] >= fixed["balanced_bubble_fraction"] - 1e-12
    assert alone["step_time"] >= alone["ideal_step_time"]


@pytest.mark.parametrize(
    "pp, zero, dp, tp", [(1, 0, 1, 1), (2, 1, 2, 1), (4, 3, 4, 2), (4, 0, 1, 4)]
)
def test_memory_with_encoder_adds_to_the_calculator(pp, zero, dp, tp):
    spec = preset("llama3-8b")
    enc = theory.ENCODERS["siglip-so400m"]
    kw = dict(mbs=1, zero=zero, dp=dp, tp=tp, pp=pp, microbatches=8)
    mem = theory.memory_per_rank_with_encoder(spec, enc, text_tokens=1000, **kw)
    calc = memory_per_rank(spec, seq=enc.tokens + 1000, **kw)
    assert (
        [s["decoder_bytes"] for s in mem["stages"]]
        == calc["stage_total_bytes"]
        == mem["decoder_only_bytes"]
    )
    assert (
        all(s["encoder_bytes"] == 0 for s in mem["stages"][1:])
        and mem["stages"][0]["encoder_bytes"] > 0
    )
    acts = theory.encoder_activation_bytes(
        enc,
        mbs=1,
        text_hidden=spec.hidden,
        dtype_bytes=2,  # bf16
    )["total"]
    params = theory.encoder_param_counts(enc, text_hidden=spec.hidden)["total"]
    # linear in Ψ
    state = state_bytes(params, precision="bf16-mixed", zero=zero, dp=dp)["total_bytes"]
    assert mem["stages"][0]["encoder_bytes"] == pytest.approx(
        state + mem["stages"][0]["in_flight"] * acts
    )
    assert mem["total_bytes"] == max(mem["stage_total_bytes"])


def test_memory_with_encoder_rejects_bad_input():
    spec = preset("llama3-8b")
    enc = theory.EncoderSpec()
    with pytest.raises(ValueError, match="split=.* pp=2"):
        theory.memory_per_rank_with_encoder(
            spec, enc, text_tokens=10, mbs=1, pp=2, split=(1, 2, 29)
        )
    with pytest.raises(ValueError, match="tp"):
        theory.memory_per_rank_with_encoder(spec, enc, text_tokens=10, mbs=1, tp=3)
    with pytest.raises(ValueError, match="encoder hidden=10 is not divisible by n_heads=4"):
        theory.EncoderSpec(hidden=10)
    with pytest.raises(ValueError, match="encoder='vit-huge' is not one of"):
        theory.encoder_spec("vit-huge")
    with pytest.raises(ValueError, match="split=.*32 layers in all"):
        theory.check_split((0, 3), n_layers=32)


def test_planner_with_an_encoder():
    spec = preset("llama3-8b")
    enc = theory.ENCODERS["siglip-so400m"]
    r = multimodal_plan.plan_with_encoder(
        spec,
        enc,
        text_tokens=1024,
        gpus=16,
        gpus_per_node=8,
        gpu_mem_gib=80,
        layout=dict(dp=4, tp=1, pp=4, cp=1, zero=1),
        global_batch=1024,
    )
    assert r["seq"] == 729 + 1024 and r["split"] == (8, 8, 8, 8)
    assert r["memory"]["total_bytes"] > r["decoder"]["memory_bytes"]  # stage 0 carries the encoder
    assert r["stage_time_s"][0] > r["decoder_only_stage_time_s"][0]
    assert r["stage_time_s"][1:] == r["decoder_only_stage_time_s"][1:]
    assert r["rebalanced_step_time_s"] < r["step_time_s"] and r["rebalanced_bubble"] < r["bubble"]
    assert max(r["rebalanced_stage_time_s"]) < max(r["stage_time_s"])
    chosen = multimodal_plan.plan_with_encoder(
        spec, enc, text_tokens=1024, gpus=64, gpus_per_node=8, gpu_mem_gib=80
    )
    assert (
        chosen["layout"]["dp"]
        * chosen["layout"]["tp"]
        * chosen["layout"]["pp"]
        * chosen["layout"]["cp"]
        == 64
    )
    flat = multimodal_plan.plan_with_encoder(
        spec,
        enc,
        text_tokens=1024,
        gpus=16,
        gpus_per_node=8,
        gpu_mem_gib=80,
        layout=dict(dp=16, tp=1, pp=1, cp=1, zero=3),
        global_batch=1024,
    )
    assert flat["split"] is None and flat["step_time_s"] > flat["decoder"]["step_time_s"] > 0


def test_cli_and_no_torch():
    argv = ["multimodal", "--text-tokens", "1024", "--gpus", "16", "--layout", "4,1,4,1,1"]
    r = cli.run([*argv, "--global-batch", "1024"])
    text = multimodal_plan.format_result(r)
    assert json.loads(json.dumps(r))["layout"]["pp"] == 4  # the --json output
    assert "rebalanced" in text and "split (8, 8, 8, 8)" in text and len(r["memory_gib"]) == 4
    with pytest.raises(ValueError, match="layout='4,1' must be five integers"):
        cli.run(["multimodal", "--text-tokens", "10", "--gpus", "16", "--layout", "4,1"])
    assert_torch_free("import labs.theory.multimodal")


def test_tp_collectives_count_caption_tokens_for_the_embedding_and_loss():
    spec, _ = specs(SIZES["tiny"])
    calls = theory.tp_collectives(spec, tp=2, batch=8, n_prefix=16, caption_len=24)
    by = {c["where"]: c for c in calls}
    assert by["tok_emb"]["payload_bytes"] == 8 * 24 * 64 * 4
    assert by["layers.0.attn output"]["payload_bytes"] == 8 * 40 * 64 * 4
    assert by["loss: max logit"]["payload_bytes"] == 4 * 8 * 24


def test_rebalancing_from_measured_times():
    from labs.experiments.multimodal_timeline import measured_split

    cfg = SIZES["timing"]
    spec, _ = specs(cfg)
    f = theory.decoder_flops(spec, seq=cfg.seq_len, mbs=1)
    # a fake measurement: every layer 1 s, the head (~0.16 s) in its FLOP ratio to a layer
    layer = 1.0
    row = {"split": (0, 4), "stage_time": [4.5, 4 * layer + layer * f["head"] / f["per_layer"]]}
    # the encoder (4.5 s) outweighs the other stage already
    assert measured_split(row, cfg) == (0, 4)
    row["stage_time"][0] = 3.0
    assert measured_split(row, cfg) == (1, 3)  # 4 vs 3.16 beats 3 vs 4.16
    row["stage_time"][0] = 0.5
    assert measured_split(row, cfg) == (2, 2)
    assert measured_split(row, cfg, stages=3) == (1, 2, 1)
    with pytest.raises(ValueError, match="split=\\(1, 3\\)"):
        measured_split({"split": (1, 3), "stage_time": [1, 1]}, cfg)
