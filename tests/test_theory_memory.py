"""The memory calculator (labs.theory.memory and friends), checked against real models and real
tensors.

Presets against ``transformers`` models on the meta device; TP/PP parameter splits against the
shapes of real parameters cut the Megatron way; optimizer state against torch's optimizers;
FLOPs against ``FlopCounterMode``; activation splits against the playbook's closed forms. The
activation formula itself is checked against saved-tensor measurement in test_memory_lab.py.
Theory and harness only: not marked exercise.
"""

import dataclasses
import json
import math

import pytest
import torch

from labs.measure import state_bytes as measured_state
from labs.measure.memory import optimizer_bytes, tensor_bytes
from labs.models.hf import llama_config, meta_model
from labs.models.transformer import ModelConfig, build_model, count_params
from labs.theory.activations import (
    layer_terms,
    playbook_layer_bytes,
    stage_activation_bytes,
    terms_bytes,
)
from labs.theory.flops import flops_per_token, matmul_params, training_flops
from labs.theory.memory import (
    GIB,
    fits,
    layers_on_stage,
    memory_per_rank,
    param_count,
    param_counts,
    param_counts_per_rank,
    stage_params,
    state_bytes,
)
from labs.theory.memory_report import (
    compare,
    evaluate,
    format_rows,
    format_terms,
    model_spec,
    spec_dims,
    sweep,
)
from labs.theory.pipeline import in_flight_microbatches
from labs.theory.presets import GPUS, PRESETS
from tests.helpers import TINY_MODEL_ARGS, assert_torch_free, find_widget, run_cli

TINY = PRESETS["tiny"]


# ---------------------------------------------------------------- parameter counts


def llama3(**dims):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, rope_theta=500000.0, **dims)


