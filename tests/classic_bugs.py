"""Instructor-only: the classic mistakes of every lab, each a small edit of the solution, and the
check that must catch it with the hint that must name its cause (``tests/test_classic_bugs.py``
plants each one and runs the lab). It shows solution lines, so the student release leaves it out
(``labs.release.INSTRUCTOR_TESTS``).

    Bug(id, module, old, new, check, hint, options)

``module`` is the module the edit applies to (a solution, or for notebook 01, which has no
exercise module, the lab's own measurement code); ``old`` must occur exactly once in it; ``check``
is the name of a check that must FAIL and ``hint`` a substring of that check's hint. ``options``
are passed to the lab's ``run`` on top of its small run (``RUNS[lab]``: its declaration's
``small_run``, 2 ranks, about a second).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from labs.experiments.spec import command_labs


class Bug(NamedTuple):
    id: str
    module: str
    old: str
    new: str
    check: str
    hint: str
    options: dict = {}


# Each lab's run for the catalog: its declared small run (about a second each on 2 cores).
RUNS = {name: dict(lab.small_run) for name, lab in command_labs().items()}

CATALOG: dict[str, list[Bug]] = {
    "collectives": [
        Bug(
            "reduce-scatter overwrites instead of adding",
            "solutions.collectives",
            "chunks[recv_idx] += incoming",
            "chunks[recv_idx].copy_(incoming)",
            "coded integers: every rank, once, in place",
            "must add each received chunk",
        ),
        Bug(
            "reduce-scatter sends the chunk it is about to receive",
            "solutions.collectives",
            "send_idx = (me - s) % n",
            "send_idx = (me - s - 1) % n",
            "chunk sent in each round",
            "check the (r - s) mod N index",
        ),
        Bug(
            "reduce-scatter walks the ring the wrong way (right on 2 ranks only)",
            "solutions.collectives",
            "send_idx = (me - s) % n\n        recv_idx = (me - s - 1) % n",
            "send_idx = (me + s) % n\n        recv_idx = (me + s - 1) % n",
            "chunk sent in each round",
            "check the (r - s) mod N index",
            dict(nproc=3),
        ),
        Bug(
            "all-gather sends the unreduced chunk",
            "solutions.collectives",
            "send_idx = (me + 1 - s) % n",
            "send_idx = (me - s) % n",
            "chunk sent in each round",
            "check the (r + 1 - s) mod N index",
        ),
        Bug(
            "all-gather stores the received chunk one index off",
            "solutions.collectives",
            "        recv_idx = (me - s) % n\n",
            "        recv_idx = (me - s - 1) % n\n",
            "coded integers: every rank, once, in place",
            "stored at another index",
        ),
        Bug(
            "all-gather adds instead of copying",
            "solutions.collectives",
            "chunks[recv_idx].copy_(incoming)",
            "chunks[recv_idx] += incoming",
            "coded integers: every rank, once, in place",
            "added twice",
        ),
        Bug(
            "reduce-scatter one round short",
            "solutions.collectives",
            "    for s in range(n - 1):\n        send_idx = (me - s) % n",
            "    for s in range(n - 2):\n        send_idx = (me - s) % n",
            "bytes per send",
            "count the rounds of each loop",
        ),
    ],
    "ddp": [
        Bug(
            "naive: no division by the world size",
            "solutions.ddp",
            "                dist.all_reduce(grad, group=self.group)\n"
            "                grad.div_(self.world_size)\n",
            "                dist.all_reduce(grad, group=self.group)\n",
            "naive: gradients after step 1",
            "did you divide the sum by the world size?",
        ),
        Bug(
            "overlapped: waits but never divides",
            "solutions.ddp",
            "            work.wait()\n            reduced.div_(self.world_size)\n",
            "            work.wait()\n",
            "overlapped: gradients after step 1",
            "did you divide the sum by the world size?",
        ),
        Bug(
            "bucketed: the bucket is not divided",
            "solutions.ddp",
            "            self.buckets[i].div_(self.world_size)\n",
            "",
            "bucketed: gradients after step 1",
            "did you divide the sum by the world size?",
        ),
        Bug(
            "no broadcast at wrap time",
            "solutions.ddp",
            "            dist.broadcast(tensor, src=src, group=group)",
            "            pass",
            "naive: weights after wrap equal rank 0's",
            "broadcast every parameter and buffer",
        ),
        Bug(
            "every rank reads rank 0's data",
            "solutions.ddp",
            "        rank=rank,\n        world_size=n,",
            "        rank=0,\n        world_size=n,",
            "naive: losses",
            "its own B/N sequences",
        ),
        Bug(
            "gradients never zeroed between steps",
            "solutions.ddp",
            "    optimizer.zero_grad(set_to_none=True)\n    k = len(micro_batches)",
            "    k = len(micro_batches)",
            "naive: parameters after step 2",
            "are the gradients zeroed at the start of every step",
        ),
        Bug(
            "accumulation: micro-batch losses not divided by K",
            "solutions.ddp",
            "            scaled = loss / k\n",
            "            scaled = loss\n",
            "bucketed: gradients after step 1",
            "divide each micro-batch's loss by the number of micro-batches",
            dict(grad_accum=4),
        ),
        Bug(
            "overlapped: one parameter without a hook",
            "solutions.ddp",
            "for p in self.params\n        ]\n        ### END SOLUTION\n\n"
            "    def on_gradient_ready(self, param: nn.Parameter) -> None:\n"
            '        """Autograd calls',
            "for p in self.params[1:]\n        ]\n        ### END SOLUTION\n\n"
            "    def on_gradient_ready(self, param: nn.Parameter) -> None:\n"
            '        """Autograd calls',
            "overlapped: gradients after step 1",
            "its all-reduce never ran",
        ),
        Bug(
            "bucketed: a bucket closes at twice its capacity",
            "solutions.ddp",
            "if size >= self.bucket_bytes:",
            "if size >= 2 * self.bucket_bytes:",
            "bucketed: all_reduce bytes per call",
            "a bucket closes as soon as it holds >= bucket_mb MiB",
        ),
        Bug(
            "overlapped: hooks communicate inside no_sync",
            "solutions.ddp",
            "        if self.require_backward_grad_sync:\n            reduced = param.grad.to(",
            "        if True:\n            reduced = param.grad.to(",
            "overlapped: all_reduce bytes per call",
            "only by the last micro-batch's backward",
            dict(grad_accum=2),
        ),
        Bug(
            "mixed precision: the optimizer steps the bf16 weights, not the fp32 masters",
            "solutions.ddp",
            "        self.inner = optimizer_cls(self.masters, **defaults)",
            "        self.inner = optimizer_cls(self.params, **defaults)",
            "state bytes per rank (params, grads, optimizer)",
            "does the optimizer step fp32 masters (not the bf16 weights)",
            dict(precision="bf16-mixed"),
        ),
        Bug(
            "mixed precision: gradients reduced in bf16 where fp32 was asked",
            "solutions.ddp",
            "grad = p.grad.to(self.reduce_dtype or p.grad.dtype)",
            "grad = p.grad",
            "naive: all_reduce bytes per call",
            "reduced in bfloat16 where reduce_dtype=float32 was asked",
            dict(precision="bf16-mixed"),
        ),
        Bug(
            "mixed precision: the masters never rounded back into the bf16 weights",
            "solutions.ddp",
            "            for p, master in zip(self.params, self.masters):\n"
            "                p.copy_(master)\n",
            "            for p, master in zip(self.params, self.masters):\n                pass\n",
            "naive: losses",
            "step 1 matches and step 2 does not",
            dict(precision="bf16-mixed"),
        ),
        Bug(
            "fp16: a step whose scaled gradients overflowed is taken",
            "solutions.ddp",
            "        overflow = self.loss_scaler is not None and overflowed(grads)",
            "        overflow = False",
            "naive: steps skipped for overflow",
            "must be skipped and the loss scale halved",
            dict(precision="fp16-mixed"),
        ),
    ],
    "tp": [
        Bug(
            "f's backward skips the all-reduce",
            "solutions.tensor_parallel_comm",
            "return all_reduce_copy(grad, ctx.group), None",
            "return grad, None",
            "backward all_reduce bytes per call",
            "f: identity forward, all-reduce backward",
        ),
        Bug(
            "g's backward all-reduces too",
            "solutions.tensor_parallel_comm",
            "        return grad, None\n",
            "        return all_reduce_copy(grad, None), None\n",
            "backward all_reduce bytes per call",
            "g: all-reduce forward, identity backward",
        ),
        Bug(
            "MLP entered without f",
            "solutions.tensor_parallel",
            "h = enter_parallel_region(self.mlp_norm(x), self.group, self.sequence_parallel)",
            "h = self.mlp_norm(x)",
            "backward all_reduce bytes per call",
            "attention and the MLP are each entered once",
        ),
        Bug(
            "vocab-parallel embedding: rows of ids held elsewhere not zeroed",
            "solutions.tensor_parallel",
            "        x = x.masked_fill(elsewhere[..., None], 0.0)\n",
            "",
            "losses",
            "the vocab-parallel embedding's or loss's mask",
        ),
        Bug(
            "vocab-parallel loss: backward not divided by the tokens",
            "solutions.tensor_parallel",
            "return grad_logits * (grad / max(ctx.kept, 1)), None, None, None",
            "return grad_logits * grad, None, None, None",
            "gradients after step 1",
            "must divide (softmax - one_hot) by N",
        ),
        Bug(
            "vocab-parallel loss: no all-reduce of the max",
            "solutions.tensor_parallel",
            "        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)\n",
            "",
            "forward all_reduce bytes per call",
            "the loss's two all-reduces (max, then the sums)",
        ),
        Bug(
            "SP: the norms' gradients are not all-reduced",
            "solutions.tensor_parallel",
            "        out.weight.register_hook(lambda grad: ReduceFromModelParallelRegion.apply"
            "(grad, group))\n",
            "        pass\n",
            "gradients after step 1",
            "its weight's gradient is partial",
            dict(sp=True),
        ),
        Bug(
            "async linear: grad_X returned before the collective is waited on",
            "solutions.tensor_parallel_comm",
            "        work.wait()\n        return grad_x, None, None, *grad_weights\n",
            "        return grad_x, None, None, *grad_weights\n",
            "async collectives waited on",
            "wait on the handle (work.wait()) before returning grad_X",
            dict(async_linear=True),
        ),
        Bug(
            "async linear: weight gradients from grad_X instead of the saved input",
            "solutions.tensor_parallel_comm",
            "x_rows = x.flatten(0, -2)  # [B·T, in]",
            "x_rows = grad_x.flatten(0, -2)  # [B·T, in]",
            "gradients after step 1",
            "from the input X saved in forward",
            dict(async_linear=True),
        ),
        # Right numbers, nothing overlapped: no check of losses, gradients or bytes can see it; the
        # lab's log of async collectives (labs.measure.async_collectives) counts the matrix
        # products run between each launch and its wait, and notebook 04 §11's exposed
        # communication shows the cost.
        Bug(
            "async linear: waits before computing the weight gradients",
            "solutions.tensor_parallel_comm",
            "        x_rows = x.flatten(0, -2)  # [B·T, in]\n",
            "        work.wait()\n        x_rows = x.flatten(0, -2)  # [B·T, in]\n",
            "weight gradients computed in flight",
            "waiting first gives the same numbers",
            dict(async_linear=True),
        ),
    ],
    "pp": [
        Bug(
            "the last stage does not scale the loss by 1/M",
            "solutions.pipeline_parallel",
            "targets.flatten()) / n_microbatches\n    ### END SOLUTION",
            "targets.flatten())\n    ### END SOLUTION",
            "gradients after step 1",
            "scale each micro-batch's loss by 1/M",
        ),
        Bug(
            "GPipe: backwards in reverse order",
            "solutions.pipeline_parallel",
            "    # all backwards, in the same order\n    for i in range(M):",
            "    # all backwards, in the same order\n    for i in reversed(range(M)):",
            "schedule order",
            "ran B3 before B0",
            dict(schedule="gpipe"),
        ),
        Bug(
            "1F1B: one forward too many in the warm-up",
            "solutions.pipeline_parallel",
            "warmup = min(pipe.size - pipe.rank - 1, M)\n    held = []",
            "warmup = min(pipe.size - pipe.rank, M)\n    held = []",
            "schedule order",
            "a warm-up of min(P - s - 1, M) forwards",
        ),
        Bug(
            "the last stage skips the final norm",
            "solutions.pipeline_parallel",
            "            return self.lm_head(self.norm(h))  # [b, T, V]",
            "            return self.lm_head(h)  # [b, T, V]",
            "losses",
            "the final norm or the head left out",
        ),
        Bug(
            "a stage's layers start one layer late",
            "solutions.pipeline_parallel",
            "    start = sum(plan[:stage])\n",
            "    start = sum(plan[:stage]) + (stage < len(plan) - 1)\n",
            "every parameter on one stage",
            "exactly once",
            dict(layers=4),
        ),
        Bug(
            "the loss divided by M twice",
            "solutions.pipeline_parallel",
            "targets.flatten()) / n_microbatches",
            "targets.flatten()) / n_microbatches / n_microbatches",
            "gradients after step 1",
            "the loss was divided by M twice",
            dict(microbatches=2),
        ),
        Bug(
            "ZB-H1: the held-back W's never run (weight gradients missing)",
            "solutions.pipeline_parallel",
            "    for i in waiting:\n        weight(i)\n",
            "",
            "schedule order",
            "runs them after its last B",
            dict(schedule="zb-h1"),
        ),
        Bug(
            "ZB-H1: B computes the weights' gradients too (W adds them again)",
            "solutions.pipeline_parallel",
            "    (grad,) = torch.autograd.grad(output, inputs, output_grad, retain_graph=True)\n"
            "    return grad  # [b, T, H]",
            "    torch.autograd.backward(output, output_grad, retain_graph=True)\n"
            "    return inputs.grad  # [b, T, H]",
            "gradients after step 1",
            "the weights' gradients were computed twice",
            dict(schedule="zb-h1"),
        ),
        Bug(
            "ZB-H1: no W held back (the cool-down stays idle, as in 1F1B)",
            "solutions.pipeline_parallel",
            "if len(waiting) > pipe.rank:",
            "if waiting:",
            "schedule order",
            "holds its s latest W's back",
            dict(schedule="zb-h1"),
        ),
    ],
    "cp": [
        Bug(
            "merge adds the partial outputs without their log-sum-exp weights",
            "solutions.context_parallel",
            "return old_weight * out + block_weight * block_out, new_lse",
            "return out + block_out, new_lse",
            "ring attention output",
            "merges the partial results by their log-sum-exp",
        ),
        Bug(
            "the diagonal block is treated as full (no causal mask)",
            "solutions.context_parallel",
            "if not causal or k_chunk < q_chunk:",
            "if not causal or k_chunk <= q_chunk:",
            "ring attention output",
            "masks only the diagonal ones",
        ),
        Bug(
            "zig-zag: the late chunk one off",
            "solutions.context_parallel",
            "return (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)",
            "return (rank, 2 * cp - 2 - rank) if zigzag else (2 * rank, 2 * rank + 1)",
            "ring attention output",
            "zig-zag: r and 2·CP−1−r",
        ),
        Bug(
            "forward: the K/V block of the wrong rank",
            "solutions.context_parallel",
            "            k_ids = chunk_ids((ring.rank - s) % cp, cp, zigzag)",
            "            k_ids = chunk_ids((ring.rank - s - 1) % cp, cp, zigzag)",
            "ring attention output",
            "the K/V of rank (r − s) mod CP",
        ),
        Bug(
            "backward: the arriving dK/dV accumulator is dropped",
            "solutions.context_parallel",
            "                    dkv += acc_in  # what the ranks before us added to this block's "
            "gradient\n",
            "",
            "ring attention dk, dv",
            "adds its own contribution to what arrives from r−1",
            dict(nproc=4),
        ),
        Bug(
            "backward: dq overwritten instead of accumulated",
            "solutions.context_parallel",
            "_chunk(dq, a).add_(dq_a)",
            "_chunk(dq, a).copy_(dq_a)",
            "ring attention dq",
            "accumulate, do not overwrite",
        ),
        Bug(
            "the model's attention is not causal",
            "solutions.context_parallel",
            "y = ring_attention(q, k, v, self.group, causal=True, zigzag=self.zigzag)",
            "y = ring_attention(q, k, v, self.group, causal=False, zigzag=self.zigzag)",
            "losses",
            "its attention must be causal over the whole sequence",
        ),
    ],
    "moe": [
        Bug(
            "gradients summed but not divided by the world size",
            "solutions.expert_parallel",
            "        p.grad.div_(world)\n",
            "",
            "gradients after step 1",
            "did you divide the sum by the world size?",
        ),
        Bug(
            "top-2 weights not renormalised",
            "solutions.expert_parallel",
            "        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
            "        pass\n",
            "single-process layer vs Mixtral's block",
            "renormalised to sum to 1 when k > 1",
        ),
        Bug(
            "capacity: one pair too many per expert",
            "solutions.expert_parallel",
            "keep = ((slot < capacity) & (onehot > 0))",
            "keep = ((slot <= capacity) & (onehot > 0))",
            "pairs kept per expert within capacity",
            "check capacity_keep's comparison",
        ),
        Bug(
            "combine ignores the router's weights",
            "solutions.expert_parallel",
            "return (weights.unsqueeze(-1) * out.view(n, k, -1)).sum(dim=1)",
            "return out.view(n, k, -1).sum(dim=1)",
            "single-process layer vs Mixtral's block",
            "each expert's output weighted by the router",
        ),
        Bug(
            "the load-balancing loss's P_e detached",
            "solutions.expert_parallel",
            "p = probs.view(groups, -1, e).mean(dim=1)",
            "p = probs.detach().view(groups, -1, e).mean(dim=1)",
            "load-balancing loss vs Mixtral's",
            "P_e, the mean probability of e, carries the gradient",
        ),
        Bug(
            "experts' gradients all-reduced over every rank",
            "solutions.expert_parallel",
            "dist.all_reduce(p.grad, group=expert_dp_group)",
            "dist.all_reduce(p.grad, group=group)",
            "gradients after step 1",
            "expert_dp_group",
        ),
        Bug(
            "capacity decided token by token, not every first choice first",
            "solutions.expert_parallel",
            "    onehot = onehot.transpose(1, 2).reshape(groups, k * n // groups, n_experts)\n"
            "    slot = onehot.cumsum(dim=1) - 1  # [G, k·N/G, E]\n"
            "    keep = ((slot < capacity) & (onehot > 0)).any(dim=-1)  # [G, k·N/G]\n"
            "    return keep.view(groups, k, n // groups).transpose(1, 2).reshape(n, k)",
            "    onehot = onehot.reshape(groups, k * n // groups, n_experts)\n"
            "    slot = onehot.cumsum(dim=1) - 1  # [G, k·N/G, E]\n"
            "    keep = ((slot < capacity) & (onehot > 0)).any(dim=-1)  # [G, k·N/G]\n"
            "    return keep.reshape(n, k)",
            "pairs kept by the capacity rule",
            "the pairs were kept token by token",
        ),
        Bug(
            "expert gradients divided by their expert-DP group's size, not the world size",
            "solutions.expert_parallel",
            "        p.grad.div_(world)\n",
            "        p.grad.div_(\n"
            "            dist.get_world_size(expert_dp_group)\n"
            '            if getattr(p, "expert_parallel", False)\n'
            "            else world\n"
            "        )\n",
            "gradients after step 1",
            "divided by the size of the group they were summed over",
            dict(nproc=4, ep=2),
        ),
        Bug(
            "received rows not put back in order after the experts",
            "solutions.expert_parallel",
            "        out = out[torch.argsort(by_expert)]  # [M_in, H] by (source, expert)\n",
            "",
            "losses",
            "the regrouping by local expert and its undoing",
        ),
    ],
    "mesh": [
        Bug(
            "groups keyed by their own axes instead of the others",
            "solutions.mesh",
            "if axis not in axes)",
            "if axis in axes)",
            "groups equal torch's init_device_mesh",
            "a group holds the ranks whose coordinates differ only along its own axes",
        ),
        Bug(
            "every DP rank trains on the first DP rank's rows",
            "solutions.mesh",
            '    x = x.chunk(d.dp)[mesh.coords["dp"]]  # [B/dp, T]',
            "    x = x.chunk(d.dp)[0]  # [B/dp, T]",
            "losses",
            "each DP rank takes its own B/dp rows",
            dict(tp=1, dp=2),
        ),
        Bug(
            "TP without sequence parallelism where the step expects it",
            "solutions.mesh",
            "sequence_parallel=d.pp == 1)",
            "sequence_parallel=False)",
            "tp all_reduce bytes per call",
            "SP's all-gathers and reduce-scatters without PP",
        ),
        Bug(
            "ZeRO over the dp group instead of dp_cp",
            "solutions.mesh",
            '                group=g["dp_cp"],\n                shard_grads=zero == 2,',
            '                group=g["dp"],\n                shard_grads=zero == 2,',
            "gradients after step 1",
            "ZeRO averages them over dp_cp",
            dict(nproc=4, tp=1, dp=2, cp=2),
        ),
        Bug(
            "CP: the model called without its tokens' positions",
            "solutions.mesh",
            "_, loss = c.module(x, y, positions)",
            "_, loss = c.module(x, y)",
            "gradients after step 1",
            "called its model without its tokens' positions",
            dict(tp=1, cp=2),
        ),
        Bug(
            "gradients never zeroed after the step",
            "solutions.mesh",
            "    c.optimizer.zero_grad()\n",
            "",
            "parameters after step 2",
            "are the gradients zeroed at the start of every step",
        ),
    ],
    "infer": [
        Bug(
            "decode: the slot advances by one after the prefill",
            "solutions.inference",
            "        start += idx.shape[1]",
            "        start += 1",
            "tp: greedy tokens",
            "start advances by the tokens fed",
        ),
        Bug(
            "TP greedy: local ids taken for global ones",
            "solutions.inference",
            "    token = best + dist.get_rank(group) * logits.shape[-1]  # [B]: global ids",
            "    token = best  # [B]: global ids",
            "tp: greedy tokens",
            "the global id of a rank's best logit is r·V/tp + its local id",
        ),
        Bug(
            "attention without the mask",
            "solutions.inference",
            "attn_mask=mask, enable_gqa=True)",
            "attn_mask=None, enable_gqa=True)",
            "tp: greedy tokens",
            "Check the attention mask",
        ),
        Bug(
            "the first slot's logits instead of the last's",
            "solutions.inference",
            "logits = part.lm_head(part.norm(x[:, -1:]))[:, 0]",
            "logits = part.lm_head(part.norm(x[:, :1]))[:, 0]",
            "tp: greedy tokens",
            "that the logits are the last slot's",
        ),
        Bug(
            "placement: the slot advances by one after the prefill",
            "solutions.inference",
            "        start += t\n        t = 1",
            "        t = 1\n        start += t",
            "placement: greedy tokens",
            "start advances by the tokens fed",
            dict(mode="placement"),
        ),
    ],
    "multimodal": [
        Bug(
            "pipeline: gradients never zeroed",
            "solutions.multimodal",
            "    optimizer.zero_grad(set_to_none=True)\n    tokens_mb = tokens.chunk(microbatches)",
            "    tokens_mb = tokens.chunk(microbatches)",
            "parameters after step 2",
            "are the gradients zeroed at the start of every step",
        ),
        Bug(
            "pipeline: images queued in reverse order",
            "solutions.multimodal",
            "stage.load(images.chunk(microbatches), tokens_mb)",
            "stage.load(images.chunk(microbatches)[::-1], tokens_mb)",
            "losses",
            "each micro-batch's own images",
        ),
        Bug(
            "pipeline: stage 0 skips its decoder layers",
            "solutions.multimodal",
            "        return run_blocks(self.layers.values(), h, self.cfg)",
            "        return h",
            "gradients after step 1",
            "never arrived",
            dict(split=(1, 3)),
        ),
        Bug(
            "pipeline: no optimizer step",
            "solutions.multimodal",
            "    optimizer.step()\n    return loss",
            "    return loss",
            "losses",
            "step 1 matches and step 2 does not",
        ),
        Bug(
            "data parallel: gradients not synchronised",
            "solutions.multimodal",
            "            self.model.finish_gradient_synchronization()\n",
            "            pass\n",
            "gradients after step 1",
            "must be averaged before the optimizer steps",
            dict(mode="dp"),
        ),
        Bug(
            "data parallel: gradients never zeroed",
            "solutions.multimodal",
            "        self.optimizer.zero_grad(set_to_none=True)\n        _, loss",
            "        _, loss",
            "parameters after step 2",
            "are the gradients zeroed at the start of every step",
            dict(mode="dp"),
        ),
    ],
    # notebook 01 has no exercise module (yet): its classic mistakes are in the measurement itself
    "memory": [
        Bug(
            "gradients summed over the ranks, not averaged",
            "labs.experiments.memory",
            "                    p.grad /= world\n",
            "",
            "fp32/none: gradients after step 1",
            "did you divide the sum by the world size?",
        ),
        Bug(
            "selective recomputation keeps nothing",
            "labs.experiments.memory",
            "        return CheckpointPolicy.MUST_SAVE",
            "        return CheckpointPolicy.PREFER_RECOMPUTE",
            "fp32/selective: activation bytes",
            "keeps the matmuls' and attention's outputs only",
        ),
        Bug(
            "full recomputation without the checkpoint",
            "labs.experiments.memory",
            "        return checkpoint(block, x, cos, sin, use_reentrant=False)",
            "        return block(x, cos, sin)",
            "fp32/full: activation bytes",
            "keeps only each block's input",
        ),
        Bug(
            "the weights counted as saved activations",
            "labs.experiments.memory",
            "    with SavedActivations(exclude=model) as meter:",
            "    with SavedActivations() as meter:",
            "fp32/none: activation bytes",
            "except the parameters",
        ),
        Bug(
            "bf16-mixed: the compute copy never refreshed from the masters",
            "labs.experiments.memory",
            "                        p.copy_(p32)  # refresh the bf16 compute copy",
            "                        pass  # refresh the bf16 compute copy",
            "bf16-mixed/none: losses",
            "step 1 matches and step 2 does not",
        ),
        Bug(
            "bf16-mixed: the fp32 gradient-accumulation buffer never zeroed after the step",
            "labs.experiments.memory",
            "                            p32.grad.zero_()\n",
            "                            pass\n",
            "bf16-mixed/none: gradients at every step",
            "the fp32 gradient-accumulation buffer (Megatron's main_grad) was never zeroed",
            dict(precisions=("bf16-mixed",), recomputes=("none",), fp32_grad_accum=True),
        ),
    ],
    "zero": [
        Bug(
            "ZeRO-1 reduce-scatter without the division by N",
            "solutions.zero",
            "                u.full_grad[u.lo : u.hi].copy_(full[u.lo : u.hi].div_(self.world))\n",
            "                u.full_grad[u.lo : u.hi].copy_(full[u.lo : u.hi])\n",
            "gradients after step 1",
            "did you divide the sum by the world size?",
            dict(stage=1),
        ),
        Bug(
            "ZeRO-1 all-reduces the whole gradient instead of reduce-scattering it",
            "solutions.zero",
            "dist.reduce_scatter_single(full[u.lo : u.hi], full, group=self.group)",
            "dist.all_reduce(full, group=self.group)",
            "bytes per call",
            "where ZeRO-1 reduce-scatters it",
            dict(stage=1),
        ),
        Bug(
            "ZeRO-3 reduce-scatter without the division by N",
            "solutions.zero",
            "        u.grad_shard = part.div_(self.world).to(u.shard.dtype)  # [S]\n",
            "        u.grad_shard = part.to(u.shard.dtype)  # [S]\n",
            "gradients after step 1",
            "did you divide the sum by the world size?",
            dict(stage=3),
        ),
        Bug(
            "all-gather of the wrong shard (offset 0 instead of this rank's)",
            "solutions.zero",
            "dist.all_gather_single(u.full, u.full[u.lo : u.hi], group=self.group)",
            "dist.all_gather_single(u.full, u.full[: u.shard], group=self.group)",
            "parameters after step 1",
            "each rank must send its own slice",
            dict(stage=2),
        ),
        Bug(
            "the optimizer steps the whole parameters instead of the shard",
            "solutions.zero",
            '"params": [t]}\n            for g, t in zip(groups, targets)',
            '"params": g["params"]}\n            for g, t in zip(groups, targets)',
            "state held per rank",
            "does it step the whole parameters rather than this rank's shard",
            dict(stage=1),
        ),
        Bug(
            "ZeRO-3 forgets to gather a unit again before its backward",
            "solutions.zero",
            "        self.gather(k)\n        if self.prefetch and k > 0:",
            "        if self.prefetch and k > 0:",
            "run completes",
            "is not gathered after pre_backward",
            dict(stage=3),
        ),
        Bug(
            "ZeRO-3 never frees a unit after its forward",
            "solutions.zero",
            "        self.release(k)\n        ### END SOLUTION\n\n    def pre_backward",
            "        pass\n        ### END SOLUTION\n\n    def pre_backward",
            "peak parameter bytes",
            "is each unit released after its forward",
            dict(stage=3),
        ),
        Bug(
            "ZeRO-3 uses a prefetched unit before its all-gather finished",
            "solutions.zero",
            "        if not async_op and k in self.inflight:\n"
            "            self.inflight.pop(k).wait()\n",
            "",
            "run completes",
            "its all-gather is still in flight",
            dict(stage=3),
        ),
        Bug(
            "ZeRO-2 keeps the whole gradients after the reduce-scatter",
            "solutions.zero",
            "        u.shard_grad.add_(part.div_(self.world))\n        for p in u.params:\n"
            "            p.grad = None\n",
            "        u.shard_grad.add_(part.div_(self.world))\n",
            "state held per rank",
            "are the whole gradients freed",
            dict(stage=2),
        ),
        Bug(
            "flat buffers not padded to a multiple of N",
            "solutions.zero",
            "        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)",
            "        flat = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)",
            "run completes",
            "check flatten's padding",
            dict(stage=1, model="awkward"),
        ),
        Bug(
            "ZeRO-1 in bf16-mixed reduce-scatters in bf16 where fp32 was asked",
            "solutions.zero",
            "full = u.full_grad.to(self.reduce_dtype or u.full_grad.dtype)",
            "full = u.full_grad",
            "bytes per call",
            "reduced in bfloat16 where reduce_dtype=float32 was asked",
            dict(stage=1, precision="bf16-mixed"),
        ),
        Bug(
            "ZeRO-2 in bf16-mixed: the inner optimizer steps the bf16 shard, not the fp32 master",
            "solutions.zero",
            "        return u.master if self.mixed_precision is not None else u.shard_param",
            "        return u.shard_param",
            "state held per rank",
            "does the inner optimizer step the bf16 shard instead of the fp32 master",
            dict(stage=2, precision="bf16-mixed"),
        ),
        Bug(
            "ZeRO-2 in fp16: the overflow flag is not shared, each rank decides alone",
            "solutions.zero",
            "        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)\n",
            "",
            "bytes per call",
            "the overflow flag must be all-reduced",
            dict(stage=2, precision="fp16-mixed"),
        ),
    ],
}


