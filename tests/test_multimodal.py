"""Exercise 11: the vision-language model trained pipeline-, data- and tensor-parallel equals the
single-process run on 2 and 4 ranks, sends and holds what the theory says; plus the model and the
data set (not exercise)."""

import functools

import pytest
import torch

from labs.data import shapes
from labs.experiments import multimodal as experiment
from labs.experiments import multimodal_timeline
from labs.experiments.common import SUMMARY_KEYS
from labs.models.vision import MultimodalConfig, build_multimodal, describe, fuse, to_hf_siglip
from labs.train import TrainConfig, multimodal_data_for, rule, train_multimodal_reference
from tests.helpers import checks_ok, lab_json

TOL = rule("value", torch.float32).rel  # 1e-5: fp32; sums split across ranks add in another order


@functools.cache
def summary(mode: str, nproc: int, **kw) -> dict:
    """One 4-step run per case, shared by the tests below."""
    return experiment.run(mode=mode, nproc=nproc, steps=4, **kw)


def assert_matches(s: dict) -> None:
    assert s["max_rel_loss_diff"] <= TOL, (s["losses"], s["reference_losses"])
    if s.get("zero"):  # ZeRO keeps gradient shards, not .grad: losses only
        assert s["max_rel_grad_diff"] is None
    else:
        assert s["max_rel_grad_diff"] <= TOL, (s["worst_grad"], s["max_rel_grad_diff"])
    assert s["matches_reference"] and s.passed, s.verdict()
    assert s["comm_bytes_per_rank"] == (
        s["theory_comm_bytes_per_rank"]
        if isinstance(s["theory_comm_bytes_per_rank"], list)
        else [s["theory_comm_bytes_per_rank"]] * s["nproc"]
    )
    assert checks_ok(s, "state bytes per rank"), (
        s["state_bytes_per_rank"],
        s["theory_state_bytes_per_rank"],
    )


# --- the exercise, three ways
# ------------------------------------------------------------------------------
# The lab's parts (PARTS in labs/multimodal.py): exercise (b), data parallelism over the whole
# model, is the core; (c) the tensor-parallel decoder and (a) the encoder as pipeline stage 0 are
# extensions.
TENSOR_PARALLEL = pytest.mark.part("tensor-parallel")
PIPELINE = pytest.mark.part("pipeline")


@pytest.mark.exercise
@PIPELINE
@pytest.mark.parametrize(
    "nproc, split",
    # (2, 2, 0): the last stage may hold no decoder layer (it holds the norm and the head)
    [(2, (0, 4)), (2, (3, 1)), (3, (2, 2, 0)), (4, (0, 2, 1, 1)), (4, (1, 1, 1, 1))],
)
def test_pipeline_with_the_encoder_as_stage_0(nproc, split):
    s = summary("pp", nproc, split=split)
    assert_matches(s)
    assert s["grads_checked"] == "80 of 80"  # every parameter lives on exactly one stage
    assert s["params_per_rank"] == s["theory_params_per_rank"]


@pytest.mark.exercise
@pytest.mark.parametrize("nproc, zero", [(2, 0), (4, 0), (2, 2), (4, 3)])
def test_data_parallel_whole_model(nproc, zero):
    s = summary("dp", nproc, zero=zero)
    assert_matches(s)
    if zero == 0:  # every rank's gradient after the all-reduce is the global batch's
        assert s["grads_checked"] == 80 * nproc


@pytest.mark.exercise
def test_zero3_on_three_ranks_holds_each_ranks_own_share():
    """3 ranks divide no unit: the flat buffers' padding ends the last rank's shards, and ZeRO-3's
    optimizer keeps no moments for it, so that rank holds less; the theory's per-rank figure
    (``labs.theory.zero.held_bytes(..., rank=r)``) says exactly how much."""
    s = experiment.run(mode="dp", nproc=3, zero=3, batch_size=6, steps=2)
    assert_matches(s)
    held = s["theory_state_bytes_per_rank"]
    assert held[0] == held[1] > held[2] and s["state_bytes_per_rank"] == held


@pytest.mark.exercise
@TENSOR_PARALLEL
@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_decoder_replicated_encoder(nproc):
    s = summary("tp", nproc)
    assert_matches(s)
    assert s["comm"] == s["theory_comm"]
    assert checks_ok(s, "encoder replicas identical", "losses equal on every rank")
    # the replicated encoder sends nothing: every collective is the decoder's (all-reduces, notebook
    # 04's)
    assert set(s["comm"]["forward"]) == set(s["comm"]["backward"]) == {"all_reduce"}


@pytest.mark.exercise
@PIPELINE
def test_imbalance_measurement_reports_every_stage():
    r = multimodal_timeline.imbalance(
        splits=[(0, 4), (2, 2)], nproc=2, steps=3, batch_size=8, size="tiny"
    )
    assert [row["split"] for row in r["rows"]] == [(0, 4), (2, 2)]
    for row in r["rows"]:
        assert row["matches_reference"], row["losses"]
        assert len(row["t_forward"]) == len(row["t_backward"]) == 2 and min(row["t_forward"]) > 0
        assert 0 < row["measured_bubble"] < 1 and 0 < row["simulated_bubble"] < 1
        assert {e["name"] for e in row["events"]} == {"F", "B"} and len(row["events"]) == 2 * 2 * 4
    flops = [row["flops_bubble"] for row in r["rows"]]
    assert flops[1] < flops[0]  # the prediction: rebalancing shrinks the bubble


