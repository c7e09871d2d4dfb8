"""Exercise 01 (notebooks/01_memory_anatomy.ipynb): measure what a training step holds, to the
byte.

Two counts the memory calculator (``labs.theory.memory``) predicts:

* the training state: parameters, their gradients and the optimizer's tensors (AdamW: two
  moments per parameter), ``numel * element_size`` of the real tensors, a tensor that shares
  its storage with another (tied weights) counted once;
* the activations: every tensor autograd keeps from the forward pass for the backward pass.
  ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` hands each of them to ``pack``
  the moment it is saved; ``pack`` returns what autograd stores (here the tensor itself, so
  backward still works) and ``unpack`` gives it back in backward. Views share one storage
  (``t.untyped_storage()``): count each storage once, ``storage.nbytes()`` bytes. A linear
  layer saves its weight too: the model's parameters are already counted as parameters, so
  leave their storages out.

No communication: one process, the course model (``labs.models.transformer``), CPU or GPU.
``labs.measure.memory`` is the course's own version, used by the notebook's lab; write yours
without it.

Reference: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4 (what a layer saves); the PyTorch docs, "Hooks for saved tensors".
"""

from __future__ import annotations

import torch

from labs.experiments.common import course_spec
from labs.models.transformer import ModelConfig, build_model
from labs.theory.memory import memory_per_rank
from labs.train import TrainConfig, data_for, make_optimizer

NOTEBOOK = "01_memory_anatomy.ipynb"
# The lab has one part, its core, and the minutes it takes at the notebook's pace
# (labs.check.parts); each function's docstring names its part.
PARTS = {"core": 60}


def training_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Bytes of ``{"params", "grads", "optimizer"}`` this process holds.

    params: every parameter of ``model``, one tensor reached twice (tied weights) counted once;
    grads: the ``.grad`` of those parameters that have one; optimizer: every tensor in
    ``optimizer.state`` with at least one dimension (AdamW's ``exp_avg``, ``exp_avg_sq``; its
    0-dim ``step`` counters are bookkeeping, not state per parameter).

    Part: core.
    """

    ### BEGIN SOLUTION
    def unique_bytes(tensors: list[torch.Tensor]) -> int:
        # the same memory is the same tensor: storage, offset into it and length
        seen = {
            (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): t.numel()
            * t.element_size()
            for t in tensors
        }
        return sum(seen.values())

    params = list(model.parameters())
    moments = [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "params": unique_bytes(params),
        "grads": unique_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": unique_bytes(moments),
    }
    ### END SOLUTION


def saved_activation_bytes(
    model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Run the forward pass ``logits, loss = model(idx, targets)`` once and count the bytes
    autograd saves for backward: ``(loss, bytes)``.

    idx, targets: [B, T] token ids. Inside ``torch.autograd.graph.saved_tensors_hooks``, the
    pack hook sees every saved tensor: count each storage once (views share one), and not the
    storages of ``model``'s parameters. The loss must still backpropagate afterwards.

    Part: core.
    """
    ### BEGIN SOLUTION
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}  # data pointer -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, targets)
    return loss, sum(storages.values())
    ### END SOLUTION


def measure_course_model(
    *, dtype: torch.dtype = torch.float32, batch_size: int = 8, seq_len: int = 32
) -> dict[str, dict[str, int]]:
    """Your counts on the course model after one AdamW step, beside the calculator's figures
    (``labs.theory.memory.memory_per_rank``): ``{name: {"measured", "calculator"}}`` for
    "activations" and, in float32, "params", "grads" and "optimizer".

    dtype: torch.float32, or torch.bfloat16 (the model computes in bf16; only the activations
    are compared then: the calculator's bf16-mixed state includes fp32 master weights that this
    one-process run does not keep). One process, well under a second on a CPU.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype} is not one of (torch.float32, torch.bfloat16)")
    cfg = ModelConfig()
    model = build_model(cfg, seed=0, dtype=dtype)
    train = TrainConfig(batch_size=batch_size, seq_len=seq_len)
    idx, targets = data_for(train)[0]
    optimizer = make_optimizer(model.parameters(), train)
    loss, activations = saved_activation_bytes(model, idx, targets)
    loss.backward()
    optimizer.step()
    predicted = memory_per_rank(
        course_spec(cfg),
        seq=seq_len,
        mbs=batch_size,
        precision="fp32" if dtype == torch.float32 else "bf16-mixed",
        optimizer="adamw",
    )
    rows = {"activations": (activations, predicted["activation_bytes"])}
    if dtype == torch.float32:
        state = training_state_bytes(model, optimizer)
        calculator = {
            "params": "param_bytes",
            "grads": "grad_bytes",
            "optimizer": "optimizer_bytes",
        }
        for name, key in calculator.items():
            rows[name] = (state[name], predicted[key])
    return {
        name: {"measured": measured, "calculator": int(calculator)}
        for name, (measured, calculator) in rows.items()
    }
