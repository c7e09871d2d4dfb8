"""The device audit: proof, on a machine without a GPU, that a lab would run under NCCL.

    LABS_DEVICE_AUDIT=1 python -m labs.run ddp --nproc 2 --steps 2
    LABS_DEVICE_AUDIT=1 torchrun --standalone --nproc-per-node 2 -m labs.run ddp --steps 2

NCCL has no CPU path: one host tensor that reaches a collective crashes a GPU run, and so
does one operation that mixes a GPU tensor with a CPU tensor. On a laptop every tensor is a
CPU tensor, so nothing shows the mistake until the workshop. The audit makes it show.

With ``LABS_DEVICE_AUDIT=1`` in the environment, every rank that ``labs.runtime.launch``
starts (or that joins a ``torchrun`` job) runs under the audit, unless the launch asked for
``backend="gloo"`` on purpose (then the CPU is the rank's device for real). In an audited rank:

* ``rank_device()`` returns a stand-in, ``torch.device("cpu", local_rank)``. Tensors made
  with it are ordinary CPU tensors, but the *argument* tells them apart from host tensors;
  ``tensor.device`` reads as the stand-in too, so ``device=p.device`` keeps working.
* a ``TorchFunctionMode`` marks every *host* tensor: a factory call (``torch.zeros``,
  ``torch.tensor``, ``torch.randn``, ...) without a device or with plain ``"cpu"``,
  ``.cpu()``, ``.to("cpu")``, and every tensor that existed before the rank started (made in
  the launching process). ``.to(rank_device())`` gives an unmarked copy; other results follow
  their inputs; parameters follow their data. Tensors that ``torch.distributed``'s own code
  allocates (FSDP2, DTensor, pipelining) are not marked: they are torch's business.
* every ``torch.distributed`` collective and point-to-point call, ``DistributedDataParallel``,
  ``fully_shard`` and ``PipelineStage`` reject a marked tensor or module; an operation that
  mixes a marked tensor (other than a 0-dim scalar, which CUDA accepts) with an unmarked one
  is rejected too; torch's DDP must get ``device_ids`` (``ddp_device_ids()``); and
  ``dist.monitored_barrier`` (gloo only) must come from a launch that forced gloo.

A rejection raises :class:`DeviceAuditError` naming the call, the lab, the line of course
code that made it and where the host tensor was made. With ``LABS_DEVICE_AUDIT_LOG=<file>``
the audit writes each finding to that file, once, and lets the run go on (the tests' table of
findings, lab by lab). ``tests/test_device_audit.py`` runs every lab, every notebook-10
scenario and ``scripts/gpu_check.py``'s workers this way.

The audit is a test harness: it costs a few microseconds per torch call and is never on
unless asked for.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

AUDIT_ENV = "LABS_DEVICE_AUDIT"
AUDIT_LOG_ENV = "LABS_DEVICE_AUDIT_LOG"
# the attribute a host tensor carries: where it was made ("at file:line (function)", or this)
_MARK = "_labs_host_tensor"
BEFORE_RANK = "before the rank started, in the launching process"

# The tensor-carrying calls of torch.distributed (object collectives pickle, so any device is
# fine for them; barrier carries nothing).
AUDITED_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "monitored_barrier",
)
GLOO_ONLY_OPS = {"monitored_barrier": "dist.monitored_barrier exists only on gloo"}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_DISTRIBUTED_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_HERE = os.path.abspath(__file__)
# Frames that pass a call on and are never the line to blame: this module, the ledger's and
# the timeline's wrappers around dist.*, and the mode machinery of torch.
_PLUMBING = {
    _HERE,
    os.path.join(os.path.dirname(os.path.dirname(_HERE)), "measure", "ledger.py"),
    os.path.join(os.path.dirname(os.path.dirname(_HERE)), "measure", "timeline.py"),
}
_MODE_MACHINERY = (
    os.path.join(_TORCH_DIR, "overrides.py"),
    os.path.join(_TORCH_DIR, "utils", "_device.py"),
)


class DeviceAuditError(RuntimeError):
    """A tensor or module that would be on the CPU under NCCL reached a GPU-only place."""


# The audit of this process, while one runs (one per rank process).
_audit: _Audit | None = None


def requested() -> bool:
    """True when ``LABS_DEVICE_AUDIT=1``: launched ranks and torchrun workers run audited."""
    return os.environ.get(AUDIT_ENV, "") == "1"


def stand_in() -> torch.device | None:
    """The audited rank's stand-in for its GPU, ``cpu:<local rank>``; None when no audit runs."""
    return _audit.device if _audit is not None else None