HF_CONFIGS = {  # the published dimensions, written out independently of the presets
    "llama3-8b": lambda: llama3(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama3-70b": lambda: llama3(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "llama3-405b": lambda: llama3(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
    ),
    "llama3.2-1b": lambda: llama3(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    # 12 layers, 768 wide, 50257 tokens, tied
    "gpt2-small": lambda: __import__("transformers").GPT2Config(),
    "tiny": lambda: llama_config(ModelConfig()),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_preset_counts_equal_transformers_models(name):
    model = meta_model(HF_CONFIGS[name]())
    assert param_count(PRESETS[name]) == sum(p.numel() for p in model.parameters())


def test_tiny_preset_is_the_course_model():
    assert param_count(TINY) == count_params(build_model(ModelConfig()))
    tied = dataclasses.replace(TINY, tied_embeddings=True)
    assert param_count(tied) == count_params(build_model(ModelConfig(tie_embeddings=True)))


def megatron_shard_numel(name: str, shape, tp: int) -> int:
    """Rank 0's share of one real parameter, cut as Megatron cuts it (vocabulary: ceil rows)."""
    # output dim split
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc")
    row = ("o_proj", "down_proj", "attn.c_proj.weight", "mlp.c_proj.weight")  # input dim split
    numel = math.prod(shape)
    if any(k in name for k in ("tok_emb", "lm_head", "wte")):
        return numel // shape[0] * math.ceil(shape[0] / tp)
    if any(k in name for k in row):
        dim = 0 if "c_proj" in name else 1  # GPT-2's Conv1D stores [in, out]
        return numel // tp if shape[dim] % tp == 0 else pytest.fail(f"{name} {shape} not divisible")
    if any(k in name for k in column):
        return numel // tp  # weights and (GPT-2) column-parallel biases
    return numel  # norms, GPT-2 position table and row-parallel biases: replicated


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_params_match_megatron_split_of_real_models(tp):
    # 250 rows: the vocab split is uneven for tp=4
    course = build_model(ModelConfig(vocab_size=250))
    spec = dataclasses.replace(TINY, vocab_size=250)
    assert param_counts_per_rank(spec, tp=tp)["total"] == sum(
        megatron_shard_numel(n, p.shape, tp) for n, p in course.named_parameters()
    )
    gpt2 = meta_model(HF_CONFIGS["gpt2-small"]())
    assert param_counts_per_rank(PRESETS["gpt2-small"], tp=tp)["total"] == sum(
        megatron_shard_numel(n, p.shape, tp) for n, p in gpt2.named_parameters()
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_per_rank_counts_reduce_to_the_full_count(name):
    spec = PRESETS[name]
    assert param_counts_per_rank(spec, tp=1) == param_counts(spec)
    assert stage_params(spec) == param_count(spec)


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_pipeline_stages_hold_every_layer_once(pp):
    spec = dataclasses.replace(TINY, n_layers=7)
    model = build_model(ModelConfig(n_layer=7))
    assert sum(layers_on_stage(7, pp, s) for s in range(pp)) == 7
    start = 0
    # stage s: its blocks, plus the embedding (first) or final norm and head (last)
    for s in range(pp):
        layers = model.layers[start : start + layers_on_stage(7, pp, s)]
        start += len(layers)
        modules = (
            [*layers]
            + ([model.tok_emb] if s == 0 else [])
            + ([model.norm, model.lm_head] if s == pp - 1 else [])
        )
        assert stage_params(spec, pp=pp, stage=s) == sum(
            p.numel() for m in modules for p in m.parameters()
        )
    tied = dataclasses.replace(TINY, tied_embeddings=True)
    extra = TINY.vocab_size * TINY.hidden if pp > 1 else 0  # the last stage's copy of a tied head
    assert sum(stage_params(tied, pp=pp, stage=s) for s in range(pp)) == param_count(tied) + extra


# ---------------------------------------------------------------- training state


@pytest.mark.parametrize(
    "optimizer, make",
    [
        ("adamw", lambda p: torch.optim.AdamW(p, foreach=False)),
        ("adam", lambda p: torch.optim.Adam(p, foreach=False)),
        ("sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False)),
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, foreach=False)),
    ],
)
def test_fp32_state_equals_torch_optimizer_state(optimizer, make):
    model = build_model(ModelConfig())
    opt = make(model.parameters())
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    got = measured_state(model, opt)
    want = state_bytes(count_params(model), precision="fp32", optimizer=optimizer)
    assert (got["params"], got["grads"], got["optimizer"]) == (
        want["param_bytes"],
        want["grad_bytes"],
        want["optimizer_bytes"],
    )


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_exact_shards_equal_a_padded_flat_buffer_split(zero):
    """A ZeRO rank's tensors, built the flat-buffer way and measured.

    The flat-buffer way: pad to a multiple of N, take 1/N."""
    n_params = count_params(build_model(ModelConfig()))
    dp = 3
    flat = torch.zeros(math.ceil(n_params / dp) * dp)  # the padded flat buffer every rank cuts
    shard = flat.chunk(dp)[dp - 1].clone()
    full = torch.zeros(n_params)
    params = (shard if zero == 3 else full).clone()
    grads = (shard if zero >= 2 else full).clone()
    # what this rank's optimizer updates
    stepped = (shard if zero >= 1 else full).clone().requires_grad_()
    stepped.grad = torch.zeros_like(stepped)
    opt = torch.optim.AdamW([stepped], foreach=False)
    opt.step()
    want = state_bytes(n_params, precision="fp32", zero=zero, dp=dp, exact_shards=True)
    assert (tensor_bytes(params), tensor_bytes(grads), optimizer_bytes(opt)) == (
        want["param_bytes"],
        want["grad_bytes"],
        want["optimizer_bytes"],
    )


def test_zero_stages_follow_the_playbook_and_use_the_stage_params():
    spec = PRESETS["llama3-8b"]
    psi = param_count(PRESETS["llama3-8b"])
    rows = [memory_per_rank(spec, seq=4096, mbs=1, zero=z, dp=8) for z in range(4)]
    # bf16-mixed: 2 + 2 + 12 bytes per parameter
    k = 12
    n = 8
    assert [
        r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in rows
    ] == pytest.approx(
        [
            (2 + 2 + k) * psi,
            (2 + 2) * psi + k * psi / n,
            2 * psi + (2 + k) * psi / n,
            (2 + 2 + k) * psi / n,
        ]
    )
    assert len({r["activation_bytes"] for r in rows}) == 1  # ZeRO does not touch activations
    r = memory_per_rank(spec, seq=4096, mbs=1, tp=4, pp=2, zero=1, dp=2, fp32_grad_accum=True)
    assert r["grad_bytes"] == (2 + 4) * stage_params(spec, tp=4, pp=2, stage=r["stage"])


# ---------------------------------------------------------------- activations under parallelism


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_path_is_the_playbooks_formula_with_the_attention_term_split(tp, sp):
    if sp and tp == 1:
        return
    spec = PRESETS["gpt2-small"]
    seq = 2048
    mbs = 2
    ours = terms_bytes(layer_terms(spec, seq=seq, dtype_bytes=2), seq=seq, mbs=mbs, tp=tp, sp=sp)
    assert ours == pytest.approx(
        playbook_layer_bytes(seq=seq, mbs=mbs, hidden=768, heads=12, tp=tp, sp=sp)
    )
    full = terms_bytes(layer_terms(spec, seq=seq, dtype_bytes=2), seq=seq, mbs=mbs)
    assert ours == pytest.approx(
        full / tp if sp else full - (1 - 1 / tp) * (24 * 768 + 5 * 12 * seq) * seq * mbs
    )
    selective = terms_bytes(
        layer_terms(spec, seq=seq, dtype_bytes=2, recompute="selective"), seq=seq, mbs=mbs
    )
    assert selective == 34 * seq * mbs * 768  # Korthikanti's selective recomputation drops 5as/h


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_llama_activations_split_as_documented(recompute):
    spec = PRESETS["llama3-8b"]
    seq = 4096
    mbs = 2
    terms = layer_terms(spec, seq=seq, dtype_bytes=2, recompute=recompute)
    one = terms_bytes(terms, seq=seq, mbs=mbs)
    by_split = {
        s: sum(t.bytes for t in terms if t.split == s) * seq * mbs for s in ("tp", "sp", "rep")
    }
    assert one == sum(by_split.values())
    for tp in (2, 8):
        assert (
            terms_bytes(terms, seq=seq, mbs=mbs, tp=tp)
            == by_split["tp"] / tp + by_split["sp"] + by_split["rep"]
        )
        assert terms_bytes(terms, seq=seq, mbs=mbs, tp=tp, sp=True) == (
            (by_split["tp"] + by_split["sp"]) / tp + by_split["rep"]
        )
    assert terms_bytes(terms, seq=seq, mbs=mbs, cp=4) == one / 4
    if recompute == "none":  # with SP every tensor of a layer is split: the norm region too
        assert (
            by_split["rep"] == 0 and terms_bytes(terms, seq=seq, mbs=mbs, tp=8, sp=True) == one / 8
        )


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "tiny"])
def test_recomputation_orders_memory(name):
    mem = {
        r: memory_per_rank(PRESETS[name], seq=1024, mbs=1, recompute=r)["activation_bytes"]
        for r in ("none", "selective", "full")
    }
    assert mem["full"] < mem["selective"] < mem["none"]


