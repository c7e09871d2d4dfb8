"""From a plan to a launch: a ``torchrun`` command line, an accelerate config (FSDP) and a
DeepSpeed config (notebook 08). Pure Python: strings and dicts, nothing is launched.

    torchrun_command(plan)                 # torchrun --nnodes 64 ... -m labs.run mesh --dp 4 ...
    accelerate_config(plan)                # YAML text for `accelerate launch --config_file`
    deepspeed_config(plan, offload=True)   # dict for `deepspeed.initialize(config=...)`
    python -m labs.theory plan --preset llama3-8b --seq 4096 --gpus 64 --export accelerate

``plan`` is any mapping with ``dp``, ``tp``, ``pp``, ``cp`` (and, where used, ``zero``,
``global_batch``, ``microbatches``, ``assumptions`` and ``cluster``):
``labs.theory.planner.plan``'s result, or a hand-written layout.

What each format can say. torchrun starts the processes; the layout travels as the script's
own arguments. accelerate (>= 1.10, FSDP2) expresses DP (``dp_replicate_size`` x
``dp_shard_size``), TP and CP in its ``parallelism_config``, and no pipeline parallelism.
DeepSpeed's JSON carries ZeRO, offload, the batch arithmetic (train_batch_size = micro-batch x
accumulation x DP ranks) and AutoTP's ``tensor_parallel.autotp_size`` (ZeRO 0-2 only); its
pipeline is built in code (``PipelineModule(num_stages=pp)``, ZeRO <= 1) and it has no
ring-attention CP.
Whatever a format cannot express is a ValueError saying which degree and which export can.

Sources of the field names: torchrun: ``torch.distributed.run`` (``--help``); accelerate:
``accelerate config`` / ``accelerate.commands.config.config_args.ClusterConfig`` and the
``accelerate launch`` options ``--fsdp_*`` / ``--parallelism_config_*``; DeepSpeed:
https://www.deepspeed.ai/docs/config-json/ and https://www.deepspeed.ai/tutorials/autotp-training/.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping

from labs.theory.dims import ParallelDims, check_positive

DEGREES = ("dp", "tp", "pp", "cp")
ENDPOINT = "$MASTER_ADDR:$MASTER_PORT"  # the rendezvous host:port, set on every node
LAYER_CLASS = "LlamaDecoderLayer"  # the transformers block FSDP wraps one unit at a time


def _degrees(plan: Mapping) -> dict[str, int]:
    missing = [d for d in DEGREES if d not in plan]
    if missing:
        raise ValueError(f"the plan lacks {missing}; give dp, tp, pp and cp")
    degrees = {d: plan[d] for d in DEGREES}
    ParallelDims(**degrees)  # integers >= 1
    return degrees


def _nodes(plan: Mapping, nproc_per_node: int | None) -> tuple[int, int]:
    """(nodes, processes per node) for the plan's world size."""
    world = ParallelDims(**_degrees(plan)).world_size
    per_node = nproc_per_node or plan.get("cluster", {}).get("gpus_per_node") or world
    check_positive(nproc_per_node=per_node)
    per_node = min(per_node, world)
    if world % per_node:
        raise ValueError(
            f"world size {world} is not a whole number of nodes of nproc_per_node={per_node};"
            f" use nproc_per_node dividing {world}"
        )
    return world // per_node, per_node


def mesh_args(plan: Mapping) -> list[str]:
    """The composed lab's options for the plan's degrees: ``--dp 4 --tp 8 --pp 4 --cp 4``."""
    return [arg for d, v in _degrees(plan).items() for arg in (f"--{d}", str(v))]


