"""Hidden checks for exercise 08 (graded, never released): meshes with a degree of 3, the groups
``build_mesh`` creates on four ranks, TP × PP and a three-stage pipeline trained on the mesh.

The public tests read groups of meshes whose degrees are 2 (and one 3·2·2·2 mesh, per single
axis), and train DP2 × TP2 × PP2 and DP2 × TP2 × CP2 on 8 ranks. Here: several-axis groups with
a degree of 3 against the grid written out by hand (rank = ((d·PP + p)·CP + c)·TP + t), every
group of a 4-rank mesh used for a collective, TP2 × PP2 on 4 ranks and PP3 with 4 micro-batches.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import mesh as experiment
from labs.experiments.checks import matches
from labs.runtime import exercise
from labs.theory.dims import ParallelDims
from tests.helpers import in_child

pytestmark = pytest.mark.exercise

AXES = ("dp", "pp", "cp", "tp")


def expected_groups(degrees: dict[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """The groups of ranks that differ only along ``axes``, from the grid's definition."""
    sizes = [degrees.get(a, 1) for a in AXES]
    groups: dict[tuple, list[int]] = {}
    for coords in itertools.product(*(range(s) for s in sizes)):
        rank = 0
        for coord, size in zip(coords, sizes):
            rank = rank * size + coord
        key = tuple(c for a, c in zip(AXES, coords) if a not in axes)
        groups.setdefault(key, []).append(rank)
    return sorted(sorted(g) for g in groups.values())


@pytest.mark.parametrize(
    "degrees",
    [dict(dp=2, pp=3, tp=2), dict(dp=3, cp=2, tp=2), dict(pp=2, cp=3, tp=1)],
    ids=["dp2-pp3-tp2", "dp3-cp2-tp2", "pp2-cp3"],
)
def test_several_axis_groups_with_a_degree_of_three(degrees):
    found = in_child(every_group, degrees)
    for axes, got in found:
        assert got == expected_groups(degrees, axes), f"{degrees}, axes {axes}: {got}"


def every_group(degrees):
    """(axes, group_ranks(dims, axes)) for every combination of one to three axes (in a child:
    exercise code never runs in the test process)."""
    dims = ParallelDims(**degrees)
    axes_list = [a for n in (1, 2, 3) for a in itertools.combinations(AXES, n)]
    return [(axes, exercise("mesh").group_ranks(dims, axes)) for axes in axes_list]


def mesh_worker(degrees):
    """This rank's groups, and the sum of the global ranks over each, by all-reduce."""
    mesh = exercise("mesh").build_mesh(ParallelDims(**degrees))
    sums = {}
    for name, group in mesh.groups.items():
        t = torch.tensor([dist.get_rank()])
        if group is not None:
            dist.all_reduce(t, group=group)
        sums[name] = int(t)
    return mesh.ranks, sums


@pytest.mark.parametrize(
    "degrees", [dict(tp=2, cp=2), dict(dp=2, pp=2)], ids=["tp2-cp2", "dp2-pp2"]
)
def test_build_mesh_gives_each_rank_its_groups_and_they_work(degrees):
    axes_of = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp")}
    for rank, (ranks, sums) in enumerate(launch(mesh_worker, 4, degrees, timeout=60)):
        for name, axes in axes_of.items():
            mine = next(g for g in expected_groups(degrees, axes) if rank in g)
            assert ranks[name] == mine, f"rank {rank}: group {name} is {ranks[name]}, not {mine}"
            assert sums[name] == sum(mine), f"rank {rank}: the {name} group does not add {mine}"


@pytest.mark.parametrize(
    "kw",
    [dict(nproc=4, tp=2, pp=2), dict(nproc=3, pp=3, layers=3, microbatches=4)],
    ids=["tp2-pp2", "pp3-4-microbatches"],
)
def test_small_meshes_train_like_the_reference(kw):
    """Losses every step, every gradient after step 1 by name, groups against torch's
    init_device_mesh, bytes per axis and state bytes against the theory."""
    s = in_child(experiment.run, steps=2, **kw)
    assert s.passed, s.verdict()
    assert s["matches_reference"], s.verdict()
    assert matches(s.checks, "torch") and matches(s.checks, "theory"), s.verdict()