@pytest.mark.parametrize("schedule, m", [("afab", 8), ("1f1b", 8), ("1f1b", 2), ("gpipe", 3)])
def test_pipeline_stages_hold_their_in_flight_microbatches(schedule, m):
    spec = PRESETS["llama3-8b"]
    pp = 4
    r = memory_per_rank(
        spec, seq=2048, mbs=1, pp=pp, microbatches=m, schedule=schedule, recompute="full"
    )
    per_stage = []
    for s in range(pp):
        per_mb = stage_activation_bytes(
            spec,
            seq=2048,
            mbs=1,
            dtype_bytes=2,
            layers=8,
            first=s == 0,
            last=s == pp - 1,
            recompute="full",
        )
        state = state_bytes(stage_params(spec, pp=pp, stage=s), precision="bf16-mixed")
        per_stage.append(
            state["total_bytes"] + in_flight_microbatches(schedule, pp, m, s) * per_mb["total"]
        )
    assert r["stage_total_bytes"] == pytest.approx(per_stage)
    assert r["total_bytes"] == max(per_stage)
    assert r["in_flight"] == in_flight_microbatches(schedule, pp, m, r["stage"])
    first = stage_activation_bytes(
        spec, seq=2048, mbs=1, dtype_bytes=2, layers=8, first=True, last=False
    )
    assert first["loss"] == first["final_norm"] == 0 and first["embedding"] > 0


