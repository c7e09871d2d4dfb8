"""Every API name the notebooks and the README cite in backticks resolves against the code, so that
a rename cannot leave stale text behind (issue 28: 08 and 11 named ``shard_model`` long after it
was gone).

What is checked, in the README and every notebook's Markdown cells (code cells run, so nbval
checks those):

* a dotted name under ``labs.`` or ``solutions.`` (``labs.theory.comm.all_reduce_bytes``,
  ``labs.train.train_reference(mixed=...)``): importable, attribute by attribute;
* a name under ``torch.`` (or its usual aliases ``dist.``, ``F.``, ``nn.``): torch has it;
* ``Class.attr`` where ``Class`` is one of the course's classes (``NaiveDDP.finish_gradient_
  synchronization``): the class has it;
* any other name (``train_step_1f1b``, ``bucket_mb``, ``max_rel_param_diff``): the course's code
  uses it (a function, class, argument, attribute or key of ``labs/`` or ``solutions/``), or torch
  or Python has it, or it is one of the other tools' names in ``OTHER_TOOLS``;
* ``python -m labs.X ...`` (in backticks or in a fenced block): the module exists, its lab or
  subcommand is one of its own, and every ``--option`` is one its ``--help`` lists;
* a repository path (``labs/ddp.py``, ``scripts/test.sh``): it exists.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from functools import cache

import nbformat
import pytest

from tests.helpers import ROOT

# Names of other tools the text cites for comparison, by paragraph: transformers, accelerate and
# torch's (not attributes of the modules searched); Megatron-LM, picotron and DeepSpeed; vLLM,
# TensorRT-LLM, ollama and nbgrader; the environment, the shell and pip's platform tags; words
# that are not names. A name of the course is never here: it must resolve against the code.
OTHER_TOOLS = set(
    """
    DynamicCache StaticCache LlamaForCausalLM MixtralForCausalLM MixtralSparseMoeBlock
    SiglipVisionModel DistributedConfig from_pretrained parallelism_config fsdp_config
    fsdp_transformer_layer_cls_to_wrap device_map transformers accelerate generate attention_mask
    do_sample tp_plan PipelineStage Schedule1F1B ScheduleDualPipeV ScheduleGPipe
    ScheduleInterleaved1F1B ScheduleInterleavedZeroBubble ScheduleZBVZeroBubble CPUOffloadPolicy
    MixedPrecisionPolicy ZeroRedundancyOptimizer DistributedDataParallel DistributedSampler
    DataLoader parallelize_module PrepareModuleInput loss_parallel init_device_mesh ignored_params
    set_modules_to_forward_prefetch set_modules_to_backward_prefetch GradScaler
    convert_to_float8_training enable_fsdp_float8_all_gather main_grad DTensor ddp_device_ids
    device_ids device_id OpType SeqNum fr_trace torchfrtrace torchrun reshard_after_forward
    find_unused_parameters gradient_as_bucket_view unshard

    LinearWithGradAccumulationAndAsyncCommunication LinearWithAsyncAllReduce
    _compute_bucket_assignment_by_size zero_optimization allgather_bucket_size reduce_bucket_size
    stage3_param_persistence_threshold stage3_prefetch_bucket_size overlap_comm offload_optimizer
    offload_param deepspeed GatheredParameters engine save_checkpoint ds_to_universal zero_to_fp32

    tensor_parallel_size pipeline_parallel_size max_model_len max_num_seqs max_num_batched_tokens
    enable_chunked_prefill gpu_memory_utilization KvCacheConfig free_gpu_memory_fraction
    max_batch_size max_num_tokens max_seq_len num_ctx num_batch num_gpu nbgrader generate_feedback

    CUDA_VISIBLE_DEVICES NCCL_DEBUG NCCL_SOCKET_IFNAME NCCL_DEBUG_FILE
    TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_ENABLE_MONITORING TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
    TORCH_NCCL_TRACE_BUFFER_SIZE TORCH_FR_BUFFER_SIZE TORCH_NCCL_DUMP_ON_TIMEOUT
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE OLLAMA_CONTEXT_LENGTH OLLAMA_NUM_PARALLEL PYTHONPATH TMPDIR TMUX
    HOST0 EADDRINUSE RLIMIT_FSIZE RLIMIT_NPROC srun dmesg passwd chromium bash pip jupyter
    pypi manylinux_2_28_x86_64 macosx_14_0_arm64 win_amd64

    PASS FAIL if with return e x fn valid shadow up gate
    """.split()
)
ALIASES = {"dist": "torch.distributed", "F": "torch.nn.functional", "nn": "torch.nn"}
NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(\(.*\))?$")
COMMAND = re.compile(r"python -m (labs(?:\.[a-z_]+)+)([^`\n]*)")
PATH = re.compile(r"^(?:labs|solutions|tests|scripts|notebooks|docs|hidden_tests)/[\w./-]+$")


def cited_texts() -> dict[str, str]:
    """Where names are cited: the README and every notebook's Markdown."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        texts[path.name] = "\n\n".join(c.source for c in cells if c.cell_type == "markdown")
    return texts


