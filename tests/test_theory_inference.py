"""labs.theory.inference: KV-cache bytes (against published Llama figures and against transformers'
own cache), weights per rank (against the built model), messages per token, the latency model, the
cache capacity, the CLI front end and the widget's pure functions. Measured TP / placement figures
are in tests/test_inference.py."""

import pytest
import torch

from labs.theory import cli
from labs.theory import inference as inf
from labs.theory.comm import all_gather_bytes, all_reduce_bytes
from labs.theory.memory import GIB, ModelSpec
from labs.theory.presets import GPUS, PRESETS
from tests.helpers import assert_torch_free

# infer.CONFIG's model
TINY4 = ModelSpec(vocab_size=256, hidden=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128)


def test_kv_cache_per_position_for_llama3():
    # 2 (K and V) x layers x kv heads x head dim x 2 bytes (bf16)
    assert inf.kv_cache_bytes_per_token(PRESETS["llama3-8b"]) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert inf.kv_cache_bytes_per_token(PRESETS["llama3-70b"]) == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert inf.kv_cache_bytes_per_token(PRESETS["llama3-70b"], tp=8) == 2 * 80 * 1 * 128 * 2
    # tp=16 > 8 kv heads: each head replicated on 2 ranks, so a rank still holds one head
    assert inf.kv_heads_per_rank(PRESETS["llama3-405b"], tp=16) == 1
    assert inf.kv_cache_bytes_per_token(PRESETS["llama3-405b"], tp=16) == 2 * 126 * 128 * 2
    # placement: the stage's layers (first stages take the remainder), every head
    per_stage = [
        inf.kv_cache_bytes_per_token(TINY4, pp=3, stage=s, dtype_bytes=4) for s in range(3)
    ]
    assert per_stage == [2 * 2 * 4 * 8 * 4, 2 * 1 * 4 * 8 * 4, 2 * 1 * 4 * 8 * 4]
    assert (
        inf.kv_cache_bytes_per_rank(TINY4, batch=3, seq=10, tp=2, dtype_bytes=4)
        == 2 * 4 * 3 * 10 * 2 * 8 * 4
    )