def test_context_parallel_splits_activations_not_state():
    spec = PRESETS["llama3-8b"]
    one, four = (memory_per_rank(spec, seq=8192, mbs=1, cp=c) for c in (1, 4))
    assert four["param_bytes"] == one["param_bytes"]
    parts1 = one["activations_per_microbatch"]
    parts4 = four["activations_per_microbatch"]
    for part in ("layers", "embedding", "rotary", "final_norm"):
        assert parts4[part] == parts1[part] / 4
    # the loss weight is one scalar
    assert parts4["loss"] == pytest.approx((parts1["loss"] - 4) / 4 + 4)


# ---------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(
    "cfg", [ModelConfig(), ModelConfig(n_kv_head=8, tie_embeddings=True, n_layer=3)]
)
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_training_flops_equal_flop_counter(cfg, recompute):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from labs.experiments.memory import course_spec, forward_loss

    model = build_model(cfg)
    B = 2
    T = 48
    x = torch.randint(0, cfg.vocab_size, (B, T))
    # math SDPA: real matmuls
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        forward_loss(model, x, x, recompute=recompute).backward()
    spec = course_spec(cfg)
    assert counter.get_total_flops() == training_flops(
        spec, seq=T, tokens=B * T, recompute=recompute
    )
    assert matmul_params(spec) < param_count(spec)
    assert flops_per_token(spec, seq=T, exact=False) > flops_per_token(spec, seq=T)


# ---------------------------------------------------------------- validation and the CLI


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3), "n_head=8 is not divisible by tp=3"),
        (dict(tp=8), "n_kv_head=4 is not divisible by tp=8"),
        (dict(pp=3), "only n_layer=2 layers"),
        (dict(zero=1), "dp=1"),
        (dict(seq=-4), "seq must be an integer >= 1"),
        (dict(mbs=0), "mbs must be an integer >= 1"),
        (dict(sp=True), "tp=1"),
        (dict(cp=3), "seq=32 is not divisible by cp=3"),
        (dict(tp=2, sp=True, seq=34, cp=2), "cp*tp=4"),
        (dict(recompute="some"), "recompute="),
        (dict(precision="fp16"), "precision="),
        (dict(optimizer="lion"), "optimizer="),
        (dict(schedule="zb"), "schedule="),
        (dict(pp=2, microbatches=0), "microbatches must be"),
        (dict(precision="fp32", fp32_grad_accum=True), "fp32_grad_accum"),
    ],
)
def test_invalid_layouts_raise_naming_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        memory_per_rank(TINY, **{"seq": 32, "mbs": 2, **kwargs})


def memory_cli(*args):
    return run_cli("-m", "labs.theory", "memory", *args, timeout=60)


def test_cli_json_has_the_per_rank_figures():
    proc = memory_cli(
        "--preset",
        "llama3-8b",
        "--seq",
        "4096",
        "--mbs",
        "1",
        "--precision",
        "bf16-mixed",
        "--zero",
        "3",
        "--dp",
        "8",
        "--gpu-mem",
        "80",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = memory_per_rank(PRESETS["llama3-8b"], seq=4096, mbs=1, zero=3, dp=8)
    for key in (
        "params",
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "activation_bytes",
        "total_bytes",
    ):
        assert out[key] == expected[key]
    assert out["fits"] is True and out["verdict"].startswith("fits")
    free = memory_cli(
        *TINY_MODEL_ARGS,
        "--seq",
        "32",
        "--mbs",
        "8",
        "--precision",
        "fp32",
        "--json",
    )
    assert json.loads(free.stdout)["params"] == param_count(TINY)
    assert "fits" not in json.loads(free.stdout)
    table = memory_cli(
        "--preset", "llama3-70b", "--tp", "8", "--sp", "--pp", "2", "--gpu-mem", "24"
    )
    assert (
        table.returncode == 0
        and "does not fit" in table.stdout
        and "optimizer state" in table.stdout
    )


@pytest.mark.parametrize(
    "args, name",
    [
        (["--preset", "llama3-8b", "--tp", "3"], "tp=3"),
        (["--preset", "llama3-8b", "--tp", "16"], "n_kv_head=8"),
        (["--preset", "tiny", "--pp", "4"], "n_layer=2"),
        (["--preset", "tiny", "--zero", "3"], "dp=1"),
        (["--preset", "tiny", "--seq", "-5"], "seq"),
        (["--layers", "2", "--hidden", "-64", "--heads", "8", "--vocab", "256"], "hidden"),
        (["--preset", "llama4"], "preset='llama4'"),
        (["--hidden", "64"], "--layers"),
        (["--preset", "tiny", "--gpu-mem", "0"], "gpu_mem"),
    ],
)
def test_cli_rejects_bad_input_in_one_line(args, name):
    proc = memory_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], proc.stderr