def lab_label(fn: Callable) -> str:
    """The name the audit's messages give a launched function: its lab and qualified name."""
    module = getattr(fn, "__module__", "?") or "?"
    lab = module
    if module.startswith("labs.experiments."):  # labs.experiments.ddp_timeline -> ddp
        lab = module.rsplit(".", 1)[-1].split("_")[0]
    return f"{lab} ({module}.{getattr(fn, '__qualname__', fn)})"


@contextmanager
def audited(label: str, local_rank: int) -> Iterator[None]:
    """Run the block under the audit (see the module docstring); ``label`` names the lab."""
    global _audit
    if _audit is not None:
        raise RuntimeError("a device audit is already running in this process")
    audit = _Audit(label, local_rank, os.environ.get(AUDIT_LOG_ENV) or None)
    mark_host_tensors()
    _audit = audit
    patches = audit.patch()
    try:
        with _HostTensorMode(audit):
            yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
        _audit = None


def is_host(t: torch.Tensor) -> bool:
    """True when the audit marked ``t`` as a host tensor (False outside an audit)."""
    return _audit is not None and getattr(t, _MARK, None) is not None


def mark_host_tensors() -> None:
    """Mark every CPU tensor alive now as made before the rank started: a host tensor.

    An audited rank calls it as the audit starts. A forked rank froze the objects it inherited
    (the launcher), and ``gc.get_objects()`` skips frozen objects: the launcher calls this in the
    launching process just before it forks audited ranks, so the marks are inherited. Walking the
    inherited objects in each rank instead would write to every one of them (a reference each)
    and so copy the parent's whole heap into every rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() wakes deprecated objects' warnings
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for t in tensors:
        if t.device.type == "cpu":
            try:
                _mark(t, BEFORE_RANK)
            except (AttributeError, RuntimeError):
                pass


# --- where a call comes from ----------------------------------------------------------------


def _first_outside(frame, skip_torch: bool):
    """The first frame at or above ``frame`` that is not plumbing (and, with ``skip_torch``, not
    in torch or the standard library)."""
    while frame is not None:
        name = frame.f_code.co_filename
        # another torch-function mode (e.g. a FLOP counter) passes the call on: not its line
        if (
            name in _PLUMBING
            or name.startswith(_MODE_MACHINERY)
            or (frame.f_code.co_name == "__torch_function__")
        ):
            frame = frame.f_back
            continue
        if skip_torch and (name.startswith(_TORCH_DIR) or name.startswith(_STDLIB_DIR)):
            frame = frame.f_back
            continue
        return frame
    return None


def _caller_file() -> str:
    """The file of the code that called the torch function being handled."""
    frame = _first_outside(sys._getframe(1), skip_torch=False)
    return frame.f_code.co_filename if frame is not None else ""


def course_site() -> str:
    """``file:line (function)`` of the innermost frame of course code (outside torch, the
    standard library and the audit)."""
    frame = _first_outside(sys._getframe(1), skip_torch=True)
    if frame is None:
        return "(no course code on the stack)"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _made_at() -> str:
    """A host tensor's origin: ``at file:line (function)`` of the course code making it."""
    return f"at {course_site()}"


