"""The course's calculators from the command line (pure formulas, no torch needed).

    python -m labs.theory memory --preset llama3-8b --seq 4096 --mbs 1 --precision bf16-mixed \\
        --zero 3 --dp 8 --json
    python -m labs.theory memory --preset llama3-8b --experts 8 --top-k 2 --dp 8 --ep 4 --zero 1 \\
        --fp8 --offload --gpu-mem 79.6
    python -m labs.theory bubble --schedule 1f1b --stages 4 --microbatches 8 --json
    python -m labs.theory bubble --schedule zb-h1 --stages 4 --microbatches 8
    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \\
        --gpu-mem 80 --json
    python -m labs.theory plan --preset llama3-405b --seq 8192 --gpus 16384 --global-batch 2048 \\
        --recompute selective --layout tp=8,pp=16,cp=1,dp=128,zero=1,v=2
    python -m labs.theory comm --op all_reduce --bytes 1e9 --ranks 8 --json
    python -m labs.theory moe --preset mixtral-8x7b --json

This module is the whole command line and holds no formula. Each command is one frozen
dataclass: its fields are the command's options (``--kv-heads`` is the field ``kv_heads``; the
field's type, default and help are the option's; a bool is a switch, ``--no-x`` too when it
defaults to on; a field without a default is a required option), and its ``run`` calls one
function of the theory package with them. ``format`` is the readable output (without ``--json``);
a command without one prints JSON. Invalid input exits with status 2 and one line naming the
parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import ClassVar

from labs.theory import (
    comm,
    context_parallel,
    inference,
    memory,
    memory_report,
    moe,
    pipeline,
    presets,
)
from labs.theory.model import ModelSpec
from labs.theory.multimodal import ENCODERS
from labs.theory.planner import ASSUMPTIONS
from labs.theory.planner import multimodal as planner_multimodal
from labs.theory.planner import report as planner_report

REQUIRED = dataclasses.MISSING


def option(
    default: object = REQUIRED,
    *,
    help: str | None = None,
    group: str | None = None,
    choices: tuple | list | None = None,
) -> dataclasses.Field:
    """A command's option: its default (none: required), its help, the help section (``group``, a
    key of the command's ``GROUPS``) and the values it accepts (``choices``)."""
    metadata = {"help": help, "group": group, "choices": choices}
    if default is REQUIRED:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """A command's options; ``run`` gives its result as a dict."""

    GROUPS: ClassVar[dict[str, str]] = {}  # help section key -> title

    def run(self) -> dict:
        raise NotImplementedError

    def format(self, result: dict) -> str:
        """The readable output: JSON unless a command has a text form."""
        return json.dumps(result)


def _base_type(hint: object) -> type:
    """int for ``int`` or ``int | None``; the type argparse converts the option's text with."""
    members = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return members[0]


def add_options(parser: argparse.ArgumentParser, command: type[Command]) -> None:
    """One argparse option per field of ``command``, in field order, in its help sections."""
    hints = typing.get_type_hints(command)
    sections = {}
    for f in dataclasses.fields(command):
        where = parser
        key = f.metadata.get("group")
        if key is not None:
            if key not in sections:
                sections[key] = parser.add_argument_group(command.GROUPS[key])
            where = sections[key]
        flag = "--" + f.name.replace("_", "-")
        extra = {k: f.metadata[k] for k in ("help", "choices") if f.metadata.get(k) is not None}
        kind = _base_type(hints[f.name])
        if kind is bool:
            where.add_argument(flag, action="store_true", default=f.default, **extra)
            if f.default is True:
                where.add_argument("--no-" + flag[2:], dest=f.name, action="store_false")
        elif f.default is REQUIRED:
            where.add_argument(flag, type=kind, required=True, **extra)
        else:
            where.add_argument(flag, type=kind, default=f.default, **extra)


# ---------------------------------------------------------------------------------------------
# The model, as the memory calculator, the planner and the multimodal planner take it.

