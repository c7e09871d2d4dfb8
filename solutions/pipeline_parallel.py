"""Exercise 05 (notebooks/05_pipeline_parallel.ipynb): pipeline parallelism: stages, GPipe, 1F1B,
interleaved, zero bubble (ZB-H1).

What is split: the layers. Stage s of P holds a contiguous slice of ``layers``; the first also
``tok_emb``, the last ``norm``, ``lm_head`` and the loss. A rank holds only its stage's parameters,
gradients and optimizer state: nothing is replicated, nothing all-reduced.

Communication contract, point to point only, on the pipeline's group (WORLD here, a sub-group
of the mesh in notebook 08; peers are ``dist.get_global_rank(group, s ± 1)``). The plumbing is
given in ``labs.runtime.pipe``: ``Pipe`` (where this rank sits) and ``p2p``, the one way every
schedule here talks (one batch of sends and receives with the neighbours, its results read by
name: ``.from_prev``, ``.from_next``; ``wait_sends=False`` leaves the sends in flight):

    forward   stage s -> s+1   each micro-batch's output activation     [B/M, T, H]
    backward  stage s+1 -> s   the gradient of that activation          [B/M, T, H]

Bytes sent per rank per step: B·T·H·itemsize per direction in which it feeds a neighbour
(M messages of B/M sequences), so 2·B·T·H·itemsize on a middle stage, half on the first and
last, V times that with V chunks (``labs.theory.pipeline.p2p_bytes_per_rank``): independent
of M, while the number of messages (and their latency) grows with M.

Schedules (each rank's order of operations: ``labs.theory.pipeline.schedule_ops``):
    naive        one forward of the whole batch, stage after stage: P-1 of P ranks idle
    AFAB/GPipe   all M forwards, then all M backwards: bubble (P-1)/(M+P-1), M micro-batches held
    1F1B         warm-up, then one forward + one backward, cool-down: same bubble, <= P held
    interleaved  1F1B over V chunks per rank: bubble (P-1)/(V·M+P-1), V times the messages
    ZB-H1        1F1B with each backward split into B (the input's gradient, which the previous
                 stage waits for) and W (the weights', which nobody waits for); stage s holds
                 its s latest W's back to fill the cool-down: bubble (P-1)/(3M+P-1) with
                 F = B = W, min(P, M) micro-batches held (a W needs its micro-batch's graph)

Loss: the mean over the global batch, as in the reference. A micro-batch's cross-entropy is a
mean over its (B/M)·T tokens, so the global mean is (1/M)·Σ_i loss_i: the last stage scales
each micro-batch's loss by 1/M, and the M backwards accumulate the reference's gradient.

The schedules carry no instrumentation: the lab times each ``forward_step``, ``backward_step``,
``backward_input_step`` and ``backward_weight_step`` from outside
(``labs.runtime.pipe.record_ops``).

References: Huang et al., "GPipe" (2019); Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (2021) §2.2; Qi et al., "Zero Bubble Pipeline
Parallelism" (2024) §2-3; picotron; the Ultra-Scale Playbook.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.models.transformer import Transformer, run_blocks
from labs.runtime.pipe import Pipe, p2p
from labs.theory.pipeline import check_schedule, interleaved_op, interleaved_warmup

NOTEBOOK = "05_pipeline_parallel.ipynb"
# The lab's parts in order, with the minutes each takes at the notebook's pace: the core is
# what the next notebooks build on, the others are extensions (labs.check.parts). Each
# function's docstring names its part; `python -m labs.check EX --part NAME` runs one part.
PARTS = {"core": 90, "interleaved": 25, "zero-bubble": 35}


Microbatches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # [(x [b, T], y [b, T]), ...]


class StageModule(nn.Module):
    """One stage of the course model (its own modules, not copies): ``tok_emb`` (first stage), the
    blocks ``layer_ids`` under their names ``layers.<i>.…`` (gradients compare with the reference
    by name), ``norm`` and ``lm_head`` (last stage)."""

    def __init__(self, model: Transformer, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.first = first
        self.last = last
        self.tok_emb = model.tok_emb if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: token ids [b, T] (first stage) or hidden states [b, T, H]. Returns logits [b, T, V]
        (last stage) or hidden states [b, T, H]. The blocks run through the full model's own
        ``run_blocks`` (``labs.models.transformer``), so their rotary tables are the full model's,
        in the activations' dtype (a bf16 stage computes in bf16, as the bf16 model does).

        Part: core.
        """
        ### BEGIN SOLUTION
        h = self.tok_emb(x) if self.first else x  # [b, T, H]
        h = run_blocks(self.layers.values(), h, self.cfg)  # [b, T, H]
        if self.last:
            return self.lm_head(self.norm(h))  # [b, T, V]
        return h
        ### END SOLUTION