def _short(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


# --- marks ----------------------------------------------------------------------------------


def _mark(t: torch.Tensor, origin: str | None) -> None:
    if origin is None:
        t.__dict__.pop(_MARK, None)
    else:
        setattr(t, _MARK, origin)


def _origin(t: torch.Tensor) -> str | None:
    return getattr(t, _MARK, None)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in an argument: a tensor, or one inside a list, tuple, dict or P2POp."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 2 and isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


def _module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


# --- the audit ------------------------------------------------------------------------------


class _Audit:
    """One rank's audit: its stand-in device, the checks, and what it patches while it runs."""

    def __init__(self, label: str, local_rank: int, log_path: str | None):
        self.label = label
        self.device = torch.device("cpu", local_rank)
        self.log_path = log_path
        self.logged: set[str] = set()

    def violation(self, what: str, fix: str) -> None:
        """Report one finding: raise, or log it once and go on (``LABS_DEVICE_AUDIT_LOG``)."""
        message = f"device audit, lab {self.label}: {what}; called from {course_site()}. {fix}"
        if self.log_path is None:
            raise DeviceAuditError(message)
        if message not in self.logged:
            self.logged.add(message)
            with open(self.log_path, "a") as f:
                f.write(message.replace("\n", " ") + "\n")

    def check_tensors(self, op: str, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            for t in _tensors(value):
                origin = _origin(t)
                if origin is not None:
                    self.violation(
                        f"{op}() got a CPU tensor {tuple(t.shape)} {t.dtype} (made {origin})",
                        "Under NCCL this crashes: make it on rank_device(), or move it with"
                        " .to(rank_device()).",
                    )

    def check_module(self, op: str, module: torch.nn.Module) -> None:
        for name, t in _module_tensors(module):
            origin = _origin(t)
            if origin is not None:
                self.violation(
                    f"{op} got a module whose {name} is on the CPU (made {origin})",
                    "Move the module with .to(rank_device()) first.",
                )
                return

    # Patches: dist.* in both namespaces (P2POp compares with c10d's names), the entry
    # points of torch's own parallel wrappers, and Parameter creation.
    def patch(self) -> list[tuple[object, str, object]]:
        patches: list[tuple[object, str, object]] = []

        def put(owner, name, new):
            patches.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)

        for op in AUDITED_OPS:
            wrapper = self._checked(op, getattr(c10d, op))
            for module in (dist, c10d):
                put(module, op, wrapper)
        from torch.nn.parallel import DistributedDataParallel

        put(DistributedDataParallel, "__init__", self._checked_ddp(DistributedDataParallel))
        import torch.distributed.fsdp as fsdp

        put(fsdp, "fully_shard", self._checked_entry("fully_shard", fsdp.fully_shard))
        from torch.distributed.pipelining import PipelineStage

        put(PipelineStage, "__init__", self._checked_stage(PipelineStage.__init__))
        put(torch.nn.Parameter, "__new__", self._marked_parameter(torch.nn.Parameter.__new__))
        return patches

    def _checked(self, op: str, original: Callable) -> Callable:
        audit = self

        @functools.wraps(original)
        def checked(*args, **kwargs):
            if op in GLOO_ONLY_OPS:
                audit.violation(
                    f"{GLOO_ONLY_OPS[op]}, and this rank would run NCCL",
                    "Launch the scenario with backend='gloo' (and say why), or use dist.barrier().",
                )
            audit.check_tensors(f"dist.{op}", args, kwargs)
            return original(*args, **kwargs)

        return checked

    def _checked_ddp(self, cls) -> Callable:
        audit = self
        original = cls.__init__
        signature = inspect.signature(original)

        @functools.wraps(original)
        def init(ddp, *args, **kwargs):
            bound = signature.bind(ddp, *args, **kwargs)
            audit.check_module("DistributedDataParallel", bound.arguments["module"])
            ids = bound.arguments.get("device_ids")
            if ids is None:
                audit.violation(
                    "DistributedDataParallel got no device_ids",
                    "On a GPU torch's DDP needs device_ids=[local rank]: pass"
                    " device_ids=ddp_device_ids(rank_device()).",
                )
            elif list(ids) != [audit.device.index]:
                audit.violation(
                    f"DistributedDataParallel got device_ids={list(ids)}, not this rank's"
                    f" [{audit.device.index}]",
                    "Pass device_ids=ddp_device_ids(rank_device()).",
                )
            bound.arguments["device_ids"] = None  # the stand-in is a CPU device
            original(*bound.args, **bound.kwargs)

        return init

    def _checked_entry(self, name: str, original: Callable) -> Callable:
        audit = self

        @functools.wraps(original)
        def entry(module, *args, **kwargs):
            for m in module if isinstance(module, list) else [module]:
                audit.check_module(name, m)
            return original(module, *args, **kwargs)

        return entry

    def _checked_stage(self, original: Callable) -> Callable:
        audit = self
        signature = inspect.signature(original)

        @functools.wraps(original)
        def init(stage, *args, **kwargs):
            bound = signature.bind(stage, *args, **kwargs)
            audit.check_module("PipelineStage", bound.arguments["submodule"])
            device = bound.arguments["device"]
            if torch.device(device) != audit.device:
                audit.violation(
                    f"PipelineStage got device={device}, not this rank's device",
                    "Pass device=rank_device().",
                )
            original(*bound.args, **bound.kwargs)

        return init

    def _marked_parameter(self, original: Callable) -> Callable:
        def new(cls, data=None, requires_grad=True):
            param = original(cls, data, requires_grad)
            if data is not None:
                _mark(param, _origin(data))
            return param

        return staticmethod(new)


# --- the mode that marks host tensors ---------------------------------------------------------

_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.from_numpy,
    torch.frombuffer,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.tril_indices,
    torch.triu_indices,
}
# Factories that copy a tensor argument: without a device, the copy stays where its data is.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# Like their input unless given a device.
_LIKE = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_empty,
    torch.Tensor.new_full,
    torch.Tensor.new_tensor,
    torch.Tensor.new_empty_strided,
}
# Operations CUDA allows across devices (the copies, a CPU index), and questions about tensors
# that compute nothing (``Module.to`` asks them).
_MIXED_OK = {
    torch.Tensor.copy_,
    torch.Tensor.to,
    torch.Tensor.__getitem__,
    torch.Tensor.set_,
    torch.Tensor.type_as,
    torch._has_compatible_shallow_copy_type,
    torch.is_same_size,
    torch.Tensor.is_set_to,
}
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}