def all_bugs() -> list[tuple[str, Bug]]:
    """(lab, bug) for every bug of the catalog."""
    return [(lab, bug) for lab, bugs in CATALOG.items() for bug in bugs]


def _origin(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"no module {module!r}")
    return Path(spec.origin)


def edited_source(bug: Bug) -> str:
    """The module's source with the bug planted; ValueError unless ``old`` occurs exactly once."""
    source = _origin(bug.module).read_text()
    if source.count(bug.old) != 1:
        raise ValueError(
            f"{bug.id}: the text to replace occurs {source.count(bug.old)} times in {bug.module}"
        )
    return source.replace(bug.old, bug.new)


def _ours(name: str, bug: Bug) -> bool:
    return name == bug.module or name.startswith("solutions.")


def _set_child(name: str, module: types.ModuleType | None) -> None:
    """Make ``module`` (None: nothing) the attribute ``name``'s package holds for it."""
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is None:
        return
    if module is None:
        if hasattr(parent, child):
            delattr(parent, child)
    else:
        setattr(parent, child, module)


@contextmanager
def planted(bug: Bug) -> Iterator[types.ModuleType]:
    """``bug.module`` replaced in ``sys.modules`` by its edited source for the duration (ranks
    forked meanwhile inherit it). The other ``solutions`` modules are imported afresh inside, so
    those that import from the planted one (``from .tensor_parallel_comm import ...``) see it;
    everything is restored afterwards."""
    source = edited_source(bug)
    parent_name = bug.module.rpartition(".")[0]
    importlib.import_module(parent_name)
    saved = {name: mod for name, mod in sys.modules.items() if _ours(name, bug)}
    for name in saved:
        del sys.modules[name]
    module = types.ModuleType(bug.module)
    module.__file__ = str(_origin(bug.module))
    module.__package__ = parent_name
    sys.modules[bug.module] = module
    _set_child(bug.module, module)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        yield module
    finally:
        for name in [n for n in sys.modules if _ours(n, bug)]:
            del sys.modules[name]
            _set_child(name, None)
        sys.modules.update(saved)
        for name, mod in saved.items():
            _set_child(name, mod)