def build_stage(model: Transformer, *, plan: Sequence[int], stage: int) -> StageModule:
    """Stage ``stage`` of ``plan``, the layers per stage in order (one entry per virtual stage when
    interleaving). Stage 0 is the first (it embeds), stage len(plan)-1 the last (head, loss).

    Part: core.
    """
    if sum(plan) != len(model.layers) or not 0 <= stage < len(plan):
        raise ValueError(
            f"plan={tuple(plan)} must split all {len(model.layers)} layers and stage={stage} "
            f"must be in 0..{len(plan) - 1}"
        )
    if model.cfg.tie_embeddings and len(plan) > 1:
        raise ValueError(
            "tie_embeddings=True puts one weight on the first and the last stage; untie it for PP"
        )
    ### BEGIN SOLUTION
    start = sum(plan[:stage])
    layer_ids = range(start, start + plan[stage])
    return StageModule(model, layer_ids, first=stage == 0, last=stage == len(plan) - 1)
    ### END SOLUTION


def forward_step(
    stage: StageModule, inputs: torch.Tensor, targets: torch.Tensor, *, n_microbatches: int
) -> torch.Tensor:
    """One micro-batch through ``stage``. ``inputs``: token ids [b, T] (first stage) or the received
    activation [b, T, H], made to require grad (backward fills its ``.grad``). Returns the output
    [b, T, H]; on the last stage the cross-entropy (fp32, mean over b·T) / ``n_microbatches``.

    Part: core.
    """
    ### BEGIN SOLUTION
    if not stage.first:
        inputs.requires_grad_()
    out = stage(inputs)
    if not stage.last:
        return out
    return F.cross_entropy(out.float().flatten(0, 1), targets.flatten()) / n_microbatches
    ### END SOLUTION


def backward_step(
    inputs: torch.Tensor, output: torch.Tensor, output_grad: torch.Tensor | None
) -> torch.Tensor | None:
    """Backward of one micro-batch through one stage: ``output`` is what ``forward_step`` returned,
    ``output_grad`` the gradient from the next stage [b, T, H] (None for the loss). Accumulates
    the parameters' ``.grad``; returns the gradient of ``inputs`` [b, T, H] (None on the first
    stage).

    Part: core.
    """
    ### BEGIN SOLUTION
    torch.autograd.backward(output, grad_tensors=output_grad)
    return inputs.grad if inputs.requires_grad else None
    ### END SOLUTION


def backward_input_step(
    inputs: torch.Tensor, output: torch.Tensor, output_grad: torch.Tensor | None
) -> torch.Tensor | None:
    """B of ZB-H1: the gradient of ``inputs`` [b, T, H] only, what the previous stage waits for
    (``torch.autograd.grad`` with respect to ``inputs``, the graph retained for W); no
    parameter's ``.grad`` changes. Returns None on the first stage (its inputs are token ids,
    nothing to send back).

    Part: zero-bubble (an extension).
    """
    ### BEGIN SOLUTION
    if not inputs.requires_grad:
        return None
    (grad,) = torch.autograd.grad(output, inputs, output_grad, retain_graph=True)
    return grad  # [b, T, H]
    ### END SOLUTION


