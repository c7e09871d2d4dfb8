"""The 4D mesh and the composed training step (notebook 08): groups from the (dp, pp, cp, tp) grid
equal torch's init_device_mesh; DP2 x TP2 x PP2 (ZeRO-1) and DP2 x TP2 x CP2 (ZeRO-3) on 8 gloo
ranks match the single-process reference (losses every step, gradients after step 1, by name); bytes
per axis and state bytes equal each lab's theory; bad meshes are clear errors before any process
starts."""

import pytest
import torch

from labs.experiments import mesh as experiment
from labs.runtime.impl import exercise
from labs.theory.dims import ParallelDims
from tests.helpers import TORCHRUN, checks_ok, in_child, json_lines, lab_json, run_cli, run_lab_main

BYTES_CHECKS = tuple(f"bytes sent on the {g} group" for g in ("tp", "cp", "pp", "dp_cp", "world"))


def lab():
    return exercise("mesh")


def check_summary(s: dict) -> None:
    assert s["matches_reference"], (s["losses"], s["reference_losses"])
    assert s["max_rel_loss_diff"] <= 1e-5
    assert checks_ok(s, "gradients after step 1") and s["grads_compared"] == 21, (
        s["worst_grad"],
        s["max_rel_grad_diff"],
    )
    assert checks_ok(s, "groups equal torch's init_device_mesh")
    assert checks_ok(s, *BYTES_CHECKS), (s["comm_bytes_by_axis"], s["theory_comm_bytes_by_axis"])
    assert checks_ok(s, "state bytes per rank"), (
        s["state_bytes_per_rank"],
        s["theory_state_bytes_per_rank"],
    )


GRID_CASES = [
    (ParallelDims(dp=2, tp=2, pp=2), ("tp",)),  # rank = (d·2 + p)·2 + t
    (ParallelDims(dp=2, tp=2, pp=2), ("pp",)),
    (ParallelDims(dp=2, tp=2, pp=2), ("dp",)),
    (ParallelDims(dp=2, tp=2, cp=2), ("cp",)),  # rank = (d·2 + c)·2 + t
    (ParallelDims(dp=2, tp=2, cp=2), ("dp", "cp")),
    *[(ParallelDims(dp=3, pp=2, cp=2, tp=2), (axis,)) for axis in ("dp", "pp", "cp", "tp")],
    (ParallelDims(dp=3, pp=2, cp=2, tp=2), ("dp", "pp", "cp", "tp")),
]


def group_ranks(cases):
    return [lab().group_ranks(dims, axes) for dims, axes in cases]


@pytest.mark.exercise
def test_group_ranks_follow_the_rank_grid():
    got = in_child(group_ranks, GRID_CASES)
    assert got[:5] == [
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 2, 4, 6], [1, 3, 5, 7]],
    ]
    for (dims, (axis,)), ranks in zip(GRID_CASES[5:9], got[5:9]):
        assert ranks == sorted(dims.groups(axis)), axis
    assert got[9] == [list(range(24))]


@pytest.mark.exercise
def test_dp2_tp2_pp2_matches_the_reference():
    s = in_child(experiment.run, nproc=8, dp=2, tp=2, pp=2, steps=3)
    check_summary(s)
    assert s["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s["groups"]["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s["zero"] == 1 and s["microbatches"] == 4
    by_axis = s["comm_bytes_by_axis"]
    # one direction: [4, 32, 32] fp32
    assert all(b["cp"] == 0 and b["pp"] == 2 * 32 * 32 * 4 * 4 // 2 for b in by_axis)
    assert by_axis[2]["tp"] > by_axis[0]["tp"]  # the last stage also gathers the logits


@pytest.mark.exercise
def test_dp2_tp2_cp2_with_zero3_matches_the_reference():
    s = in_child(experiment.run, nproc=8, dp=2, tp=2, cp=2, zero=3, steps=3)
    check_summary(s)
    assert s["groups"]["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert all(b["pp"] == 0 and b["cp"] > 0 for b in s["comm_bytes_by_axis"])


def run_with_doubled_gradients():
    mesh_lab = lab()
    compose = mesh_lab.compose

    def doubled(*args, **kwargs):
        c = compose(*args, **kwargs)
        for p in c.module.parameters():
            p.register_hook(lambda g: 2 * g)
        return c

    mesh_lab.compose = doubled  # in this child only; the ranks it forks inherit it
    return experiment.run(nproc=2, dp=2, steps=2)


@pytest.mark.exercise
def test_a_gradient_off_by_a_constant_factor_is_caught():
    """AdamW divides each gradient by its own size: a gradient twice too large trains to the same
    losses, so the losses alone cannot see it. The gradient check does."""
    s = in_child(run_with_doubled_gradients)
    assert checks_ok(s, "losses") and not checks_ok(s, "gradients after step 1")
    assert not s["matches_reference"]
    assert s["max_rel_grad_diff"] == pytest.approx(1.0, rel=1e-4)


@pytest.mark.exercise
@pytest.mark.slow
def test_cli_runs_the_composed_lab():
    s = lab_json(
        "mesh",
        "--nproc",
        "8",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--steps",
        "2",
        "--json",
    )
    assert s["lab"] == "mesh" and s["degrees"] == {"dp": 2, "pp": 2, "cp": 1, "tp": 2}
    assert s["matches_reference"] and s["passed"] and checks_ok(s, *BYTES_CHECKS)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(nproc=8, dp=3, tp=2), "dp*tp*pp*cp = 3*2*1*1 = 6 but world_size=8"),
        (
            dict(nproc=16, dp=1, tp=16, gpus_per_node=8),
            "tp=16 cannot be placed on nodes of gpus_per_node=8",
        ),
        (dict(nproc=8, dp=2, tp=2, pp=2, cp=1, zero=3), "zero=3 with pp=2"),
        (dict(nproc=8, tp=2, pp=2, cp=2), "pp=2 with cp=2"),
        (dict(nproc=8, dp=2, tp=2, pp=2, microbatches=3), "microbatches=3 must divide"),
        (dict(nproc=8, dp=1, tp=8), "n_kv_head=4 is not divisible by tp=8"),
        (dict(nproc=4, pp=4), "pp=4 x virtual_stages=1 = 4 stages but only n_layer=2"),
        (dict(nproc=2, pp=2, layers=3), "n_layer=3 is not divisible by pp=2"),
    ],
)
def test_bad_meshes_are_clear_errors_before_any_process(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("+", r"\+")):
        experiment.run(**kwargs)


