"""Exercise 04: tensor and sequence parallelism equal the single-process model, move exactly the
theory's collectives and bytes, hold the theory's bytes, and agree with torch's DTensor tensor
parallelism."""

import functools

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import tp as experiment
from labs.experiments.tp_parts import check_layers
from labs.measure import CommLedger
from labs.models.transformer import ModelConfig, build_model, rotary_cos_sin
from labs.runtime import exercise
from labs.theory import tensor_parallel as theory
from labs.train import rule
from tests.helpers import checks_ok, lab_json

# 1e-5: fp32, a sum over ranks adds in another order than one process
TOL = rule("value", torch.float32).rel
# The lab's parts (PARTS in labs/tensor_parallel.py): column/row-parallel linears, the parallel
# block and the plan are the core; the whole model needs the vocab-parallel embedding and loss (an
# extension), and SP its norms and operators (the next one); §11's overlap is the last.
VOCAB = pytest.mark.part("vocab-parallel")
SP = pytest.mark.part("sequence-parallel")


def whole_model_part(sp: bool):
    return SP if sp else VOCAB


CASES = [
    pytest.param((tp, sp, model), marks=whole_model_part(sp))
    for model in experiment.MODELS
    for tp in (2, 4)
    for sp in (False, True)
]


@functools.cache
def summary(tp: int, sp: bool, model: str) -> dict:
    """One 5-step run per case, shared by the tests below (each checks one promise of the lab)."""
    return experiment.run(nproc=tp, steps=5, sp=sp, model=model)


def case_id(case):
    tp, sp, model = case
    return f"{model}-tp{tp}{'-sp' if sp else ''}"


@pytest.mark.exercise
@pytest.mark.parametrize(
    "nproc, sp, vocab",
    [
        (2, False, False),
        pytest.param(2, False, True, marks=VOCAB),
        pytest.param(4, True, True, marks=SP),
    ],
)
def test_layers_equal_the_full_layers(nproc, sp, vocab):
    layers = check_layers(nproc=nproc, sp=sp, vocab=vocab)
    assert ("VocabParallelCrossEntropy" in layers) == vocab
    for name, diff in layers.items():
        assert diff["forward"] <= TOL and diff["backward"] <= TOL, (name, diff)