def test_calculator_modules_do_not_import_torch():
    assert_torch_free(
        "import labs.theory.__main__ as m\n"
        "m.main(['memory', '--preset', 'llama3-70b', '--tp', '8', '--json'])\n"
        "import labs.theory.presets, labs.theory.flops, labs.theory.memory_report",
        timeout=60,
    )


# ---------------------------------------------------------------- the widget's logic, headless


def test_evaluate_gives_the_verdict_or_the_error():
    ok = evaluate(
        preset="llama3-8b", gpu_mem_gib=GPUS["H100 80GB"][0], seq=4096, mbs=1, zero=3, dp=8
    )
    assert ok["verdict"].startswith("fits") and ok["result"]["total_bytes"] < 80 * GIB
    big = evaluate(
        preset="llama3-70b", gpu_mem_gib=GPUS["H100 80GB"][0], seq=4096, mbs=1, zero=3, dp=8
    )
    assert big["verdict"].startswith("does not fit")
    assert not fits(big["result"]["total_bytes"], 79.6)
    bad = evaluate(preset="llama3-8b", gpu_mem_gib=80, seq=4096, mbs=1, tp=5)
    assert bad["result"] is None and "tp=5" in bad["verdict"]
    custom = evaluate(
        preset=None,
        dims=spec_dims(PRESETS["llama3-70b"]),
        gpu_mem_gib=80,
        seq=4096,
        mbs=1,
        zero=3,
        dp=8,
    )
    assert custom["result"] == big["result"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_spec_dims_round_trip(name):
    def shape(spec):  # None for kv-heads or F means "the default", which spec_dims writes out
        return (
            spec.arch,
            spec.vocab_size,
            spec.hidden,
            spec.n_layers,
            spec.n_heads,
            spec.kv_heads,
            spec.ffn,
            spec.hd,
            spec.tied_embeddings,
            spec.max_positions,
        )

    assert shape(model_spec(None, **spec_dims(PRESETS[name]))[1]) == shape(PRESETS[name])


def test_sweeps_and_tables():
    rows = sweep(PRESETS["llama3-8b"], "seq", [1024, 4096, 16384], mbs=1)
    assert [r["activation_bytes"] for r in rows] == sorted(r["activation_bytes"] for r in rows)
    assert len({r["param_bytes"] for r in rows}) == 1
    rows = sweep(PRESETS["llama3-8b"], "tp", [1, 3, 8], seq=4096, mbs=1)
    assert "error" in rows[1] and rows[2]["param_bytes"] < rows[0]["param_bytes"]
    with pytest.raises(ValueError, match="param='heads'"):
        sweep(TINY, "heads", [1])
    table = format_rows(
        compare(
            PRESETS["llama3-70b"],
            {"ZeRO-3": dict(zero=3, dp=8), "bad": dict(tp=3)},
            seq=4096,
            mbs=1,
        ),
        79.6,
    )
    assert "does not fit" in table and "invalid: n_head=64" in table
    assert "playbook" in format_terms(TINY, seq=32)


def test_drawings_and_the_widget_headless():
    from labs.widgets.memory import draw_breakdown, draw_sweep, memory_calculator

    result = memory_per_rank(PRESETS["llama3-8b"], seq=4096, mbs=1, zero=3, dp=8)
    fig = draw_breakdown(result, 79.6)
    assert len(fig.axes[0].patches) == 4 and fig.axes[0].lines[0].get_ydata()[0] == 79.6
    ax = draw_sweep(sweep(PRESETS["llama3-8b"], "tp", [1, 3], seq=4096, mbs=1), "tp", 79.6)
    assert any(t.get_text() == "invalid" for t in ax.texts)
    box = memory_calculator()

    def find(css_class):
        return find_widget(box, css_class)

    verdict = find("labs-memory-verdict")
    find("labs-memory-chart")
    assert "does not fit" in verdict.value  # Llama-3 8B, no sharding, on an H100
    find("labs-memory-dp").value = 8
    find("labs-memory-zero").value = 3
    assert "fits" in verdict.value and "does not fit" not in verdict.value
    find("labs-memory-preset").value = "llama3-70b"
    find("labs-memory-gpu").value = "H200 141GB"
    assert "does not fit" in verdict.value and "140.4 GiB" in verdict.value
    find("labs-memory-tp").value = 3
    assert "tp=3" in verdict.value
    find("labs-memory-tp").value = 1
    find("labs-memory-seq").value = 1024
    find("labs-memory-hidden").value = 4096  # editing a dimension makes the model custom
    assert find("labs-memory-preset").value == "custom" and "fits" in verdict.value


# ---------------------------------------------------------------- the playbook widget's controls


def test_head_dim_counts_like_transformers():
    """A head width other than hidden / heads (Gemma- or Qwen3-style): q and o are nh·hd wide."""
    from transformers import LlamaConfig

    spec = dataclasses.replace(TINY, head_dim=32)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    )
    assert param_count(spec) == sum(p.numel() for p in meta_model(config).parameters())
    assert param_count(spec) > param_count(TINY)
    wide = layer_terms(spec, seq=32, dtype_bytes=2)
    assert {t.name: t.bytes for t in wide}["q_rotated"] == 2 * 8 * 32