class _HostTensorMode(TorchFunctionMode):
    """Marks host tensors as they are made and follows the marks through every torch call."""

    def __init__(self, audit: _Audit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("__get__", "__set__") and hasattr(func, "__self__"):
            return self._property(func, args, kwargs)
        if func in _BACKWARD:
            return self._backward(func, args, kwargs)
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func in _LIKE and kwargs.get("device") is not None:
            return self._factory(func, args, kwargs)
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        if func is torch.Tensor.cpu:
            return self._to((args[0], "cpu"), {})
        if func is torch.Tensor.__setitem__ and len(args) == 3:
            self._check_mixed("tensor[...] = value", [args[0], *_tensors(args[2])])
            return func(*args, **kwargs)
        return self._op(func, args, kwargs)

    # -- every other op: check the devices agree, results follow the inputs
    def _op(self, func, args, kwargs):
        inputs = [t for value in (*args, *kwargs.values()) for t in _tensors(value)]
        out = func(*args, **kwargs)
        if not any(_origin(t) is not None for t in inputs):
            return out  # the common case: nothing on the host, nothing to follow
        if func in _MIXED_OK:
            origin = _origin(inputs[0])
        else:
            origin = self._check_mixed(getattr(func, "__name__", str(func)), inputs)
        self._follow(out, origin, inputs)
        return out

    def _check_mixed(self, name: str, inputs: list[torch.Tensor]) -> str | None:
        """The origin the result gets: a host input's unless a device tensor is among the inputs.
        Mixing a host tensor (more than a 0-dim scalar) with a device tensor is a finding."""
        host = [t for t in inputs if _origin(t) is not None]
        device = [t for t in inputs if _origin(t) is None and t.device.type == "cpu"]
        if not host:
            return None
        if not device:
            return _origin(host[0])
        big = [t for t in host if t.dim() > 0]
        if big:
            self.audit.violation(
                f"{name}() mixes a device tensor with a CPU tensor {tuple(big[0].shape)}"
                f" (made {_origin(big[0])})",
                "On a GPU this raises 'Expected all tensors to be on the same device': make"
                " the CPU tensor on rank_device().",
            )
        return None

    @staticmethod
    def _follow(out, origin: str | None, inputs: list[torch.Tensor]) -> None:
        seen = {id(t) for t in inputs}
        for t in _tensors(out):
            if id(t) not in seen:
                _mark(t, origin)

    # -- factories: a host tensor unless made on the stand-in
    def _factory(self, func, args, kwargs):
        caller = _caller_file()
        given = kwargs.get("device")
        generator = kwargs.get("generator")
        out = func(*args, **kwargs)
        if caller.startswith(_TORCH_DISTRIBUTED_DIR):
            return out  # torch.distributed's own buffers: not the course's to place
        if given is None and func in _FROM_DATA and args and isinstance(args[0], torch.Tensor):
            self._follow(out, _origin(args[0]), [])  # a copy stays where its data is
            return out
        device = torch.device(given) if given is not None else torch.get_default_device()
        on_device = device == self.audit.device
        if on_device and generator is not None and generator.device.type == "cpu":
            self.audit.violation(
                f"{func.__name__}() on the rank's device got a CPU generator",
                "On a GPU the generator must be a CUDA one: draw on the CPU, then .to(device).",
            )
        # Host: made on the CPU by the course, or by torch with no device at all (a module's
        # parameters). torch's code that names "cpu" has read it off a tensor: it follows that.
        on_host = device.type == "cpu" and not on_device
        if on_host and (given is None or not caller.startswith(_TORCH_DIR)):
            self._follow(out, _made_at(), [])
        return out

    # -- .to(...) and .cpu(): the target decides
    def _to(self, args, kwargs):
        t = args[0]
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            origin = _origin(args[1])
        else:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            device = torch._C._nn._parse_to(*args[1:], **parse)[0]
            if device is None or (device.type == "cpu" and device != self.audit.device):
                origin = _origin(t)
                if device is not None and not _caller_file().startswith(_TORCH_DIR):
                    origin = origin or _made_at()  # the course moves it to the host
            elif device == self.audit.device:
                origin = None
            else:
                origin = _origin(t)
        out = torch.Tensor.to(*args, **kwargs)
        if out is t and origin != _origin(t):
            out = torch.Tensor.to(*args, **{**kwargs, "copy": True})  # a move is a new tensor
        if out is not t:
            _mark(out, origin)
        return out

    # -- properties: .device reads as the stand-in, .grad and .data follow their tensor
    def _property(self, func, args, kwargs):
        name = func.__self__.__name__
        setter = func.__name__ == "__set__"
        t = args[0]
        if name == "data" and setter:
            func(*args)
            _mark(t, _origin(args[1]))
            return None
        if name == "grad" and setter:
            if isinstance(args[1], torch.Tensor):
                self._check_mixed("param.grad = ...", [t, args[1]])
            return func(*args)
        if name == "device":
            out = func(*args)
            if _origin(t) is None and out.type == "cpu":
                if not _caller_file().startswith(_TORCH_DIR):
                    return self.audit.device
            return out
        if name in ("grad", "data"):
            out = func(*args)
            if isinstance(out, torch.Tensor) and out is not t:
                _mark(out, _origin(t))
            return out
        return self._op(func, args, kwargs)  # .T, .mT, .real, ...: like any op

    # -- backward: run the engine with this mode on, so hooks and Function.backward are audited
    def _backward(self, func, args, kwargs):
        if func is torch.Tensor.backward:
            tensors = (args[0],)
            grads = args[1] if len(args) > 1 else kwargs.get("gradient")
            retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
            create = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
            inputs = kwargs.get("inputs")
        else:
            tensors = args[0] if len(args) > 0 else kwargs["tensors"]
            grads = kwargs.get("grad_tensors", args[1] if len(args) > 1 else None)
            retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
            create = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
            inputs = kwargs.get("inputs")
        if inputs is not None or create:
            return func(*args, **kwargs)  # rare forms: run them unaudited inside
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = torch.autograd._tensor_or_tensors_to_tuple(grads, len(tensors))
        grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
        with self:
            torch.autograd.graph._engine_run_backward(
                tensors,
                grads,
                bool(retain),
                False,
                (),
                allow_unreachable=True,
                accumulate_grad=True,
            )
        return None
