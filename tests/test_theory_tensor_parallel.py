"""Tensor-parallel theory (no processes): per-block collectives, shapes, parameter bytes, the
sharding visualizer."""

import pytest

from labs.models.transformer import ModelConfig, build_model
from labs.theory import tensor_parallel as theory
from labs.theory.memory import ModelSpec
from labs.theory.presets import PRESETS

SPEC = theory.COURSE_MODEL
LLAMA3_70B = PRESETS["llama3-70b"]


def test_course_spec_is_the_course_model():
    cfg = ModelConfig()
    assert SPEC == PRESETS["tiny"]
    assert (SPEC.vocab_size, SPEC.hidden, SPEC.n_layers, SPEC.n_heads, SPEC.kv_heads, SPEC.ffn) == (
        cfg.vocab_size,
        cfg.n_embd,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.ffn_hidden,
    )


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_per_block_collectives_are_megatrons(tp):
    B = 4
    T = 64
    e = 2
    k = B * T * SPEC.hidden * e
    ring = 2 * (tp - 1) / tp * k
    plain = (
        theory.comm_summary(SPEC, tp=tp, batch=B, seq=T, dtype_bytes=e)["block"]
        if tp <= 4
        else None
    )
    if plain is not None:  # the course model's 4 kv heads do not split over 8
        assert plain == {
            p: {"all_reduce": {"calls": 2, "payload_bytes": 2 * k, "sent_bytes": 2 * ring}}
            for p in ("forward", "backward")
        }
    spec = LLAMA3_70B
    k = B * T * spec.hidden * e
    sp = theory.comm_summary(spec, tp=tp, sp=True, batch=B, seq=T, dtype_bytes=e)["block"]
    no_sp = theory.comm_summary(spec, tp=tp, sp=False, batch=B, seq=T, dtype_bytes=e)["block"]
    for phase in ("forward", "backward"):
        ag = sp[phase]["all_gather"]
        rs = sp[phase]["reduce_scatter"]
        assert (
            ag["calls"] == rs["calls"] == 2 and ag["payload_bytes"] == rs["payload_bytes"] == 2 * k
        )
        # an all-reduce is a reduce-scatter plus an all-gather: SP moves the same bytes
        assert ag["sent_bytes"] + rs["sent_bytes"] == no_sp[phase]["all_reduce"]["sent_bytes"]
    assert "all_reduce" not in sp["forward"]
    assert sp["backward"]["all_reduce"] == {
        "calls": 2,
        "payload_bytes": 2 * spec.hidden * e,
        "sent_bytes": 2 * 2 * (tp - 1) / tp * spec.hidden * e,
    }


def test_model_collectives_are_the_blocks_plus_embedding_head_and_loss():
    B = 8
    T = 32
    tp = 4
    k = B * T * SPEC.hidden * 4
    n_tok = B * T
    model = theory.comm_summary(SPEC, tp=tp, batch=B, seq=T)["model"]
    # blocks, tok_emb's g, the loss
    assert model["forward"]["all_reduce"]["calls"] == 2 * SPEC.n_layers + 1 + 2
    assert (
        model["forward"]["all_reduce"]["payload_bytes"]
        == (2 * SPEC.n_layers + 1) * k + 4 * n_tok + 8 * n_tok
    )
    assert model["backward"]["all_reduce"]["calls"] == 2 * SPEC.n_layers + 1  # blocks, lm_head's f
    with_sp = theory.comm_summary(SPEC, tp=tp, sp=True, batch=B, seq=T)["model"]
    assert (
        with_sp["forward"]["all_gather"]["calls"]
        == with_sp["forward"]["reduce_scatter"]["calls"]
        == 2 * 2 + 1
    )
    assert with_sp["backward"]["all_reduce"]["calls"] == 2 * SPEC.n_layers + 1  # every norm weight


def test_block_flow_shapes():
    flow = theory.block_flow(SPEC, tp=4, sp=True, batch=2, seq=32)
    shapes = {step["op"]: step["shape"] for step in flow if step["kind"] == "compute"}
    assert shapes["attn_norm"] == (2, 8, 64) and shapes["attention input"] == (2, 32, 64)
    assert shapes["q_proj"] == (2, 32, 16) and shapes["k_proj, v_proj"] == (2, 32, 8)
    assert shapes["gate_proj, up_proj"] == (2, 32, 32) and shapes["x + MLP"] == (2, 8, 64)
    collectives = [s for s in flow if s["kind"] == "collective"]
    assert [c["forward"] for c in collectives] == [
        None,
        "all_gather",
        "reduce_scatter",
        None,
        "all_gather",
        "reduce_scatter",
    ]
    plain = theory.block_flow(SPEC, tp=4, batch=2, seq=32)
    assert [c["op"] for c in plain if c["kind"] == "collective"] == ["f", "g", "f", "g"]