def test_mixture_of_experts_counts_like_mixtral_and_splits_by_ep():
    from transformers import MixtralConfig

    from labs.theory.moe import MIXTRAL_8X7B, moe_param_counts

    mixtral = dataclasses.replace(MIXTRAL_8X7B.dense, n_experts=8, top_k=2)
    assert param_count(mixtral) == moe_param_counts(MIXTRAL_8X7B)["total"]  # 46.7 B
    small = dataclasses.replace(TINY, n_experts=4, top_k=2)
    config = MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    assert param_count(small) == sum(p.numel() for p in meta_model(config).parameters())
    per_rank = param_counts_per_rank(mixtral, ep=4)["total"]
    assert per_rank == moe_param_counts(MIXTRAL_8X7B, ep=4)["per_rank"]
    # FLOPs count the router and the top-k experts a token runs through: the active parameters
    active = moe_param_counts(MIXTRAL_8X7B)["active"]
    embedding = mixtral.vocab_size * mixtral.hidden
    norms = mixtral.n_layers * 2 * mixtral.hidden + mixtral.hidden
    assert matmul_params(mixtral) == active - embedding - norms


def test_expert_parallelism_and_zero_shard_the_experts():
    moe = dataclasses.replace(PRESETS["llama3-8b"], n_experts=8, top_k=2)
    one = memory_per_rank(moe, seq=4096, mbs=1, zero=1, dp=8)
    ep = memory_per_rank(moe, seq=4096, mbs=1, zero=1, dp=8, ep=4)
    counts = param_counts(moe)
    dense = counts["total"] - counts["experts"]
    assert ep["params"] == dense + counts["experts"] // 4
    # experts are replicated over dp / ep = 2 ranks, which ZeRO-1 shards their optimizer over
    assert ep["optimizer_bytes"] == pytest.approx(12 * dense / 8 + 12 * counts["experts"] / 4 / 2)
    assert ep["total_bytes"] < one["total_bytes"]
    # activations: each token runs through top_k = 2 experts
    dense_mlp = sum(
        t.bytes
        for t in layer_terms(PRESETS["llama3-8b"], seq=4096, dtype_bytes=2)
        if t.name in ("gate", "silu_gate", "up", "swiglu_out")
    )
    moe_mlp = sum(
        t.bytes
        for t in layer_terms(moe, seq=4096, dtype_bytes=2)
        if t.name in ("gate", "silu_gate", "up", "swiglu_out")
    )
    assert moe_mlp == 2 * dense_mlp


