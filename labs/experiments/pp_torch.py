"""Experiment 05's runs of ``torch.distributed.pipelining``: the same split trained by torch's
schedules, its operations on the lab's timeline.

    pipeline = TorchPipeline("dualpipev", chunks, pipe, microbatches=8)   # on every rank
    loss = pipeline.step(x, y, timeline)     # one step; the loss on the rank of the last stage

Two uses in ``labs.experiments.pp``: ``--vs-torch`` trains the split with torch's schedule of the
same family (GPipe, 1F1B, interleaved 1F1B, ``ScheduleInterleavedZeroBubble`` for ZB-H1,
``ScheduleZBVZeroBubble`` for DualPipeV's V) and compares losses; and ``--schedule dualpipev``,
which the course does not ask you to write, *is* torch's ``ScheduleDualPipeV``, checked against
the reference like the learner's schedules.

``TimedStage`` is a ``PipelineStage`` whose forward, backward and weight-gradient calls are
spans on a timeline, with the names the theory uses ("F"; "B" the input's gradient when a W
follows, else the full backward; "W"; "BW" a full backward where the schedule also splits
some, DualPipeV), so torch's schedule is timed, padded and counted like ours. The order of
those spans is the order torch ran them: the lab checks it against
``labs.theory.pipeline.schedule_ops``.

torch's loss function returns each micro-batch's mean cross-entropy; with ``scale_grads`` (the
default) the schedule divides the gradients by M at the end of the step: the mean over the
batch, as the reference. Every rank passes the batch: the rank of the first stage cuts it into
micro-batches, the rank of the last stage the targets (in DualPipeV both are rank 0).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed.pipelining as tpp
import torch.nn.functional as F

from labs.measure.timeline import Timeline
from labs.runtime.pipe import Pipe
from labs.theory import pipeline as theory

VS_TORCH = {  # the schedule of torch that --vs-torch runs beside ours
    "gpipe": "ScheduleGPipe",
    "afab": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleZBVZeroBubble",
}
# schedules whose class takes a list of stages (the others one stage)
MULTI_STAGE = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
MULTI_STAGE += ("ScheduleDualPipeV",)


class TimedStage(tpp.PipelineStage):
    """A ``PipelineStage`` whose operations are spans on ``self.timeline`` (None: not timed), with
    ``microbatch`` and ``chunk`` (this rank's chunk index) as the lab's own spans carry."""

    def __init__(self, *args, chunk: int, split: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk = chunk
        self.split = split  # the schedule splits backwards: a full one is "BW"
        self.timeline: Timeline | None = None

    def _span(self, name: str, microbatch: int):
        if self.timeline is None:
            return nullcontext()
        return self.timeline.span(name, microbatch=microbatch, chunk=self.chunk)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self._span("F", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, full_backward=True, **kwargs):
        name = "BW" if full_backward and self.split else "B"
        with self._span(name, bwd_chunk_id):
            return super().backward_one_chunk(
                bwd_chunk_id, *args, full_backward=full_backward, **kwargs
            )

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self._span("W", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One micro-batch's mean cross-entropy, fp32 (torch divides the gradients by M)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class TorchPipeline:
    """torch's schedule ``cls`` (default: the one of ``schedule``'s family) over this rank's
    ``chunks`` (``chunks[c]`` is virtual stage ``theory.virtual_stage(schedule, P, rank, c)``)."""

    def __init__(
        self,
        schedule: str,
        chunks: list,
        pipe: Pipe,
        microbatches: int,
        *,
        cls: str | None = None,
    ):
        cls = cls or VS_TORCH[schedule]
        n = pipe.size * len(chunks)
        split = schedule in theory.SPLIT_BACKWARD
        self.stages = [
            TimedStage(
                c,
                theory.virtual_stage(schedule, pipe.size, pipe.rank, i),
                n,
                pipe.device,
                group=pipe.group,
                chunk=i,
                split=split,
            )
            for i, c in enumerate(chunks)
        ]
        self.has_first = any(c.first for c in chunks)
        self.has_last = any(c.last for c in chunks)
        stages = self.stages if cls in MULTI_STAGE else self.stages[0]
        self.schedule = getattr(tpp, cls)(stages, n_microbatches=microbatches, loss_fn=_loss)

    def step(
        self, x: torch.Tensor, y: torch.Tensor, timeline: Timeline | None = None
    ) -> float | None:
        """One step on the global batch x, y [B, T]: gradients accumulated (mean over the
        micro-batches); returns the loss (mean of the micro-batches') on the rank of the last
        stage, else None."""
        for stage in self.stages:
            stage.timeline = timeline
        losses = []
        inputs = (x,) if self.has_first else ()
        targets = {"target": y, "losses": losses} if self.has_last else {}
        self.schedule.step(*inputs, **targets)
        if not self.has_last:
            return None
        return torch.stack(losses).mean().item()