def torchrun_command(
    plan: Mapping,
    *,
    nproc_per_node: int | None = None,
    script: str | None = None,
    script_args: list[str] | None = None,
    rdzv_endpoint: str = ENDPOINT,
    rdzv_id: str = "$JOB_ID",
    node_rank: str = "$NODE_RANK",
) -> str:
    """The command to run on every node. One node: ``torchrun --standalone --nproc-per-node N``;
    several: ``--nnodes --node-rank --rdzv-backend c10d --rdzv-endpoint --rdzv-id``. c10d numbers
    the nodes by arrival (torchrun ignores ``--node-rank`` with it, with a warning; the static
    backend uses it); either way a node's processes get consecutive global ranks, so TP groups (tp
    innermost, tp <= gpus per node) stay inside a node. Runs
    ``-m labs.run mesh <degrees> --json`` unless ``script`` (a file) is given; ``script_args``
    default to the degrees. ``$VARIABLES`` are left for the shell of each node."""
    nnodes, per_node = _nodes(plan, nproc_per_node)
    if nnodes == 1:
        launcher = ["torchrun", "--standalone", "--nproc-per-node", str(per_node)]
    else:
        launcher = [
            "torchrun",
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(per_node),
            "--node-rank",
            node_rank,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            rdzv_id,
        ]
    args = mesh_args(plan) if script_args is None else list(script_args)
    target = ["-m", "labs.run", "mesh", *args, "--json"] if script is None else [script, *args]
    return " ".join(a if a.startswith("$") else shlex.quote(a) for a in launcher + target)


def accelerate_config_dict(
    plan: Mapping,
    *,
    nproc_per_node: int | None = None,
    layer_class: str = LAYER_CLASS,
    main_process_ip: str = "MASTER_ADDR",
    main_process_port: int = 29500,
) -> dict:
    """The accelerate config (FSDP2 with ``parallelism_config``) as a dict; see
    ``accelerate_config``."""
    degrees = _degrees(plan)
    if degrees["pp"] > 1:
        raise ValueError(
            f"pp={degrees['pp']}: accelerate's FSDP has no pipeline parallelism; use the"
            " torchrun export (our mesh lab) or the DeepSpeed one, or plan with pp=1"
        )
    nnodes, per_node = _nodes(plan, nproc_per_node)
    zero = plan.get("zero", 3)
    if zero not in (2, 3):
        raise ValueError(
            f"zero={zero}: accelerate's FSDP shards gradients and optimizer state (ZeRO-2,"
            " reshard_after_forward=false) or everything (ZeRO-3); use zero in {2,3}"
        )
    recompute = plan.get("assumptions", {}).get("recompute", "none")
    precision = plan.get("assumptions", {}).get("precision", "bf16-mixed")
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "debug": False,
        "mixed_precision": "bf16" if precision == "bf16-mixed" else "no",
        "downcast_bf16": "no",
        "num_machines": nnodes,
        "num_processes": nnodes * per_node,
        "machine_rank": 0,
        "rdzv_backend": "static" if nnodes == 1 else "c10d",
        "same_network": True,
        "main_training_function": "main",
        "enable_cpu_affinity": False,
        "use_cpu": False,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": zero == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": False,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,
            "fsdp_activation_checkpointing": recompute == "full",
        },
    }
    if nnodes > 1:
        config.update(main_process_ip=main_process_ip, main_process_port=main_process_port)
    if degrees["tp"] > 1 or degrees["cp"] > 1:
        prefix = "parallelism_config_"
        config["parallelism_config"] = {
            prefix + "dp_replicate_size": 1,
            prefix + "dp_shard_size": degrees["dp"],
            prefix + "tp_size": degrees["tp"],
            prefix + "cp_size": degrees["cp"],
        }
    return config


def accelerate_config(plan: Mapping, **kw: object) -> str:
    """YAML text for ``accelerate launch --config_file``: FSDP2 over the plan's DP ranks (ZeRO-3:
    ``fsdp_reshard_after_forward: true``), TP and CP through ``parallelism_config``, one machine
    per node. On several nodes, run
    ``accelerate launch --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR`` on each
    (command-line flags override the file's placeholder address). Raises for pp > 1."""
    import yaml  # PyYAML, which accelerate itself uses to read and write these files

    return yaml.safe_dump(accelerate_config_dict(plan, **kw), sort_keys=True)