def test_fp8_keeps_the_linear_inputs_in_one_byte():
    spec = PRESETS["llama3-8b"]
    plain = layer_terms(spec, seq=4096, dtype_bytes=2)
    fp8 = layer_terms(spec, seq=4096, dtype_bytes=2, fp8=True)
    halved = {t.name for t in plain if t.fp8}
    assert halved == {"attn_norm.output", "mlp_norm.output", "swiglu_out"}
    for a, b in zip(plain, fp8):
        assert b.bytes == (a.bytes / 2 if a.name in halved else a.bytes)
    r = memory_per_rank(spec, seq=4096, mbs=1, fp8=True)
    assert r["activation_bytes"] < memory_per_rank(spec, seq=4096, mbs=1)["activation_bytes"]
    with pytest.raises(ValueError, match="fp8=True runs the linear layers in FP8"):
        memory_per_rank(spec, seq=4096, mbs=1, fp8=True, precision="fp32")


def test_optimizer_bytes_and_cpu_offload():
    psi = param_count(TINY)
    eight_bit = state_bytes(psi, precision="bf16-mixed", optimizer_bytes=2)
    assert eight_bit["optimizer_bytes"] == (4 + 2) * psi  # fp32 master + 2 bytes of moments
    r = memory_per_rank(TINY, seq=32, mbs=2, optimizer_bytes=2)
    assert r["optimizer_bytes"] == eight_bit["optimizer_bytes"]
    plain = memory_per_rank(TINY, seq=32, mbs=2, zero=1, dp=2)
    off = memory_per_rank(TINY, seq=32, mbs=2, zero=1, dp=2, offload=True)
    assert off["optimizer_bytes"] == 0 and off["offloaded_bytes"] == plain["optimizer_bytes"]
    assert off["total_bytes"] == plain["total_bytes"] - plain["optimizer_bytes"]
    with pytest.raises(ValueError, match="optimizer_bytes .* must be a number >= 0"):
        memory_per_rank(TINY, seq=32, mbs=2, optimizer_bytes=-1)


def test_interleaved_and_zero_bubble_in_flight_activations():
    spec = PRESETS["llama3-8b"]
    kw = dict(seq=2048, mbs=1, pp=4, microbatches=8, recompute="full")
    zb = memory_per_rank(spec, schedule="zb-h1", **kw)
    one = memory_per_rank(spec, schedule="1f1b", **kw)
    # ZB-H1 holds min(P, M) on every stage (counted until each W); stage 0 as much as 1F1B's
    assert zb["stage_total_bytes"][0] == one["stage_total_bytes"][0]
    for stage in range(1, 4):
        per_mb = stage_activation_bytes(
            spec,
            seq=2048,
            mbs=1,
            dtype_bytes=2,
            layers=8,
            first=False,
            last=stage == 3,
            recompute="full",
        )["total"]
        extra = (stage) * per_mb  # the W's stage s postpones
        assert zb["stage_total_bytes"][stage] == pytest.approx(
            one["stage_total_bytes"][stage] + extra
        )
    inter = memory_per_rank(spec, schedule="interleaved", virtual=2, **kw)
    held = in_flight_microbatches("interleaved", 4, 8, inter["stage"], 2)
    # a middle stage holds its chunk micro-batches x (its layers / V) layers each
    middle = memory_per_rank(spec, schedule="interleaved", virtual=2, **kw)["stage_total_bytes"][1]
    chunk = stage_activation_bytes(
        spec, seq=2048, mbs=1, dtype_bytes=2, layers=4, first=False, last=False, recompute="full"
    )["total"]
    state = state_bytes(stage_params(spec, pp=4, stage=1), precision="bf16-mixed")["total_bytes"]
    assert middle == pytest.approx(
        state + in_flight_microbatches("interleaved", 4, 8, 1, 2) * chunk
    )
    assert inter["in_flight"] == held
    with pytest.raises(ValueError, match="virtual=2 splits pipeline stages into chunks but pp=1"):
        memory_per_rank(spec, seq=2048, mbs=1, virtual=2)
    with pytest.raises(ValueError, match="zb-h1 needs at least as many micro-batches"):
        memory_per_rank(spec, seq=2048, mbs=1, pp=4, microbatches=2, schedule="zb-h1")