def spans(text: str) -> list[str]:
    """The backticked spans outside fenced code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", prose)


@cache
def course_vocabulary() -> frozenset[str]:
    """Every identifier the course's code uses: definitions, arguments, attributes, names, and
    string constants that are identifiers (summary keys, option values)."""
    words = set()
    for folder in ("labs", "solutions"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    words.add(node.name)
                elif isinstance(node, ast.arg):
                    words.add(node.arg)
                elif isinstance(node, ast.Attribute):
                    words.add(node.attr)
                elif isinstance(node, ast.Name):
                    words.add(node.id)
                elif isinstance(node, ast.keyword) and node.arg:
                    words.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return frozenset(words)


@cache
def cli_options(module: str, command: str | None) -> frozenset[str] | None:
    """The ``--options`` that ``python -m module [command] --help`` lists (None: ``command`` is
    not one of the module's labs or subcommands)."""
    import contextlib
    import io

    main_module = "labs.theory.__main__" if module == "labs.theory" else module
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            importlib.import_module(main_module).main([*([command] if command else []), "--help"])
        except SystemExit as e:
            if e.code:
                return None
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.getvalue()))


@cache
def external_vocabulary() -> frozenset[str]:
    import torch
    import torch.distributed
    import torch.nn.functional

    words = set(dir(builtins))
    for obj in (
        torch,
        torch.Tensor,
        torch.nn,
        torch.nn.Module,
        torch.nn.functional,
        torch.distributed,
        torch.optim.Optimizer,
        torch.autograd,
    ):
        words.update(dir(obj))
    return frozenset(words | OTHER_TOOLS)


def resolve_dotted(name: str) -> bool:
    """``name`` (a.b.c) is a module, or a module's attribute chain."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@cache
def course_classes() -> dict[str, list[type]]:
    """Class name -> the classes of that name in the course's packages."""
    import inspect
    import pkgutil

    import labs
    import solutions

    classes: dict[str, list[type]] = {}
    for package in (labs, solutions):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            try:
                module = importlib.import_module(info.name)
            except (
                Exception
            ):  # a module that needs what this machine lacks: its names are not cited
                continue
            for name, obj in vars(module).items():
                if inspect.isclass(obj) and obj.__module__ == module.__name__:
                    classes.setdefault(name, []).append(obj)
    return classes


def unresolved(span: str) -> str | None:
    """Why ``span`` does not resolve, or None when it does (or is not a name at all)."""
    if "/" not in span and "." in span and (ROOT / span).is_file():
        return None  # a file of the repository: requirements.txt
    if PATH.match(span):
        return None if (ROOT / span.split("::")[0]).exists() else "no such file"
    match = NAME.match(span.strip())
    if not match:
        return None  # an expression, a shape, a command: not a name
    name = match.group(1)
    head, *rest = name.split(".")
    if head in ("labs", "solutions") or head in ("torch",) or head in ALIASES:
        full = ".".join([ALIASES.get(head, head), *rest])
        return None if resolve_dotted(full) else f"{full} does not resolve"
    if rest and head in course_classes():
        if any(hasattr(cls, rest[0]) for cls in course_classes()[head]):
            return None
        return f"no class {head} of the course has {rest[0]}"
    vocabulary = course_vocabulary() | external_vocabulary()
    missing = [part for part in name.split(".") if part not in vocabulary]
    return f"{', '.join(missing)}: not in the course's code" if missing else None


def test_every_cited_name_resolves_against_the_code():
    stale = {}
    for where, text in cited_texts().items():
        for span in spans(text):
            why = unresolved(span)
            if why:
                stale.setdefault(where, set()).add(f"`{span}`: {why}")
    assert not stale, "stale names:\n" + "\n".join(
        f"{where}: {'; '.join(sorted(found))}" for where, found in stale.items()
    )


def test_every_cited_command_runs_a_module_with_those_options():
    problems = []
    for where, text in cited_texts().items():
        for module, args in COMMAND.findall(text):
            if importlib.util.find_spec(module) is None:
                problems.append(f"{where}: python -m {module}: no such module")
                continue
            words = args.split()
            # labs.run and labs.theory take a lab or subcommand first (LAB, EX, ...: placeholders)
            command = None
            if module in ("labs.run", "labs.theory") and words and words[0].islower():
                command = words[0]
            options = cli_options(module, command)
            if options is None:
                problems.append(f"{where}: python -m {module} {command}: no such lab or command")
                continue
            for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args):
                if option not in options:
                    problems.append(f"{where}: python -m {module} {command or ''} {option}: no")
    assert not problems, "options the modules do not have:\n" + "\n".join(sorted(set(problems)))


@pytest.mark.parametrize(
    "span, stale",
    [
        ("shard_model", True),  # the name issue 28 found in notebooks 08 and 11
        ("labs.theory.comm.all_reduce_bytes", False),
        ("labs.theory.comm.all_reduce_bites", True),
        ("NaiveDDP.finish_gradient_synchronization", False),
        ("NaiveDDP.finish_gradients", True),
        ("dist.all_reduce(param.grad, async_op=True)", False),
        ("train_step_1f1b", False),
        ("labs/ddp.py", False),
        ("labs/dpp.py", True),
        ("B·T·H", False),  # not a name
    ],
)
def test_the_resolver_tells_a_stale_name_from_a_live_one(span, stale):
    assert (unresolved(span) is not None) == stale, unresolved(span)