def backward_weight_step(
    stage: StageModule, output: torch.Tensor, output_grad: torch.Tensor | None
) -> None:
    """W of ZB-H1: the gradients of the stage's parameters for one micro-batch
    (``torch.autograd.grad`` with respect to them), added to their ``.grad``; the graph is freed
    afterwards. It walks the graph a second time, the price of a split readable in a few lines:
    Megatron and torch keep the gradients B computed at each layer's output and run only the
    weight matmuls here.

    Part: zero-bubble (an extension).
    """
    ### BEGIN SOLUTION
    params = [p for p in stage.parameters() if p.requires_grad]
    grads = torch.autograd.grad(output, params, output_grad)
    for p, g in zip(params, grads):
        p.grad = g if p.grad is None else p.grad + g
    ### END SOLUTION


def activation_shape(stage: StageModule, microbatches: Microbatches) -> tuple[int, ...]:
    """The shape [b, T, H] of what a stage sends and receives for one of ``microbatches``."""
    x, _ = microbatches[0]
    return (*x.shape, stage.cfg.n_embd)


@torch.no_grad()
def naive_forward(stage: StageModule, tokens: torch.Tensor, *, pipe: Pipe) -> torch.Tensor | None:
    """Inference with layers placed device after device (``device_map="auto"``): receive [B, T, H]
    from the previous stage (the first embeds ``tokens`` [B, T]), run the stage, send on. Returns
    logits [B, T, V] on the last stage, else None. One stage computes at a time. ``p2p``
    (``labs.runtime.pipe``) does the sends and receives.

    Part: core.
    """
    ### BEGIN SOLUTION
    if stage.first:
        x = tokens  # [B, T]
    else:
        x = p2p(pipe, recv_prev=(*tokens.shape, stage.cfg.n_embd)).from_prev  # [B, T, H]
    out = stage(x)  # [B, T, H] or [B, T, V]
    if not stage.last:
        p2p(pipe, send_next=out)
        return None
    return out
    ### END SOLUTION


def train_step_afab(stage: StageModule, microbatches: Microbatches, *, pipe: Pipe) -> float | None:
    """GPipe (all forward, all backward) over ``microbatches`` [(x [b, T], y [b, T]), ...]. Every
    forward: receive, ``forward_step``, send on, keeping input and output; then every backward in
    the same order: receive the output's gradient, ``backward_step``, send the input's gradient
    back. Returns the step's loss (sum of the scaled micro-batch losses) on the last stage, None
    elsewhere; gradients stay accumulated in ``.grad``. The shape of what travels:
    ``activation_shape``.

    Part: core.
    """
    ### BEGIN SOLUTION
    M = len(microbatches)
    shape = activation_shape(stage, microbatches)  # [b, T, H]
    held = []
    loss = 0.0
    # all forwards: every stage ends up holding M micro-batches
    for x, y in microbatches:
        inp = x if stage.first else p2p(pipe, recv_prev=shape).from_prev
        out = forward_step(stage, inp, y, n_microbatches=M)
        if stage.last:
            loss += out.item()
        else:
            p2p(pipe, send_next=out)
        held.append((inp, out))
    # all backwards, in the same order
    for i in range(M):
        grad = None if stage.last else p2p(pipe, recv_next=shape).from_next
        in_grad = backward_step(*held[i], grad)  # held[i]: (input, output)
        if not stage.first:
            p2p(pipe, send_prev=in_grad)
        held[i] = None  # this micro-batch's graph is gone; drop its tensors too
    return loss if stage.last else None
    ### END SOLUTION