def deepspeed_config(
    plan: Mapping, *, offload: bool = False, lr: float = 3e-4, grad_clip: float = 1.0
) -> dict:
    """A DeepSpeed config for the plan: ``train_batch_size`` = global batch (sequences),
    ``train_micro_batch_size_per_gpu`` = mbs, ``gradient_accumulation_steps`` = micro-batches per
    DP rank (DeepSpeed checks train_batch_size = mbs x accumulation x DP ranks), bf16, ZeRO stage
    (capped at 1 with PP, as DeepSpeed's pipeline engine requires; the planner's choice otherwise),
    optimizer state on the CPU with ``offload``, AdamW, and ``tensor_parallel.autotp_size`` when
    tp > 1 (ZeRO <= 2). PP is set in code: ``PipelineModule(layers, num_stages=pp)``. Raises for
    cp > 1."""
    degrees = _degrees(plan)
    if degrees["cp"] > 1:
        raise ValueError(
            f"cp={degrees['cp']}: DeepSpeed has no ring-attention context parallelism (its"
            " Ulysses sequence parallelism is another scheme); use the torchrun export or cp=1"
        )
    mbs = plan.get("mbs") or plan.get("assumptions", {}).get("mbs") or 1
    accumulation = plan.get("microbatches", 1)
    zero = plan.get("zero", 3 if degrees["pp"] == 1 else 1)
    if degrees["pp"] > 1 and zero > 1:
        raise ValueError(
            f"zero={zero} with pp={degrees['pp']}: DeepSpeed's pipeline engine allows ZeRO 0 or 1"
        )
    if degrees["tp"] > 1 and zero > 2:
        zero = 2  # AutoTP training supports ZeRO stages 0-2
    zero_cfg = {"stage": zero, "overlap_comm": True, "contiguous_gradients": True}
    if offload:
        zero_cfg["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    precision = plan.get("assumptions", {}).get("precision", "bf16-mixed")
    config = {
        "train_batch_size": plan.get("global_batch", mbs * accumulation * degrees["dp"]),
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": accumulation,
        "bf16": {"enabled": precision == "bf16-mixed"},
        "zero_optimization": zero_cfg,
        "gradient_clipping": grad_clip,
        "steps_per_print": 10,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
    }
    if degrees["tp"] > 1:
        config["tensor_parallel"] = {"autotp_size": degrees["tp"]}
    if config["train_batch_size"] != mbs * accumulation * degrees["dp"]:
        raise ValueError(
            f"train_batch_size={config['train_batch_size']} != micro-batch {mbs}"
            f" x accumulation {accumulation} x dp {degrees['dp']}; DeepSpeed would refuse it"
        )
    return config


def can_express(kind: str, layout: Mapping) -> bool:
    """Whether ``export(kind, ...)`` can express a layout (dp, tp, pp, cp, zero): accelerate's
    FSDP has no PP and shards with ZeRO-2 or 3; DeepSpeed has no ring-attention CP and allows ZeRO
    0 or 1 with PP; torchrun runs our mesh lab, any layout."""
    if kind == "accelerate":
        return layout["pp"] == 1 and layout.get("zero", 3) in (2, 3)
    if kind == "deepspeed":
        return layout["cp"] == 1 and (layout["pp"] == 1 or layout.get("zero", 1) <= 1)
    if kind == "torchrun":
        return True
    raise ValueError(f"export={kind!r} is not one of ('torchrun', 'accelerate', 'deepspeed')")


def export(kind: str, plan: Mapping, **kw: object) -> str:
    """The text of one export: ``torchrun`` (command), ``accelerate`` (YAML) or ``deepspeed``
    (JSON)."""
    if kind == "torchrun":
        return torchrun_command(plan)
    if kind == "accelerate":
        return accelerate_config(plan)
    if kind == "deepspeed":
        return json.dumps(deepspeed_config(plan, **kw), indent=2)
    raise ValueError(f"export={kind!r} is not one of ('torchrun', 'accelerate', 'deepspeed')")