@pytest.mark.exercise
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_logits_loss_and_every_gradient_match_the_unsharded_model(case):
    s = summary(*case)
    assert s["max_rel_logit_diff"] <= TOL, s["max_rel_logit_diff"]
    assert s["max_rel_grad_diff"] <= TOL, (s["worst_grad"], s["max_rel_grad_diff"])
    assert abs(s["losses"][0] - s["reference_losses"][0]) <= TOL * s["reference_losses"][0]
    assert s["logits_shape_per_rank"] == [8, 32, 256 // case[0]]  # the vocabulary stays split


@pytest.mark.exercise
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_matches_the_reference_losses(case):
    s = summary(*case)
    assert s["steps"] == len(s["losses"]) == 5
    assert s["max_rel_loss_diff"] <= TOL, (s["losses"], s["reference_losses"])
    assert checks_ok(s, "losses equal on every rank") and s["matches_reference"]
    assert s["losses"][-1] < s["losses"][0]


@pytest.mark.exercise
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_collectives_and_bytes_per_rank_match_the_theory(case):
    tp, sp, _ = case
    s = summary(*case)
    # every rank: calls, payload, bytes sent, call by call
    assert s["comm"] == s["theory_comm"]
    bytes_checks = [c for c in s.checks if c.name.endswith(" bytes per call")]
    assert bytes_checks and all(c.ok for c in bytes_checks), s.verdict()
    assert s["comm_bytes_per_rank"] == [s["theory_comm_bytes_per_rank"]] * tp
    assert s["param_bytes_per_rank"] == [s["theory_param_bytes_per_rank"]] * tp
    calculator = experiment.memory_vs_calculator(s)["params"]["calculator"]  # notebook 01
    assert s["param_bytes_per_rank"][0] == calculator
    assert s["state_bytes_per_rank"] == [s["theory_state_bytes_per_rank"]] * tp
    assert s["saved_activation_bytes"] == [s["theory_saved_activation_bytes"]] * tp
    # notebook 04's table
    rows = [r.replace(",", "").split() for r in experiment.comm_table(s).splitlines()[1:]]
    assert len(rows) == sum(len(ops) for ops in s["comm"].values())  # one row per phase and op
    assert all(r[2:5] == r[5:8] for r in rows)  # measured calls, payload, sent = theory's


@pytest.mark.exercise
@SP
def test_tied_embeddings_share_one_vocab_shard():
    s = experiment.run(nproc=2, steps=2, sp=True, model_cfg=ModelConfig(tie_embeddings=True))
    assert s["matches_reference"] and s["max_rel_grad_diff"] <= TOL and s.passed, s.verdict()
    # the head adds no second shard
    assert s["param_bytes_per_rank"] == [s["theory_param_bytes_per_rank"]] * 2


@pytest.mark.exercise
@SP
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallelism_saves_activation_memory(tp):
    without = summary(tp, False, "course")
    with_sp = summary(tp, True, "course")
    saved = with_sp["saved_activation_bytes"][0]
    assert saved < without["saved_activation_bytes"][0]
    # what SP saves is exactly the norm region (residual inputs, 1/rms, normalised x) cut from T to
    # T/tp tokens
    norm_terms = [
        k
        for k in theory.saved_activation_bytes(theory.COURSE_MODEL, tp=tp)["per_block"]
        if "norm" in k
    ]
    parts = {
        sp_: theory.saved_activation_bytes(theory.COURSE_MODEL, tp=tp, sp=sp_, batch=8, seq=32)
        for sp_ in (0, 1)
    }
    region = sum(parts[0]["per_block"][k] for k in norm_terms) * 2 + sum(
        v for k, v in parts[0]["outside"].items() if k.startswith("final norm")
    )
    assert without["saved_activation_bytes"][0] - saved == region * (1 - 1 / tp)
    # The memory calculator (notebook 01) models Megatron's SP, which also keeps the column-parallel
    # inputs (2 per
    # block and the head's) sequence-sharded and gathers them again in backward: its saving is
    # larger by exactly those.
    calculator = {
        sp_: experiment.memory_vs_calculator(s)["saved activations"]["calculator"]
        for sp_, s in ((False, without), (True, with_sp))
    }
    gathered_inputs = (2 * theory.COURSE_MODEL.n_layers + 1) * 8 * 32 * 64 * 4
    assert (calculator[False] - calculator[True]) - (
        without["saved_activation_bytes"][0] - saved
    ) == gathered_inputs * (1 - 1 / tp)


def block_collectives(sp: bool) -> dict:
    """One parallel block's forward and backward under the ledger."""
    tp = exercise("tensor_parallel")
    cfg = ModelConfig()
    n = dist.get_world_size()
    r = dist.get_rank()
    block = tp.apply_tensor_parallel(build_model(cfg, 0), sequence_parallel=sp).layers[0]
    x = torch.randn(8, 32, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    x = (x.chunk(n, 1)[r] if sp else x).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(32), cfg.head_dim, cfg.rope_theta)
    with CommLedger() as ledger:
        with ledger.phase("forward"):
            y = block(x, cos, sin)
        with ledger.phase("backward"):
            y.sum().backward()
    return experiment.measured_comm(
        [
            (c.op.replace("_single", ""), c.phase, c.payload_bytes, c.sent_bytes)
            for c in ledger.records
        ]
    )


@pytest.mark.exercise
@pytest.mark.parametrize(
    "tp, sp",
    [(2, False), (4, False), pytest.param(2, True, marks=SP), pytest.param(4, True, marks=SP)],
)
def test_one_block_sends_what_the_formulas_say(tp, sp):
    k = 8 * 32 * 64 * 4  # B·T·H fp32
    for measured in launch(block_collectives, tp, sp):
        assert (
            measured
            == theory.comm_summary(theory.COURSE_MODEL, tp=tp, sp=sp, batch=8, seq=32)["block"]
        )
        if not sp:  # Megatron: 2 all-reduces of K per block forward, 2 backward
            assert measured == {
                p: {
                    "all_reduce": {
                        "calls": 2,
                        "payload_bytes": 2 * k,
                        "sent_bytes": 2 * 2 * (tp - 1) / tp * k,
                    }
                }
                for p in ("forward", "backward")
            }
        else:  # 2 all-gathers + 2 reduce-scatters each way: the same bytes as the 2 all-reduces
            for phase in ("forward", "backward"):
                ag = measured[phase]["all_gather"]
                rs = measured[phase]["reduce_scatter"]
                assert (
                    ag["calls"] == rs["calls"] == 2
                    and ag["payload_bytes"] == rs["payload_bytes"] == 2 * k
                )
                assert ag["sent_bytes"] + rs["sent_bytes"] == 2 * 2 * (tp - 1) / tp * k
            # the two norm weights
            assert measured["backward"]["all_reduce"]["payload_bytes"] == 2 * 64 * 4


def saved_shapes(sp: bool) -> dict:
    """Shapes of everything the TP model saves for backward, and the logits it returns."""
    tp = exercise("tensor_parallel")
    cfg = ModelConfig()
    model = tp.apply_tensor_parallel(build_model(cfg, 0), sequence_parallel=sp)
    idx = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, loss = model(idx, idx)
    loss.backward()
    return {"logits": tuple(logits.shape), "saved": shapes}


@pytest.mark.exercise
@pytest.mark.parametrize("sp", [pytest.param(False, marks=VOCAB), pytest.param(True, marks=SP)])
def test_vocab_parallel_loss_never_materialises_the_full_logits(sp):
    tp = 4
    B, T, V = 4, 32, 256
    for r in launch(saved_shapes, tp, sp):
        assert r["logits"] == (B, T, V // tp)
        assert r["saved"], "nothing was saved for backward"
        biggest = max(torch.Size(s).numel() for s in r["saved"])
        assert biggest <= B * T * V // tp, (
            f"a tensor of {biggest} elements (the full logits are {B * T * V}) was saved"
        )


def vocab_parallel_loss(targets: list[int], vocab: int = 16) -> dict:
    """Rank r's VocabParallelCrossEntropy of its vocabulary slice of seeded logits [N, V] (float64,
    where only the rounding of the sums remains) against ``targets`` [N]: the loss and the whole
    logits' gradient (the ranks' slices gathered), or the error it raised."""
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(targets), vocab, generator=g, dtype=torch.float64)  # [N, V]
    local = logits.chunk(n, -1)[dist.get_rank()].clone().requires_grad_()  # [N, V/tp]
    try:
        loss = exercise("tensor_parallel").VocabParallelCrossEntropy.apply(
            local, torch.tensor(targets), None
        )
    except IndexError as e:
        return {"error": str(e)}
    loss.backward()
    pieces = [torch.empty_like(local.grad) for _ in range(n)]
    dist.all_gather(pieces, local.grad.contiguous())
    return {"logits": logits, "loss": loss.detach(), "grad": torch.cat(pieces, -1)}