def train_step_1f1b(stage: StageModule, microbatches: Microbatches, *, pipe: Pipe) -> float | None:
    """1F1B (PipeDream-Flush) on stage s: warm-up, min(P-s-1, M) forwards; steady state, one forward
    then one backward (a result's send and the next receive of the other direction in one ``p2p``
    batch); cool-down, the warm-up's backwards. Return value and gradients as in
    :func:`train_step_afab`. Any M works, also M < P.

    Part: core.
    """
    ### BEGIN SOLUTION
    M = len(microbatches)
    shape = activation_shape(stage, microbatches)  # [b, T, H]
    warmup = min(pipe.size - pipe.rank - 1, M)
    held = []
    losses = []

    def input_of(i: int) -> torch.Tensor:
        """Micro-batch i's input: its tokens on the first stage, else received [b, T, H]."""
        x, _ = microbatches[i]
        return x if stage.first else p2p(pipe, recv_prev=shape).from_prev

    def forward(i: int, inp: torch.Tensor) -> torch.Tensor:
        """Micro-batch i through the stage; its input and output are held until its backward."""
        _, y = microbatches[i]
        out = forward_step(stage, inp, y, n_microbatches=M)
        held.append((inp, out))
        if stage.last:
            losses.append(out.item())
        return out

    def backward(grad: torch.Tensor | None) -> torch.Tensor | None:
        """The backward of the oldest micro-batch held."""
        inp, out = held.pop(0)
        return backward_step(inp, out, grad)

    # warm-up: forwards only, so that the last stage can start its first backward
    for i in range(warmup):
        out = forward(i, input_of(i))
        if not stage.last:
            p2p(pipe, send_next=out)
    # steady state: one forward, one backward; at most P - s micro-batches are held
    inp = input_of(warmup) if M > warmup else None
    for i in range(warmup, M):
        out = forward(i, inp)
        if stage.last:
            grad = None
        else:
            grad = p2p(pipe, send_next=out, recv_next=shape).from_next
        in_grad = backward(grad)
        more = i + 1 < M
        if stage.first:
            inp = input_of(i + 1) if more else None
        else:
            received = p2p(pipe, send_prev=in_grad, recv_prev=shape if more else None)
            inp = received.from_prev
    # cool-down: the backwards of the warm-up's micro-batches
    for _ in range(warmup):
        grad = None if stage.last else p2p(pipe, recv_next=shape).from_next
        in_grad = backward(grad)
        if not stage.first:
            p2p(pipe, send_prev=in_grad)
    return sum(losses) if stage.last else None
    ### END SOLUTION


def train_step_zb_h1(stage: StageModule, microbatches: Microbatches, *, pipe: Pipe) -> float | None:
    """ZB-H1 on stage s: 1F1B's forwards and backwards, each backward split into B
    (``backward_input_step``), whose gradient goes back at once, and W (``backward_weight_step``).
    Stage s holds its s latest W's back: after each B the oldest waiting W runs once more than s
    wait; the last s run after the last B, in the cool-down where 1F1B idles. Sends are left in
    flight (``p2p(..., wait_sends=False)``, waited for at the end) and each receive blocks right
    before the B or F that needs it, so a W never waits for a message. Needs M >= P
    (``check_schedule``). Returns as :func:`train_step_afab`.

    Part: zero-bubble (an extension).
    """
    check_schedule("zb-h1", pipe.size, len(microbatches))
    ### BEGIN SOLUTION
    M = len(microbatches)
    shape = activation_shape(stage, microbatches)  # [b, T, H]
    warmup = min(pipe.size - pipe.rank - 1, M)
    held = {}  # micro-batch -> (input, output) until its B, then (output, output grad) until W
    waiting = []  # micro-batches whose W is held back, oldest first
    in_flight = []  # p2p batches whose sends are still travelling
    losses = []

    def forward(i: int) -> None:
        """Receive micro-batch i's input (or take its tokens), run it, send the output on."""
        x, y = microbatches[i]
        inp = x if stage.first else p2p(pipe, recv_prev=shape).from_prev
        out = forward_step(stage, inp, y, n_microbatches=M)
        if stage.last:
            losses.append(out.item())
        else:
            in_flight.append(p2p(pipe, send_next=out, wait_sends=False))
        held[i] = (inp, out)

    def weight(i: int) -> None:
        """W of micro-batch i: its weights' gradients; its graph is freed."""
        out, grad = held.pop(i)
        backward_weight_step(stage, out, grad)

    def backward(i: int) -> None:
        """B of micro-batch i: its input's gradient goes back at once; then the oldest W runs
        unless s W's would be left waiting."""
        grad = None if stage.last else p2p(pipe, recv_next=shape).from_next
        inp, out = held[i]
        in_grad = backward_input_step(inp, out, grad)
        if not stage.first:
            in_flight.append(p2p(pipe, send_prev=in_grad, wait_sends=False))
        held[i] = (out, grad)  # what W needs
        waiting.append(i)
        if len(waiting) > pipe.rank:  # stage s keeps s W's back
            weight(waiting.pop(0))

    # warm-up: forwards only, as in 1F1B
    for i in range(warmup):
        forward(i)
    # steady state: one forward, one B (and the W it releases)
    for i in range(warmup, M):
        forward(i)
        backward(i - warmup)
    # cool-down: the B's of the warm-up's micro-batches
    for i in range(M - warmup, M):
        backward(i)
    # the held-back W's fill the end of the step, where 1F1B idles
    for i in waiting:
        weight(i)
    for sent in in_flight:  # every message has left before the step ends
        sent.wait()
    return sum(losses) if stage.last else None
    ### END SOLUTION