def test_kv_cache_equals_transformers_own_cache():
    from labs.models.hf import to_hf_llama
    from labs.models.transformer import ModelConfig, build_model

    hf = to_hf_llama(build_model(ModelConfig(n_layer=4), seed=0))
    idx = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    out = hf.generate(
        input_ids=idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=5,
        eos_token_id=[],
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    held = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    # transformers caches every position but the last generated token's: 7 + 5 - 1
    assert held == inf.kv_cache_bytes_per_rank(TINY4, batch=3, seq=7 + 5 - 1, dtype_bytes=4)


def test_weights_per_rank_add_up_to_the_built_model():
    from labs.models.transformer import ModelConfig, build_model, count_params

    model = build_model(ModelConfig(n_layer=4))
    total = count_params(model) * 4
    assert inf.weight_bytes_per_rank(TINY4, mode="tp", degree=1, dtype_bytes=4) == [total]
    stages = inf.weight_bytes_per_rank(TINY4, mode="placement", degree=3, dtype_bytes=4)
    assert sum(stages) == total
    layer = sum(p.numel() for p in model.layers[0].parameters()) * 4
    assert stages[1] == layer and stages[0] == 2 * layer + model.tok_emb.weight.numel() * 4
    # TP: matrices split, norms replicated: N ranks hold more than the model by (N-1) copies of the
    # norms
    tp = inf.weight_bytes_per_rank(TINY4, mode="tp", degree=4, dtype_bytes=4)
    norms = (2 * 4 + 1) * 64 * 4
    assert 4 * tp[0] == total + 3 * norms


def test_collectives_and_messages_per_forward():
    B = 4
    t = 3
    N = 4
    L = 4
    H = 64
    tp = inf.forward_comm(TINY4, mode="tp", degree=N, batch=B, tokens=t, dtype_bytes=4)
    assert len(tp) == N and tp[0]["all_reduce"]["calls"] == 2 * L + 1
    assert tp[0]["all_reduce"]["sent_bytes"] == (2 * L + 1) * all_reduce_bytes(B * t * H * 4, N)
    assert tp[0]["all_gather"]["sent_bytes"] == all_gather_bytes(N * B * 2 * 8, N)
    pl = inf.forward_comm(TINY4, mode="placement", degree=N, batch=B, tokens=t, dtype_bytes=4)
    assert [r["send"]["payload_bytes"] for r in pl] == [B * t * H * 4] * (N - 1) + [B * 8]
    assert [r["recv"]["payload_bytes"] for r in pl] == [B * 8] + [B * t * H * 4] * (N - 1)
    assert inf.messages_per_forward(TINY4, mode="tp", degree=N) == 2 * L + 2
    assert inf.messages_per_forward(TINY4, mode="placement", degree=N) == N
    assert inf.forward_comm(TINY4, mode="tp", degree=1, batch=B) == [{}]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: inf.check(TINY4, mode="ring", degree=2), "mode='ring' is not one of"),
        (lambda: inf.check(TINY4, mode="tp", degree=3), "n_heads=8 is not divisible by tp=3"),
        (
            lambda: inf.check(PRESETS["llama3-70b"], mode="tp", degree=12),
            "n_heads=64 is not divisible by tp=12",
        ),
        (
            lambda: inf.check(TINY4, mode="placement", degree=5),
            "pp=5 stages but the model has 4 layers",
        ),
        (lambda: inf.kv_cache_bytes_per_token(TINY4, pp=2, stage=2), "stage=2 is outside 0..1"),
        (
            lambda: inf.decode_time(TINY4, mode="tp", degree=2, batch=1, context=8, gpu="TPU"),
            "gpu='TPU' is not one of",
        ),
        (lambda: inf.cache_capacity(TINY4, utilization=1.5), "utilization must be in"),
        (
            lambda: inf.kv_cache_bytes_per_rank(TINY4, batch=0, seq=4),
            "batch must be an integer >= 1",
        ),
    ],
)
def test_bad_input_names_the_parameter(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_latency_model_adds_placement_stages_and_overlaps_tp_ranks():
    assert inf.per_token_latency(compute_s=[1.0, 2.0], mode="tp", messages=3, message_s=0.5) == 3.5
    assert (
        inf.per_token_latency(compute_s=[1.0, 2.0], mode="placement", messages=2, message_s=0.5)
        == 4.0
    )


def test_decode_on_gpus_tp_cuts_latency_placement_only_adds_room():
    spec = PRESETS["llama3-70b"]
    tp = [inf.decode_time(spec, mode="tp", degree=n, batch=8, context=4096) for n in (1, 2, 4, 8)]
    pl = [
        inf.decode_time(spec, mode="placement", degree=n, batch=8, context=4096)
        for n in (1, 2, 4, 8)
    ]
    assert all(a["latency_s"] > b["latency_s"] for a, b in zip(tp, tp[1:]))
    assert all(a["latency_s"] <= b["latency_s"] for a, b in zip(pl, pl[1:]))  # the hops only add
    assert all(p["pipelined_tokens_per_s"] >= p["tokens_per_s"] for p in pl)
    assert not tp[0]["fits"] and tp[1]["fits"]  # 141 GB of bf16 weights: not on one 80 GB GPU
    # memory-bound: one H100 streams its weights and cache at 3.35 TB/s
    one = inf.decode_time(PRESETS["llama3-8b"], mode="tp", degree=1, batch=1, context=1024)
    assert one["latency_s"] == pytest.approx(one["bytes_read_per_rank"][0] / 3.35e12)


def test_cache_capacity_by_hand():
    spec = PRESETS["llama3-8b"]
    weights = inf.weight_bytes_per_rank(spec, mode="tp", degree=1)[0]
    expected = int((0.9 * GPUS["H100 80GB"][0] * GIB - weights) // (128 * 1024))
    assert inf.cache_capacity(spec)["tokens"] == expected
    assert inf.cache_capacity(PRESETS["llama3-70b"])["tokens"] == 0  # the weights alone do not fit
    # half the weights and half the cache per rank
    assert inf.cache_capacity(spec, tp=2)["tokens"] > 2 * expected


def test_cli_and_readable_result():
    result = cli.run(["infer", "--preset", "llama3-70b", "--degree", "8", "--batch", "8"])
    assert result["kv_bytes_per_token"] == 320 * 1024
    assert result["tp"]["kv_cache_bytes_per_rank"] == [8 * 4096 * 320 * 1024 // 8] * 8
    assert result["tp"]["latency_s"] < result["placement"]["latency_s"]
    text = inf.format_result(result)
    assert "tp" in text and "placement" in text and "ms/token" in text
    assert "llama3-70b" in inf.preset_table() and "gpt2-small" not in inf.preset_table()


def test_theory_and_widget_never_import_torch():
    assert_torch_free(
        "import labs.theory.inference as t, labs.widgets.inference as w\n"
        "from labs.theory.presets import PRESETS\n"
        "w.plot_decode_theory(PRESETS['llama3-8b'], batch=4, context=2048)"
    )


def test_widget_rows_and_explorer():
    import matplotlib.pyplot as plt

    from labs.widgets import inference as w

    rows = w.theory_rows(TINY4, batch=2, context=64, degrees=(1, 2, 4, 8))
    assert {(r["mode"], r["degree"]) for r in rows} == {
        ("tp", 1),
        ("tp", 2),
        ("tp", 4),
        ("tp", 8),
        ("placement", 1),
        ("placement", 2),
        ("placement", 4),
    }
    mode = {
        "latency_per_token_s": 0.002,
        "p90_latency_per_token_s": 0.003,
        "model_latency_per_token_s": 0.0025,
        "tokens_per_s": 900.0,
    }
    run = {
        "mode": "both",
        "nproc": 2,
        "single_latency_per_token_s": 0.001,
        "single_tokens_per_s": 1000.0,
        "tp": mode,
        "placement": dict(mode, latency_per_token_s=0.004),
    }
    measured = w.measured_rows([run, dict(run, nproc=4)])
    assert [(r["mode"], r["nproc"]) for r in measured] == [
        ("single", 1),
        ("tp", 2),
        ("placement", 2),
        ("tp", 4),
        ("placement", 4),
    ]
    assert "placement" in w.measured_table([run]) and "4.00" in w.measured_table([run])
    plt.close(w.plot_measured([run]))
    ui = w.latency_explorer(preset="llama3-8b")
    plt.close("all")
    assert len(ui.children) == 3