def test_cli_has_the_new_controls():
    args = [
        "--preset",
        "llama3-8b",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--head-dim",
        "128",
        "--dp",
        "4",
        "--ep",
        "2",
        "--zero",
        "1",
        "--fp8",
        "--offload",
        "--optimizer-bytes",
        "2",
        "--pp",
        "2",
        "--schedule",
        "interleaved",
        "--virtual",
        "2",
        "--microbatches",
        "4",
        "--gpu-mem",
        "80GB",
    ]
    proc = memory_cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    spec = dataclasses.replace(PRESETS["llama3-8b"], n_experts=8, top_k=2, head_dim=128)
    want = memory_per_rank(
        spec,
        seq=4096,
        mbs=1,
        dp=4,
        ep=2,
        zero=1,
        fp8=True,
        offload=True,
        optimizer_bytes=2.0,
        pp=2,
        schedule="interleaved",
        virtual=2,
        microbatches=4,
    )
    for key in ("params", "total_bytes", "activation_bytes", "offloaded_bytes", "in_flight"):
        assert out[key] == want[key], key
    assert out["gpu_mem_gib"] == pytest.approx(80e9 / GIB)  # decimal GB, converted to GiB
    text = memory_cli(*args).stdout
    assert "in host memory" in text and "interleaved, V=2" in text and "fp8, offload" in text
    bad = memory_cli("--preset", "llama3-8b", "--ep", "2", "--dp", "2")
    assert bad.returncode == 2 and "ep=2 spreads experts over ranks but the model has none" in (
        bad.stderr
    )


def test_the_playbook_formula_beside_ours_with_the_ratio():
    """The playbook's s·b·h·(34 + 5as/h) is its model of GPT with eager attention: for Llama-3
    8B at 4,096 tokens it is about 4x the course model's bytes, not 40 % (the course model's
    own figure at 32 tokens)."""
    from labs.theory.memory_report import format_playbook_comparison, playbook_comparison

    rows = {r["model"]: r for r in playbook_comparison(4096)}
    assert rows["llama3-8b"]["ratio"] == pytest.approx(794624 / 200840)  # 3.96x
    assert rows["gpt2-small"]["ratio"] == 1.0  # for GPT the calculator *is* the playbook's
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        assert 3.5 < rows[name]["ratio"] < 4.5
    tiny = playbook_comparison(32, names=["tiny"])[0]
    assert tiny["ratio"] == pytest.approx(1.4, abs=0.05)  # notebook 01's "+40 %", at seq 32
    text = format_playbook_comparison(list(rows.values()))
    assert "ours (calculator)" in text and "playbook 34 + 5as/h" in text


def test_the_widget_has_the_new_controls_headless():
    from labs.widgets.memory import memory_calculator

    box = memory_calculator("llama3-8b", seq=4096, zero=1, dp=8)

    def find(css_class):
        return find_widget(box, css_class)

    verdict = find("labs-memory-verdict")

    def gib():  # the total the verdict quotes
        return float(verdict.value.split(": ")[1].split(" GiB")[0])

    base = gib()
    find("labs-memory-offload").value = True
    offloaded = gib()
    moved = 12 * param_count(PRESETS["llama3-8b"]) / 8 / GIB  # ZeRO-1's optimizer shard
    assert offloaded == pytest.approx(base - moved, abs=0.06)
    find("labs-memory-offload").value = False
    find("labs-memory-fp8").value = True
    assert gib() < base
    find("labs-memory-fp8").value = False
    find("labs-memory-optimizer-bytes").value = "2"
    assert gib() < base
    find("labs-memory-optimizer-bytes").value = "lots"
    assert "optimizer_bytes" in verdict.value and "cannot compute" in verdict.value
    find("labs-memory-optimizer-bytes").value = ""
    find("labs-memory-experts").value = 8
    find("labs-memory-top-k").value = 2
    moe = gib()
    assert moe > base and find("labs-memory-preset").value == "custom"
    find("labs-memory-ep").value = 8
    assert gib() < moe
    find("labs-memory-pp").value = 4
    find("labs-memory-schedule").value = "interleaved"
    find("labs-memory-virtual").value = 2
    find("labs-memory-microbatches").value = 8
    interleaved = gib()
    find("labs-memory-virtual").value = 1
    assert "virtual" not in verdict.value
    find("labs-memory-schedule").value = "1f1b"
    assert interleaved > gib()  # interleaving holds more chunk micro-batches at its peak
    find("labs-memory-schedule").value = "interleaved"
    find("labs-memory-virtual").value = 2
    find("labs-memory-microbatches").value = 6
    assert "cannot compute" in verdict.value and "microbatches divisible by stages" in verdict.value