@pytest.mark.exercise
@PIPELINE
def test_command_line_summary():
    s = lab_json("multimodal", "--mode", "pp", "--nproc", "2", "--steps", "2", "--json")
    assert set(SUMMARY_KEYS) <= set(s)
    assert s["lab"] == "multimodal" and s["mode"] == "pp" and s["matches_reference"]


# --- bad input, before any process starts
# ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(mode="cp"), "mode='cp' is not one of"),
        (dict(mode="pp", nproc=2, split=(1, 2)), r"split=\(1, 2\) must give 2 stages"),
        (dict(mode="pp", nproc=4, split=(0, 4)), "must give 4 stages"),
        (dict(mode="pp", nproc=1), "needs nproc >= 2"),
        # a stage between the encoder's and the last with no decoder layer has nothing to train
        (dict(mode="pp", nproc=3, split=(2, 0, 2)), r"stage 1 holds no decoder layer.*\(0, 2, 2\)"),
        (dict(mode="pp", nproc=7), r"at most 6 stages.*use nproc in 2..6"),
        (dict(mode="pp", nproc=2, microbatches=3), "not divisible by microbatches=3"),
        (dict(mode="dp", nproc=3), "batch_size=8 is not divisible by the data-parallel degree 3"),
        (dict(mode="dp", nproc=2, zero=4), "zero=4 is not one of"),
        (dict(mode="tp", nproc=3), "divisible"),
        (dict(mode="pp", size="huge"), "size='huge' is not one of"),
    ],
)
def test_bad_input_is_a_clear_value_error(kw, message):
    with pytest.raises(ValueError, match=message):
        experiment.run(**{"nproc": 2, **kw})


# --- the model and the data (harness, not the exercise)
# ----------------------------------------------------
def test_encoder_is_siglip_bit_for_bit():
    model = build_multimodal(MultimodalConfig())
    images = multimodal_data_for(model.cfg, TrainConfig(steps=1, batch_size=4))[0][0]
    with torch.no_grad():
        ours = model.encoder(images)
        theirs = to_hf_siglip(model.encoder)(pixel_values=images).last_hidden_state
    assert torch.equal(ours, theirs)


def test_prefix_takes_the_placeholders_place():
    cfg = MultimodalConfig()
    model = build_multimodal(cfg)
    images, tokens, targets = multimodal_data_for(cfg, TrainConfig(steps=1, batch_size=2))[0]
    prefix = model.projector(model.encoder(images))
    h = fuse(model.decoder, prefix, tokens)
    assert h.shape == (2, cfg.seq_len, cfg.decoder.n_embd)
    assert torch.equal(h[:, : cfg.n_prefix], prefix)
    assert torch.equal(h[:, cfg.n_prefix :], model.decoder.tok_emb(tokens[:, cfg.n_prefix :]))
    # only caption positions have targets: C of them per sample, the last image position predicts
    # the first byte
    assert ((targets != shapes.IGNORE).sum(1) == cfg.caption_len).all()
    assert torch.equal(targets[:, cfg.n_prefix - 1], tokens[:, cfg.n_prefix])


def test_data_is_seeded_and_split_like_the_text_labs():
    a = shapes.global_batches(steps=2, batch_size=3, n_prefix=16, world_size=2, seed=5)
    b = shapes.global_batches(steps=2, batch_size=3, n_prefix=16, world_size=2, seed=5)
    ranks = [
        shapes.rank_batches(steps=2, batch_size=3, n_prefix=16, rank=r, world_size=2, seed=5)
        for r in (0, 1)
    ]
    for step in range(2):
        for i in range(3):
            assert torch.equal(a[step][i], b[step][i])
            assert torch.equal(a[step][i], torch.cat([ranks[0][step][i], ranks[1][step][i]]))
    assert not torch.equal(
        a[0][0],
        shapes.global_batches(steps=1, batch_size=3, n_prefix=16, world_size=2, seed=6)[0][0],
    )


def test_captions_name_what_the_image_shows():
    ds = shapes.ShapesDataset(n=64)
    for i in range(64):
        image, caption = ds[i]
        d = ds.describe(i)
        text = shapes.ByteTokenizer().decode(caption)
        assert (
            text == shapes.caption(d["size"], d["colour"], d["shape"])
            and len(caption) == shapes.CAPTION_LEN
        )
        centre = image[:, d["cy"], d["cx"]]  # every shape covers its centre pixel
        assert torch.allclose(centre, torch.tensor(shapes.COLOURS[d["colour"]]))
    with pytest.raises(ValueError, match="shape='star' is not one of"):
        shapes.render("star", "red", 2, 5, 5, noise=torch.zeros(3, 16, 16))


def test_reference_learns_to_caption():
    cfg = MultimodalConfig()
    ref = train_multimodal_reference(cfg, TrainConfig(steps=30, batch_size=16, lr=1e-2))
    assert ref.losses[-1] < 0.5 * ref.losses[0], ref.losses
    model = build_multimodal(cfg)
    captions = describe(model, multimodal_data_for(cfg, TrainConfig(steps=1, batch_size=2))[0][0])
    assert len(captions) == 2 and all(isinstance(c, str) for c in captions)