def test_weight_shards():
    shards = {w["name"]: w for w in theory.weight_shards(SPEC, tp=4)}
    assert shards["attn.q_proj"]["rank_shape"] == (16, 64)
    assert shards["attn.k_proj"]["rank_shape"] == (8, 64)
    assert shards["attn.o_proj"]["rank_shape"] == (64, 16)
    assert shards["mlp.down_proj"]["rank_shape"] == (64, 32)
    assert shards["tok_emb"]["rank_shape"] == (64, 64)
    assert shards["attn_norm"]["rank_shape"] == (64,)


@pytest.mark.parametrize("tie", [False, True])
def test_param_bytes_per_rank_add_up_to_the_model(tie):
    cfg = ModelConfig(tie_embeddings=tie)
    model = build_model(cfg)
    spec = ModelSpec(
        vocab_size=cfg.vocab_size,
        hidden=cfg.n_embd,
        n_layers=cfg.n_layer,
        n_heads=cfg.n_head,
        n_kv_heads=cfg.n_kv_head,
        ffn_hidden=cfg.ffn_hidden,
        tied_embeddings=tie,
    )
    unique = {id(p): p for p in model.parameters()}.values()
    replicated = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    for tp in (1, 2, 4):
        figures = theory.param_bytes_per_rank(spec, tp=tp)
        assert figures["unsharded_bytes"] == 4 * sum(p.numel() for p in unique)
        assert figures["replicated_params"] == replicated
        assert figures["params"] * tp == figures["sharded_params"] + tp * replicated


def test_tensor_parallelism_belongs_inside_a_node():
    nvlink, infiniband = theory.LINKS.values()
    rows = {
        tp: {
            name: theory.layer_comm_vs_compute(LLAMA3_70B, tp=tp, seq=4096, link_gbs=gbs)
            for name, gbs in (("nvlink", nvlink), ("ib", infiniband))
        }
        for tp in (2, 4, 8, 16)
    }
    sent = [rows[tp]["nvlink"]["sent_bytes"] for tp in (2, 4, 8, 16)]
    # 2(N-1)/N: bytes per rank barely grow with tp
    assert sent == sorted(sent) and sent[-1] < 2 * sent[0]
    assert rows[8]["nvlink"]["comm_over_compute"] < 0.25 < 1 < rows[8]["ib"]["comm_over_compute"]
    assert rows[8]["nvlink"]["sent_bytes"] == 4 * 2 * 7 / 8 * 4096 * 8192 * 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3), "n_head=8 is not divisible by tp=3"),
        (dict(tp=8), "n_kv_head=4 is not divisible by tp=8"),
        (dict(tp=2, sp=True, seq=31), "seq=31 is not divisible by tp=2"),
        (dict(tp=0), "tp must be an integer >= 1"),
        (dict(tp=2, batch=0), "batch must be an integer >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        theory.collectives(SPEC, **kwargs)
    with pytest.raises(ValueError, match="arch='gpt'"):
        theory.check(ModelSpec(arch="gpt"), tp=1)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True), (4, False), (4, True)])
def test_sharding_visualizer_draws_headless(tp, sp):
    import matplotlib.pyplot as plt

    from labs.widgets.tensor_parallel import (
        draw_block_sharding,
        plot_layer_comm,
        sharding_visualizer,
    )

    fig, flow, comm = draw_block_sharding(tp=tp, sp=sp)
    assert sum(s["kind"] == "collective" for s in flow) == (6 if sp else 4)
    assert comm == theory.comm_summary(SPEC, tp=tp, sp=sp, batch=8, seq=32)["block"]
    plt.close(fig)
    assert plot_layer_comm(LLAMA3_70B).get_lines()
    plt.close("all")
    box = sharding_visualizer(tp=tp, sp=sp)
    assert box.children[0].children[0].value == tp
    plt.close("all")
