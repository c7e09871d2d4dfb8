"""ZeRO-3 checkpoints with torch.distributed.checkpoint: save on 4 ranks, load on 2, on 4 and in one
process.

Loading is exact on any rank count (the parameters come back bit for bit); training on
from there reproduces the uninterrupted run bit for bit on the same 4 ranks, and within
the fp32 tolerance on 2 ranks or in one process, where the gradient sum is split
differently (the same rounding as any data-parallel run against the reference).
"""

import shutil

import pytest
import torch

from labs import RankError, launch
from labs.checkpoint import load, load_full
from labs.experiments.zero import build
from labs.experiments.zero_checkpoint import checkpoint_demo
from labs.runtime.impl import exercise
from labs.train import TrainConfig, rule
from tests.helpers import in_child

TOL = rule("value", torch.float32).rel
# The checkpoints extension of notebook 03 (PARTS in labs/zero.py): saves and loads ZeRO-3 models.
pytestmark = pytest.mark.part("checkpoints")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero3") / "ckpt"
    # in a child: loading reads the checkpoint's pickled metadata, which the ranks (the exercise's
    # code) wrote, and the test process unpickles plain data only (the grading guard)
    return folder, in_child(checkpoint_demo, folder, save_nproc=4, load_nproc=2, steps=3)


def load_full_in_child(path, model_name):
    """``load_full`` of the course's model from ``path``, run in a child: its ValueError as a
    RankError here."""
    return in_child(load_full, path, build(model_name), TrainConfig())


@pytest.mark.exercise
def test_load_is_exact_on_any_rank_count(demo):
    _, d = demo
    for tag in ("on_2", "on_4", "single"):
        loaded = d[f"params_loaded_{tag}"]
        for name, saved in d["saved_params"].items():
            assert torch.equal(loaded[name], saved), f"{name} differs after loading {tag}"
        assert d[f"load_{tag}_exact"]


@pytest.mark.exercise
def test_resuming_gives_the_uninterrupted_losses(demo):
    _, d = demo
    assert d["resumed_on_4"] == d["uninterrupted"], "same ranks, same arithmetic: bit for bit"
    assert all(
        torch.equal(d["params_resumed_on_4"][n], p) for n, p in d["uninterrupted_params"].items()
    )
    for tag in ("on_2", "single"):
        assert d[f"resume_{tag}_max_rel_loss_diff"] <= TOL, (
            tag,
            d[f"resume_{tag}_max_rel_loss_diff"],
        )
        assert d[f"resume_{tag}_max_rel_param_diff"] <= TOL, (
            tag,
            d[f"resume_{tag}_max_rel_param_diff"],
        )
    assert len(d["single_process"]) == len(d["uninterrupted"]) == 3


def _load_on_ranks(path):
    model = build("course")
    exercise("zero").fully_shard(model)  # one unit: the checkpoint has four
    optimizer = torch.optim.AdamW(model.parameters())
    load(model, optimizer, path)


@pytest.mark.exercise
@pytest.mark.parametrize("damage", ["truncate_data", "truncate_metadata"])
def test_corrupted_checkpoint_is_a_clear_error(demo, tmp_path, damage):
    folder, _ = demo
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    victim = (
        sorted(broken.glob("*.distcp"))[0] if damage == "truncate_data" else broken / ".metadata"
    )
    victim.write_bytes(victim.read_bytes()[:40])
    with pytest.raises(RankError, match=f"checkpoint at {broken} is corrupted or incomplete") as e:
        load_full_in_child(broken, "course")
    assert e.value.exc_type == "ValueError"
    with pytest.raises(RankError) as err:
        launch(_load_on_ranks, 2, broken, timeout=60)
    assert err.value.exc_type == "ValueError" and str(broken) in err.value.message


@pytest.mark.exercise
def test_checkpoint_of_another_model_is_refused(demo):
    folder, _ = demo
    with pytest.raises(RankError, match="names parameters this model lacks") as e:
        load_full_in_child(folder, "awkward")
    assert e.value.exc_type == "ValueError"
    with pytest.raises(RankError, match="saved from another model or unit split"):
        launch(_load_on_ranks, 2, folder, timeout=60)  # one unit here, four in the checkpoint


def test_missing_checkpoint_is_file_not_found(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {missing}"):
        load_full(missing, build("course"), TrainConfig())