MODEL = "model: a preset, or free dimensions (which override a preset's)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelOptions(Command):
    preset: str | None = option(None, group="model", help=", ".join(presets.PRESETS))
    arch: str | None = option(
        None, group="model", help="llama (default) or gpt, for free dimensions"
    )
    layers: int | None = option(None, group="model")
    hidden: int | None = option(None, group="model")
    heads: int | None = option(None, group="model")
    kv_heads: int | None = option(None, group="model")
    ffn: int | None = option(None, group="model")
    vocab: int | None = option(None, group="model")
    head_dim: int | None = option(
        None, group="model", help="attention head width (default hidden / heads)"
    )
    experts: int | None = option(
        None, group="model", help="experts per MoE layer (default 1: a dense MLP)"
    )
    top_k: int | None = option(
        None, group="model", help="experts each token runs through (with --experts)"
    )
    tied: bool | None = option(None, group="model", help="tie the output head to the embedding")

    def model(self) -> tuple[str, ModelSpec]:
        """(name, spec): the preset with the dimensions given, or the free dimensions."""
        dims = {name: getattr(self, name) for name in memory_report.DIMS}
        return memory_report.model_spec(self.preset, arch=self.arch, tied=self.tied, **dims)


# ---------------------------------------------------------------------------------------------
# The commands, in the order ``--help`` lists them.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comm(Command):
    """Bytes each rank sends in one collective (ring algorithms)."""

    op: str = option(choices=sorted(comm.BYTES_PER_RANK))
    bytes: float = option(help="K: bytes of the tensor")
    ranks: int = option(help="N: ranks in the group")
    bandwidth_gbs: float | None = option(None, help="per-rank link bandwidth, GB/s")

    def run(self) -> dict:
        return comm.collective(self.op, self.bytes, self.ranks, bandwidth_gbs=self.bandwidth_gbs)

    def format(self, result: dict) -> str:
        return comm.format_collective(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory(ModelOptions):
    """Per-rank memory of a training run: parameters, gradients, optimizer state, activations."""

    GROUPS: ClassVar[dict[str, str]] = {"model": MODEL, "run": "training run", "gpu": "GPU"}

    seq: int = option(4096, group="run", help="sequence length")
    mbs: int = option(1, group="run", help="micro-batch size (sequences per rank per micro-batch)")
    precision: str = option("bf16-mixed", group="run", help=" or ".join(memory.PRECISIONS))
    fp8: bool = option(False, group="run", help="bf16-mixed with FP8 linear layers (activations)")
    optimizer: str = option("adamw", group="run", help=", ".join(memory.OPTIMIZERS))
    optimizer_bytes: float | None = option(
        None,
        group="run",
        help="optimizer state bytes per parameter, fp32 master copy not included"
        " (default: the optimizer's, 8 for AdamW)",
    )
    offload: bool = option(False, group="run", help="optimizer state in host memory (ZeRO-Offload)")
    fp32_grad_accum: bool = option(
        False, group="run", help="bf16-mixed: accumulate gradients in fp32"
    )
    zero: int = option(0, group="run", help="ZeRO stage 0-3 (shards over the dp ranks)")
    dp: int = option(1, group="run", help="dp degree")
    tp: int = option(1, group="run", help="tp degree")
    pp: int = option(1, group="run", help="pp degree")
    cp: int = option(1, group="run", help="cp degree")
    ep: int = option(1, group="run", help="ep degree")
    sp: bool = option(False, group="run", help="sequence parallelism (needs tp >= 2)")
    recompute: str = option("none", group="run", help="none, selective or full")
    microbatches: int | None = option(
        None, group="run", help="micro-batches per step (default: pp)"
    )
    schedule: str = option("1f1b", group="run", help=", ".join(memory.PP_SCHEDULES))
    virtual: int = option(1, group="run", help="model chunks per pipeline rank (interleaved)")
    gpu_mem: str | None = option(
        None,
        group="gpu",
        help="GPU memory in GiB (79.6 for an H100 '80 GB'; or 79.6GiB, 80GB): adds 'fits'",
    )
    step_time: float | None = option(
        None, group="gpu", help="measured step time in seconds (for MFU)"
    )
    peak_tflops: float | None = option(None, group="gpu", help="peak TFLOP/s per GPU (for MFU)")

    def run(self) -> dict:
        name, spec = self.model()
        run = {key: getattr(self, key) for key in memory_report.RUN_KEYS if hasattr(self, key)}
        return memory_report.report(
            spec,
            model=name,
            gpu_mem=self.gpu_mem,
            step_time=self.step_time,
            peak_tflops=self.peak_tflops,
            **run,
        )

    def format(self, result: dict) -> str:
        return memory_report.format_result(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bubble(Command):
    """A pipeline schedule on paper: bubble, step time, micro-batches held."""

    schedule: str = option(help=f"one of {', '.join(pipeline.SCHEDULES)}")
    stages: int = option(help="P: pipeline stages (ranks)")
    microbatches: int = option(help="M: micro-batches per step")
    virtual: int | None = option(
        None, help="V: model chunks per rank (interleaved; default 1; dualpipev: always 2)"
    )
    t_forward: float = option(1.0, help="forward time of one micro-batch per stage")
    t_backward: float = option(2.0, help="backward time of one micro-batch per stage")
    t_weight: float | None = option(
        None,
        help="the weight-gradient part W of --t-backward (zb-h1, dualpipev; default half of it)",
    )

    def run(self) -> dict:
        return pipeline.figures(
            self.schedule,
            self.stages,
            self.microbatches,
            self.virtual,
            self.t_forward,
            self.t_backward,
            self.t_weight,
        )

    def format(self, result: dict) -> str:
        return pipeline.format_result(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CP(Command):
    """Ring attention on paper: attention blocks computed and masked per rank, the imbalance."""

    cp: int = option(4, help="context-parallel degree")
    causal: bool = option(True)
    zigzag: bool = option(True)

    def run(self) -> dict:
        return context_parallel.work_summary(self.cp, causal=self.causal, zigzag=self.zigzag)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoE(Command):
    """A mixture of experts on paper: total vs active parameters, parameters per rank."""

    preset: str | None = option(None, choices=("mixtral-8x7b",), help="a published model")
    hidden: int = option(4096)
    layers: int = option(32)
    heads: int = option(32)
    kv_heads: int = option(8)
    ffn: int = option(14336, help="one expert's SwiGLU hidden size")
    vocab: int = option(32000)
    experts: int = option(8)
    top_k: int = option(2)
    ep: int = option(1, help="expert-parallel ranks (for the per-rank count)")

    def run(self) -> dict:
        if self.preset == "mixtral-8x7b":
            spec = moe.MIXTRAL_8X7B
        else:
            dense = ModelSpec(
                vocab_size=self.vocab,
                hidden=self.hidden,
                n_layers=self.layers,
                n_heads=self.heads,
                n_kv_heads=self.kv_heads,
                ffn_hidden=self.ffn,
            )
            spec = moe.MoESpec(dense, n_experts=self.experts, top_k=self.top_k)
        return moe.param_summary(spec, ep=self.ep)

    def format(self, result: dict) -> str:
        return moe.format_result(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan(ModelOptions):
    """The parallelism planner: the fastest layout that fits, or a layout you give."""

    GROUPS: ClassVar[dict[str, str]] = {"model": MODEL, "run": "training run", "cluster": "cluster"}

    seq: int = option(group="run", help="sequence length")
    global_batch: int | None = option(
        None, group="run", help="sequences per step (default: ~4M tokens)"
    )
    mbs: int | None = option(
        None, group="run", help="micro-batch size (default: the planner tries 1, 2, 4, 8)"
    )
    precision: str = option(
        ASSUMPTIONS["precision"], group="run", help=" or ".join(memory.PRECISIONS)
    )
    optimizer: str = option(
        ASSUMPTIONS["optimizer"], group="run", help=", ".join(memory.OPTIMIZERS)
    )
    recompute: str = option(ASSUMPTIONS["recompute"], group="run", help="none, selective or full")
    schedule: str | None = option(
        None,
        group="run",
        help=f"pipeline schedule: {', '.join(memory.PP_SCHEDULES)} (default: the planner tries"
        " 1f1b, interleaved and zb-h1)",
    )
    headroom: float = option(
        ASSUMPTIONS["headroom"], group="run", help=f"default {ASSUMPTIONS['headroom']}"
    )
    efficiency: float = option(
        ASSUMPTIONS["efficiency"], group="run", help=f"default {ASSUMPTIONS['efficiency']}"
    )
    fp32_grad_accum: bool = option(
        False, group="run", help="bf16-mixed: accumulate gradients in fp32 and reduce them in fp32"
    )
    comm_efficiency: float = option(
        ASSUMPTIONS["comm_efficiency"],
        group="run",
        help="share of a link's bandwidth a collective reaches"
        f" (default {ASSUMPTIONS['comm_efficiency']})",
    )
    overlap_penalty: float = option(
        ASSUMPTIONS["overlap_penalty"],
        group="run",
        help="share of overlapped communication that still slows the compute beside it"
        f" (default {ASSUMPTIONS['overlap_penalty']})",
    )
    layout: str | None = option(
        None,
        group="run",
        help="evaluate this layout instead of planning: tp=8,pp=16,cp=1,dp=128"
        "[,zero=1,v=2,schedule=interleaved,mbs=1]",
    )
    gpus: int = option(group="cluster", help="GPUs in all")
    gpus_per_node: int = option(8, group="cluster")
    gpu: str = option(
        "H100 80GB", group="cluster", help=" | ".join(presets.GPUS) + " (memory and peak FLOP/s)"
    )
    gpu_mem: str | None = option(
        None,
        group="cluster",
        help="GiB per GPU (overrides --gpu's; 79.6GiB or 80GB also work: memory is in GiB)",
    )
    peak_tflops: float | None = option(
        None, group="cluster", help="dense bf16 TFLOP/s per GPU (overrides --gpu's)"
    )
    intra_bw: float | None = option(
        None, group="cluster", help="GB/s per GPU inside a node (default: the --gpu's NVLink)"
    )
    inter_bw: float | None = option(
        None, group="cluster", help="GB/s per GPU between nodes (default: the --gpu's NIC)"
    )
    export: str | None = option(
        None,
        group="cluster",
        choices=("torchrun", "accelerate", "deepspeed"),
        help="print a launch command or config instead of the plan: for the fastest layout that"
        " tool can express (accelerate: no PP, ZeRO-2/3; DeepSpeed: no CP)",
    )
    offload: bool = option(
        False, group="cluster", help="DeepSpeed export: optimizer state on the CPU"
    )

    def run(self) -> dict:
        name, spec = self.model()
        return planner_report.report(
            spec,
            model=name,
            seq=self.seq,
            gpus=self.gpus,
            gpus_per_node=self.gpus_per_node,
            global_batch=self.global_batch,
            layout=self.layout,
            export=self.export,
            offload=self.offload,
            gpu=self.gpu,
            gpu_mem=self.gpu_mem,
            peak_tflops=self.peak_tflops,
            intra_bw=self.intra_bw,
            inter_bw=self.inter_bw,
            **{key: getattr(self, key) for key in ASSUMPTIONS},
        )

    def format(self, result: dict) -> str:
        return planner_report.format_result(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Infer(Command):
    """Serving on paper: KV cache per rank, its capacity, decode time for TP and placement."""

    preset: str = option("llama3-8b", help=f"one of {', '.join(presets.PRESETS)}")
    degree: int = option(8, help="N: GPUs for the model (tp or pp degree)")
    batch: int = option(1, help="B: sequences decoded together")
    seq: int = option(4096, help="T: cached positions per sequence")
    gpu: str = option("H100 80GB", help=f"one of {', '.join(inference.HBM_TBS)}")
    dtype_bytes: int = option(2, help="e: bytes per weight and cache element")

    def run(self) -> dict:
        return inference.serving_figures(
            self.preset,
            degree=self.degree,
            batch=self.batch,
            seq=self.seq,
            gpu=self.gpu,
            dtype_bytes=self.dtype_bytes,
        )

    def format(self, result: dict) -> str:
        return inference.format_result(result)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Multimodal(ModelOptions):
    """The planner with an image encoder in front of the decoder: memory and pipeline per stage."""

    GROUPS: ClassVar[dict[str, str]] = {
        "model": "the decoder: a preset of the memory calculator, or free dimensions"
    }

    preset: str | None = option("llama3-8b", group="model", help=", ".join(presets.PRESETS))
    encoder: str = option("siglip-so400m", help=f"one of {', '.join(ENCODERS)}")
    encoder_tokens: int | None = option(None, help="override the encoder's")
    encoder_hidden: int | None = option(None, help="override the encoder's")
    encoder_n_layers: int | None = option(None, help="override the encoder's")
    encoder_n_heads: int | None = option(None, help="override the encoder's")
    encoder_ffn_hidden: int | None = option(None, help="override the encoder's")
    encoder_patch_dim: int | None = option(None, help="override the encoder's")
    text_tokens: int = option(help="C: text tokens per sample")
    gpus: int = option()
    gpus_per_node: int = option(8)
    gpu_mem: float = option(80.0, help="GiB per GPU")
    peak_tflops: float = option(989.0)
    global_batch: int | None = option(None, help="sequences per step (default: ~4M tokens)")
    layout: str | None = option(None, help="dp,tp,pp,cp,zero instead of the planner's choice")

    def run(self) -> dict:
        name, spec = self.model()
        dims = planner_multimodal.ENCODER_DIMS
        return planner_multimodal.report(
            spec,
            model=name,
            encoder=self.encoder,
            encoder_dims={d: getattr(self, "encoder_" + d) for d in dims},
            text_tokens=self.text_tokens,
            gpus=self.gpus,
            gpus_per_node=self.gpus_per_node,
            gpu_mem=self.gpu_mem,
            peak_tflops=self.peak_tflops,
            global_batch=self.global_batch,
            layout=self.layout,
        )

    def format(self, result: dict) -> str:
        return planner_multimodal.format_result(result)


COMMANDS: dict[str, type[Command]] = {
    "comm": Comm,  # bytes per rank of a collective
    "memory": Memory,  # notebook 01: per-rank memory
    "bubble": Bubble,  # notebook 05: pipeline bubble
    "cp": CP,  # notebook 06: ring-attention work per rank
    "moe": MoE,  # notebook 07: active vs total parameters
    "plan": Plan,  # notebook 08: the parallelism planner
    "infer": Infer,  # notebook 09: KV cache, messages per token, decode time
    "multimodal": Multimodal,  # notebook 11: an encoder's memory and pipeline imbalance
}


def parser() -> argparse.ArgumentParser:
    """The command line: one sub-command per entry of ``COMMANDS``, each with ``--json``."""
    top = argparse.ArgumentParser(prog="python -m labs.theory", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.__doc__.splitlines()[0])
        add_options(p, command)
        p.add_argument("--json", action="store_true", help="print one JSON object")
    return top


def parse(argv: list[str]) -> tuple[Command, bool]:
    """(the command's options, whether ``--json`` was given) for a command line."""
    args = vars(parser().parse_args(argv))
    command = COMMANDS[args.pop("command")]
    as_json = args.pop("json")
    return command(**args), as_json


def run(argv: list[str]) -> dict:
    """A command line's result, as ``--json`` prints it (a ValueError for invalid input)."""
    options, _ = parse(argv)
    return options.run()


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line), run the command, print its result; the exit
    status."""
    options, as_json = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        result = options.run()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if as_json else options.format(result))
    return 0