def unsharded_loss(logits: torch.Tensor, targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy as the unsharded model computes it (ignore_index=-100): loss, gradient."""
    logits = logits.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(targets))
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.exercise
@VOCAB
@pytest.mark.parametrize(
    "targets",
    [[3, -100, 15, 8, -100, 0], [-100] * 4],  # rows to ignore; every row ignored (loss nan)
    ids=["some-ignored", "all-ignored"],
)
def test_vocab_parallel_loss_ignores_index_minus_100_like_the_unsharded_loss(targets):
    for r in launch(vocab_parallel_loss, 2, targets):
        loss, grad = unsharded_loss(r["logits"], targets)
        assert torch.allclose(r["loss"], loss, rtol=1e-12, atol=0, equal_nan=True), (r, loss)
        assert torch.allclose(r["grad"], grad, rtol=1e-12, atol=1e-15), (r["grad"], grad)


@pytest.mark.parametrize("bad", [16, -1])
def test_vocab_parallel_loss_rejects_a_target_outside_the_vocabulary(bad):
    # the unsharded loss raises IndexError on such a target: so does the sharded one, on every
    # rank, before any collective (validation runs before the exercise code: not an exercise test)
    targets = [3, bad, -100]
    with pytest.raises(IndexError, match="out of bounds"):
        unsharded_loss(torch.zeros(3, 16, dtype=torch.float64), targets)
    for r in launch(vocab_parallel_loss, 2, targets):
        assert r == {"error": r["error"]} and f"target {bad} is out of bounds" in r["error"], r
        assert "0..15 (V=16) or ignore_index=-100" in r["error"]


def apply_under_ledger(config: dict) -> tuple[str, int]:
    """apply_tensor_parallel on a model the degree may not divide.

    Checks the error, and the collectives issued."""
    with CommLedger() as ledger:
        try:
            exercise("tensor_parallel").apply_tensor_parallel(build_model(ModelConfig(**config), 0))
        except ValueError as e:
            return str(e), ledger.calls()
    return "no error", ledger.calls()


@pytest.mark.parametrize(
    "tp, config, message",
    [
        (3, {}, "n_head=8 is not divisible by tp=3; use tp in {1,2,4} (they also divide"),
        (4, {"n_kv_head": 2}, "n_kv_head=2 is not divisible by tp=4"),
        (4, {"vocab_size": 250}, "vocab_size=250 is not divisible by tp=4"),
        (4, {"ffn_hidden": 130}, "ffn_hidden=130 is not divisible by tp=4"),
    ],
)
def test_a_degree_that_does_not_divide_is_a_clear_error_before_any_collective(tp, config, message):
    # validation is plumbing (it runs before the exercise code), so this holds for the stubs too:
    # not an exercise test
    for error, calls in launch(apply_under_ledger, tp, config):
        assert message in error and calls == 0, (error, calls)


def test_run_rejects_bad_arguments_before_starting_ranks():
    with pytest.raises(ValueError, match="n_head=8 is not divisible by tp=3"):
        experiment.run(nproc=3)
    with pytest.raises(ValueError, match="seq=30 is not divisible by tp=4"):
        experiment.run(nproc=4, sp=True, seq_len=30)
    with pytest.raises(ValueError, match="model='gpt2' is not one of"):
        experiment.run(nproc=2, model="gpt2")


@pytest.mark.exercise
@SP
def test_same_outputs_as_torch_dtensor_tensor_parallelism():
    s = experiment.run(nproc=2, steps=3, sp=True, vs_torch=True)
    assert s["torch_max_rel_logit_diff_vs_ours"] <= TOL
    assert s["torch_max_rel_loss_diff"] <= TOL and s["max_rel_loss_diff"] <= TOL
    assert s["step_time_s"] > 0 and s["torch_step_time_s"] > 0


@pytest.mark.exercise
@VOCAB
def test_torch_comparison_keeps_tied_embeddings_tied():
    """DTensor's plan gives the embedding and the head a sharded weight each: tied again, torch
    trains the reference's model (untied, its losses part from step 2 by ~4e-3)."""
    cfg = ModelConfig(tie_embeddings=True)
    s = experiment.run(nproc=2, steps=3, vs_torch=True, model_cfg=cfg)
    assert s["torch_max_rel_loss_diff"] <= TOL, (s["torch_losses"], s["reference_losses"])
    assert s.passed, s.verdict()


@pytest.mark.exercise
@VOCAB
def test_cli_reports_both_step_times():
    s = lab_json("tp", "--nproc", "4", "--steps", "3", "--vs-torch", "--json")
    assert s["lab"] == "tp" and s["nproc"] == 4 and s["matches_reference"] and s["passed"]
    assert s["step_time_s"] > 0 and s["torch_step_time_s"] > 0
    assert s["torch_max_rel_logit_diff_vs_ours"] <= TOL


def test_transformers_llama_converts_to_the_course_model_or_says_why_not():
    from transformers import LlamaConfig

    from labs.models.hf import build_hf_llama, llama_config
    from labs.models.hf_convert import course_config_from_hf, course_model_from

    cfg = ModelConfig(tie_embeddings=True, rope_theta=500000.0)
    hf = build_hf_llama(cfg, seed=3)
    course = course_model_from(hf)
    assert course.cfg == cfg
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(course(idx), hf(input_ids=idx).logits)  # the same model, bit for bit
    with pytest.raises(ValueError, match=r"\['attention_bias', 'head_dim'\]"):
        course_config_from_hf(
            LlamaConfig(**{**llama_config(cfg).to_dict(), "attention_bias": True, "head_dim": 16})
        )
    with pytest.raises(ValueError, match="course Transformer or a transformers LlamaForCausalLM"):
        course_model_from(torch.nn.Linear(2, 2))
