"""Exports of a plan (labs.theory.exports), each checked with the real schema where we have it:
the torchrun command with torch.distributed.run's own parser and config builder, the accelerate
YAML with accelerate's config loader, ``accelerate launch`` validation and the FSDP and
parallelism plugins built from the environment it prepares; the DeepSpeed JSON (DeepSpeed is not
installable here) against its documented field names. Theory and harness only: not marked
exercise."""

import json
import os
import shlex

import pytest

from labs.theory import cli, exports
from labs.theory.planner import plan, rule_plan
from labs.theory.presets import preset

# the playbook's rule, whose layouts cover every export: 8 x 4 x 4, DP 4
SEED = rule_plan(preset("llama3-70b"), seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
# FSDP + TP 8 + CP 2
LONG = rule_plan(preset("llama3-8b"), seq=131072, gpus=64, gpus_per_node=8, gpu_mem_gib=80)
# FSDP + TP 4
TP_ONLY = rule_plan(preset("llama3-70b"), seq=4096, gpus=64, gpus_per_node=8, gpu_mem_gib=80)
# PP, DP 2
PIPE = rule_plan(
    preset("llama3-70b"), seq=4096, gpus=64, gpus_per_node=8, gpu_mem_gib=80, global_batch=4
)
SHELL = {"$NODE_RANK": "3", "$MASTER_ADDR": "10.0.0.1", "$MASTER_PORT": "29400", "$JOB_ID": "job7"}


def torchrun_config(command: str):
    """What torchrun makes of ``command`` once each node's shell has filled in the variables."""
    from torch.distributed.run import config_from_args, get_args_parser

    for var, value in SHELL.items():
        command = command.replace(var, value)
    argv = shlex.split(command)
    assert argv[0] == "torchrun"
    args = get_args_parser().parse_args(argv[1:])
    config, cmd, cmd_args = config_from_args(args)
    return args, config, cmd_args


def test_torchrun_multi_node_for_the_seed_plan():
    command = exports.torchrun_command(SEED)
    args, config, cmd_args = torchrun_config(command)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (64, 64, 8)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == (
        "c10d",
        "10.0.0.1:29400",
        "job7",
    )
    assert args.node_rank == 3 and args.module and args.training_script == "labs.run"
    tail = ["-m", "labs.run", "mesh", "--dp", "4", "--tp", "8", "--pp", "4", "--cp", "4", "--json"]
    assert cmd_args[-len(tail) :] == tail  # what each worker process runs
    assert command.endswith("-m labs.run mesh --dp 4 --tp 8 --pp 4 --cp 4 --json")


def test_torchrun_single_node_is_standalone_and_takes_a_user_script():
    command = exports.torchrun_command(
        {"dp": 2, "tp": 2, "pp": 2, "cp": 1},
        script="train.py",
        script_args=["--config", "my run.yaml"],
    )
    args, config, cmd_args = torchrun_config(command)
    assert (
        args.standalone
        and config.nproc_per_node == 8
        and (config.min_nodes, config.max_nodes) == (1, 1)
    )
    assert args.training_script == "train.py" and args.training_script_args == [
        "--config",
        "my run.yaml",
    ]
    assert "'my run.yaml'" in command  # quoted for the shell


def test_torchrun_nodes_follow_the_cluster_or_the_argument():
    assert "--nnodes 16" in exports.torchrun_command(
        {"dp": 8, "tp": 8, "pp": 2, "cp": 1}, nproc_per_node=8
    )
    with pytest.raises(ValueError, match="nproc_per_node"):
        exports.torchrun_command({"dp": 3, "tp": 1, "pp": 1, "cp": 1}, nproc_per_node=2)
    with pytest.raises(ValueError, match="lacks"):
        exports.torchrun_command({"dp": 2, "tp": 2})


def load_accelerate(tmp_path, monkeypatch, text: str):
    """Load the YAML as ``accelerate launch --config_file`` does, then build accelerate's FSDP and
    parallelism plugins from the environment launch would give each process."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    prefixes = ("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_")
    for key in [k for k in os.environ if k.startswith(prefixes)]:
        # start from a clean environment: launch copies os.environ into the ranks'
        monkeypatch.delenv(key)
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    # rejects unknown top-level keys and bad enum values
    config = ClusterConfig.from_yaml_file(str(path))
    parser = launch_command_parser()
    options = {a.dest for a in parser._actions}
    unknown = [
        k
        for section in ("fsdp_config", "parallelism_config")
        for k in getattr(config, section)
        if k not in options
    ]
    assert not unknown, f"keys accelerate launch would not read: {unknown}"
    args, _, _ = _validate_launch_command(
        parser.parse_args(["--config_file", str(path), "train.py"])
    )
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(prefixes):
            monkeypatch.setenv(key, value)
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    parallel = (
        ParallelismConfig() if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true" else None
    )
    return config, args, FullyShardedDataParallelPlugin(), parallel


def test_accelerate_yaml_loads_with_accelerate(tmp_path, monkeypatch):
    config, args, fsdp, parallel = load_accelerate(
        tmp_path, monkeypatch, exports.accelerate_config(LONG)
    )
    assert (
        config.distributed_type.value == "FSDP" and args.use_fsdp and args.mixed_precision == "bf16"
    )
    assert (args.num_machines, args.num_processes) == (8, 64)
    assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward is True  # ZeRO-3
    assert fsdp.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert (parallel.dp_shard_size, parallel.tp_size, parallel.cp_size) == (LONG["dp"], 8, 2)
    assert parallel.total_size == args.num_processes


def test_accelerate_yaml_for_fsdp_and_tp_on_one_node(tmp_path, monkeypatch):
    single = {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "zero": 2}
    config, args, fsdp, parallel = load_accelerate(
        tmp_path, monkeypatch, exports.accelerate_config(single)
    )
    assert (args.num_machines, args.num_processes, args.rdzv_backend) == (1, 8, "static")
    # ZeRO-2: FSDP2 keeps the gathered weights after forward
    assert fsdp.reshard_after_forward is False
    assert (parallel.dp_shard_size, parallel.tp_size, parallel.total_size) == (4, 2, 8)
    plain = {"dp": 8, "tp": 1, "pp": 1, "cp": 1}
    config, args, fsdp, parallel = load_accelerate(
        tmp_path, monkeypatch, exports.accelerate_config(plain)
    )
    assert parallel is None and "parallelism_config" not in exports.accelerate_config_dict(plain)


def test_accelerate_cannot_say_pipeline_parallel_or_zero_1():
    with pytest.raises(ValueError, match="pp=4: accelerate's FSDP has no pipeline parallelism"):
        exports.accelerate_config(SEED)
    with pytest.raises(ValueError, match="zero=1"):
        exports.accelerate_config({"dp": 8, "tp": 1, "pp": 1, "cp": 1, "zero": 1})


# DeepSpeed is not installable here (it builds CUDA ops). The keys we write, with where they are
# documented. https://www.deepspeed.ai/docs/config-json/ ("Batch Size Related Parameters",
# "Optimizer Parameters", "BFLOAT16 training options", "Gradient Clipping", "ZeRO Optimizations
# for FP16 Training" incl. offload_optimizer, "Logging"); tensor_parallel.autotp_size:
# https://www.deepspeed.ai/tutorials/autotp-training/ (ZeRO 0-2); ZeRO <= 1 with pipeline
# parallelism: deepspeed/runtime/pipe/engine.py asserts "ZeRO-2 and ZeRO-3 are incompatible with
# pipeline parallelism".
DEEPSPEED_KEYS = {
    "train_batch_size": int,
    "train_micro_batch_size_per_gpu": int,
    "gradient_accumulation_steps": int,
    "optimizer": {
        "type": str,
        "params": {"lr": float, "betas": list, "eps": float, "weight_decay": float},
    },
    "bf16": {"enabled": bool},
    "gradient_clipping": float,
    "steps_per_print": int,
    "zero_optimization": {
        "stage": int,
        "overlap_comm": bool,
        "contiguous_gradients": bool,
        "offload_optimizer": {"device": str, "pin_memory": bool},
    },
    "tensor_parallel": {"autotp_size": int},
}


def check_documented(config: dict, schema: dict, where: str = "") -> None:
    for key, value in config.items():
        assert key in schema, f"{where}{key} is not a documented DeepSpeed key"
        if isinstance(schema[key], dict):
            assert isinstance(value, dict), f"{where}{key} must be an object"
            check_documented(value, schema[key], f"{where}{key}.")
        else:
            assert isinstance(value, schema[key]), (
                f"{where}{key}={value!r} is not {schema[key].__name__}"
            )


def test_deepspeed_json_uses_documented_fields_and_consistent_batch():
    assert PIPE["pp"] > 1 and PIPE["cp"] == 1
    for p, offload in ((TP_ONLY, True), (PIPE, False)):
        config = json.loads(exports.export("deepspeed", p, offload=offload))
        check_documented(config, DEEPSPEED_KEYS)
        assert (
            config["train_batch_size"]
            == p["global_batch"]
            == (
                config["train_micro_batch_size_per_gpu"]
                * config["gradient_accumulation_steps"]
                * p["dp"]
            )
        )
    tp_only = exports.deepspeed_config(TP_ONLY, offload=True)
    assert tp_only["zero_optimization"]["stage"] == 2  # the plan's FSDP, capped at AutoTP's ZeRO-2
    assert tp_only["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu",
        "pin_memory": True,
    }
    assert tp_only["tensor_parallel"] == {"autotp_size": 4}
    with pytest.raises(ValueError, match="train_batch_size"):
        exports.deepspeed_config(PIPE | {"dp": 8})  # 4 sequences != 1 x 2 micro-batches x 8 ranks
    assert exports.deepspeed_config(PIPE)["zero_optimization"]["stage"] == 1
    assert (
        exports.deepspeed_config({"dp": 8, "tp": 1, "pp": 1, "cp": 1})["zero_optimization"]["stage"]
        == 3
    )


def test_deepspeed_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="cp=4: DeepSpeed has no ring-attention"):
        exports.deepspeed_config(SEED)
    with pytest.raises(ValueError, match="pipeline engine allows ZeRO 0 or 1"):
        exports.deepspeed_config({"dp": 2, "tp": 1, "pp": 2, "cp": 1, "zero": 3})
    with pytest.raises(ValueError, match="export='slurm'"):
        exports.export("slurm", SEED)


def test_deepspeed_takes_the_searched_micro_batch():
    """The search picks the micro-batch size too: DeepSpeed's batch arithmetic uses the plan's
    mbs and micro-batch count, not the default of 1."""
    p = plan(preset("llama3-8b"), seq=4096, gpus=64, gpus_per_node=8, gpu_mem_gib=80)
    assert p["mbs"] > 1 and p["assumptions"]["mbs"] is None  # searched, not given
    config = exports.deepspeed_config(p)
    assert config["train_micro_batch_size_per_gpu"] == p["mbs"]
    assert config["gradient_accumulation_steps"] == p["microbatches"]
    assert config["train_batch_size"] == p["global_batch"] == p["mbs"] * p["microbatches"] * p["dp"]


def test_plan_with_an_export_picks_the_fastest_layout_that_tool_can_express():
    """``plan --export accelerate`` plans among the layouts accelerate can express (no PP, ZeRO-2
    or 3), ``--export deepspeed`` among DeepSpeed's (no CP; ZeRO 0-1 with PP); ``can_express``
    says which, the same rules the exports raise on."""
    argv = ["plan", "--preset", "llama3-8b", "--seq", "131072", "--gpus", "64"]
    free = cli.run(argv)
    fsdp = cli.run([*argv, "--export", "accelerate"])
    assert exports.can_express("accelerate", fsdp) and fsdp["export"].startswith("compute_env")
    assert fsdp["step_time_s"] >= free["step_time_s"]
    for layout, kind, ok in (
        ({"dp": 8, "tp": 1, "pp": 1, "cp": 1, "zero": 1}, "accelerate", False),
        ({"dp": 8, "tp": 1, "pp": 1, "cp": 1, "zero": 2}, "accelerate", True),
        ({"dp": 2, "tp": 1, "pp": 4, "cp": 1, "zero": 3}, "accelerate", False),
        ({"dp": 2, "tp": 1, "pp": 4, "cp": 1, "zero": 1}, "deepspeed", True),
        ({"dp": 2, "tp": 1, "pp": 4, "cp": 1, "zero": 2}, "deepspeed", False),
        ({"dp": 2, "tp": 1, "pp": 1, "cp": 4, "zero": 3}, "deepspeed", False),
        ({"dp": 2, "tp": 1, "pp": 1, "cp": 4, "zero": 3}, "torchrun", True),
    ):
        assert exports.can_express(kind, layout) is ok, (kind, layout)
    with pytest.raises(ValueError, match="of the layouts deepspeed can express"):
        cli.run([*argv, "--export", "deepspeed"])  # 128K tokens need CP