def train_step_interleaved(
    chunks: list[StageModule], microbatches: Microbatches, *, pipe: Pipe
) -> float | None:
    """Interleaved 1F1B (Megatron-LM's order): ``chunks[c]`` is virtual stage c·P + rank; the k-th
    forward / backward is on (micro-batch, chunk) = ``interleaved_op(k, P, V, forward)``. Warm-up:
    ``interleaved_warmup(P, M, rank, V)`` forwards; steady state: forward k+warmup, backward k;
    cool-down: the rest. Sends are left in flight (``p2p(..., wait_sends=False)``, waited for at
    the end); each receive blocks right before the operation that needs it. One neighbour sends
    activations and gradients of several chunks, but every rank runs the same (micro-batch, chunk)
    order and messages of one direction arrive in the order they were sent, so each receive gets
    the message its operation needs. Returns the loss where the last virtual stage is, else
    None.

    Part: interleaved (an extension).
    """
    check_schedule("interleaved", pipe.size, len(microbatches), len(chunks))
    ### BEGIN SOLUTION
    P = pipe.size
    V = len(chunks)
    M = len(microbatches)
    shape = activation_shape(chunks[0], microbatches)  # [b, T, H]
    warmup = interleaved_warmup(P, M, pipe.rank, V)
    total = V * M
    held = {}  # (micro-batch, chunk) -> (input, output) until its backward
    in_flight = []  # p2p batches whose sends are still travelling
    losses = []

    def forward(k: int) -> None:
        """This rank's k-th forward: receive (or take the tokens), run the chunk, send on."""
        mb, c = interleaved_op(k, P, V, True)
        stage = chunks[c]
        x, y = microbatches[mb]
        inp = x if stage.first else p2p(pipe, recv_prev=shape).from_prev
        out = forward_step(stage, inp, y, n_microbatches=M)
        if stage.last:
            losses.append(out.item())
        else:
            in_flight.append(p2p(pipe, send_next=out, wait_sends=False))
        held[mb, c] = (inp, out)

    def backward(k: int) -> None:
        """This rank's k-th backward: receive the output's gradient, run it, send back."""
        mb, c = interleaved_op(k, P, V, False)
        stage = chunks[c]
        grad = None if stage.last else p2p(pipe, recv_next=shape).from_next
        inp, out = held.pop((mb, c))
        in_grad = backward_step(inp, out, grad)
        if not stage.first:
            in_flight.append(p2p(pipe, send_prev=in_grad, wait_sends=False))

    # warm-up: forwards only
    for k in range(warmup):
        forward(k)
    # steady state: one forward, one backward
    for k in range(warmup, total):
        forward(k)
        backward(k - warmup)
    # cool-down: the remaining backwards
    for k in range(total - warmup, total):
        backward(k)
    for sent in in_flight:  # every message has left before the step ends
        sent.wait()
    return sum(losses) if losses else None
    ### END SOLUTION