def test_check_mesh_names_the_axes():
    with pytest.raises(ValueError, match=r"unknown mesh axis \['ep'\]"):
        lab().check_mesh(world_size=2, ep=2)
    dims = lab().check_mesh(world_size=8, gpus_per_node=4, dp=2, tp=4)
    assert dims.degrees == {"dp": 2, "pp": 1, "cp": 1, "tp": 4}


def test_cli_bad_mesh_exits_2_with_one_line():
    code, _, err = run_lab_main(
        "mesh", "--nproc", "4", "--dp", "2", "--tp", "2", "--gpus-per-node", "1"
    )
    assert code == 2, err
    assert err.strip().splitlines() == [
        "error: tp=2 cannot be placed on nodes of gpus_per_node=1: "
        "a TP group must sit inside one node; use tp in {1}"
    ]


def test_torchrun_export_speaks_the_labs_options():
    """The exported command's arguments are what ``python -m labs.run mesh`` parses."""
    import shlex

    from labs.run import build_parser
    from labs.theory.exports import torchrun_command

    command = torchrun_command({"dp": 2, "tp": 2, "pp": 2, "cp": 1}, nproc_per_node=4)
    args = shlex.split(command.replace("$", ""))
    parsed = build_parser(experiment.LAB).parse_args(args[args.index("labs.run") + 1 :])
    assert (parsed.lab, parsed.dp, parsed.tp, parsed.pp, parsed.cp, parsed.json) == (
        "mesh",
        2,
        2,
        2,
        1,
        True,
    )
    assert "--nnodes 2 --nproc-per-node 4" in command


def test_gradient_assembly_joins_tp_shards_along_the_split_dimension():
    ref = {
        "w_col": torch.arange(8.0).view(4, 2),
        "w_row": torch.arange(8.0).view(2, 4),
        "norm": torch.ones(3),
    }
    ranks = [
        {
            "coords": {"tp": t},
            "grads": {
                "w_col": ref["w_col"].chunk(2, 0)[t],
                "w_row": ref["w_row"].chunk(2, 1)[t],
                "norm": ref["norm"],
            },
        }
        for t in (1, 0)
    ]
    got = experiment.assemble_grads(ranks + [{"coords": {"tp": 0}, "grads": None}], ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_which_parallelism_table_reads_the_measurements():
    base = {
        "axis": "none",
        "state_bytes": 1000,
        "activation_bytes": 800,
        "sent_bytes": {},
        "correct": True,
    }
    rows = [
        base,
        {
            **base,
            "axis": "pp",
            "state_bytes": 500,
            "activation_bytes": None,
            "sent_bytes": {"pp": 32768.0},
        },
        {
            **base,
            "axis": "cp",
            "state_bytes": 750,
            "activation_bytes": 400,
            "sent_bytes": {"cp": 98304.0},
        },
    ]
    table = experiment.which_parallelism_table(rows).splitlines()
    assert len(table) == 4 and table[0].startswith(
        "| parallelism | splits | memory saving | communication cost"
    )
    assert table[2].endswith("state 0.50x, activations n/a (1F1B); sends 33 kB on pp per step |")
    assert table[3].endswith("state 0.75x, activations 0.50x; sends 98 kB on cp per step |")


@pytest.mark.exercise
@pytest.mark.slow
def test_the_exported_torchrun_command_runs_the_lab():
    """The planner's single-node export, run for real: torchrun starts 2 workers that join."""
    import shlex

    from labs.theory.exports import torchrun_command

    argv = shlex.split(torchrun_command({"dp": 2, "tp": 1, "pp": 1, "cp": 1}))
    proc = run_cli(TORCHRUN, *argv[1:], "--steps", "2", timeout=300)  # argv[0]: "torchrun"
    assert proc.returncode == 0, proc.stderr[-3000:]
    [s] = json_lines(proc.stdout)  # rank 0 prints
    assert s["nproc"] == 2 and s["matches_reference"] and s["passed"]
    assert checks_ok(s, "gradients after step 1", *BYTES_CHECKS)
