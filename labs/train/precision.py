"""Mixed precision: the policy a run computes under, and fp16's dynamic loss scaling.

    policy = mixed_precision("bf16-mixed")            # MixedPrecision(bf16 params, fp32 reduce)
    scaler = LossScaler(2.0**16)                      # fp16 only
    scaler.scale(loss).backward(); scaler.step(optimizer, group=group)

The DDP and ZeRO labs (notebooks 02 and 03) train under these; the single-process reference under
the same policy is ``labs.train.reference``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from labs.experiments.spec import option
from labs.runtime.device import rank_device

# --- Mixed precision: the policy, dynamic loss scaling --------------------------------------------
# What a run computes in. "fp32": everything. "bf16-mixed" / "fp16-mixed": the model's parameters
# and its compute in bf16 / fp16, fp32 master weights and optimizer state, gradients summed over
# the ranks in ``reduce_dtype`` (fp32 unless asked otherwise). fp16 adds dynamic loss scaling.
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
PARAM_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16's first loss scale in the DDP and ZeRO labs: the course model's scaled gradients overflow
# fp16 above ~2^18.2, so the first step overflows and is skipped, and the lab shows the scale
# backing off (torch's GradScaler starts at 2^16 and would not overflow in a few steps)
FP16_LOSS_SCALE = 2.0**19


@dataclass(frozen=True)
class PrecisionOptions:
    """The options of a lab that trains in mixed precision (ddp, zero: their ``Options`` extend
    these): ``labs.run``'s ``--precision``, ``--reduce-dtype`` and ``--loss-scale``."""

    precision: str = option(
        "fp32",
        "bf16-mixed / fp16-mixed: bf16/fp16 weights and compute, fp32 masters and AdamW",
        choices=PRECISIONS,
    )
    reduce_dtype: str | None = option(
        None,
        "mixed precision: reduce the gradients in fp32 (default) or in the weights' dtype",
        choices=tuple(REDUCE_DTYPES),
    )
    loss_scale: float = option(
        FP16_LOSS_SCALE,
        "fp16-mixed: the first loss scale (2^19: the first step overflows and is skipped)",
    )

    def mixed(self, dtype: str = "float32") -> MixedPrecision | None:
        """The policy these options name (None: fp32; ``dtype``: the lab's fp32 runs' dtype);
        ValueError for a combination that is none."""
        policy = mixed_precision(self.precision, self.reduce_dtype, dtype)
        if not self.loss_scale > 0:
            raise ValueError(
                f"loss_scale must be > 0 (fp16's first loss scale), got {self.loss_scale!r}"
            )
        return policy


@dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy, as FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``:
    the model's parameters, activations and gradients are ``param_dtype``; gradients are summed
    over the ranks in ``reduce_dtype`` (the collective's payload, so its bytes too); the master
    weights an optimizer steps, and its state, are fp32. ``param_dtype=torch.float16`` needs a
    ``LossScaler``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(
                    f"MixedPrecision.{name}={getattr(self, name)} is not one of torch.bfloat16,"
                    " torch.float16, torch.float32"
                )
        if self.param_dtype == torch.float32:
            raise ValueError(
                "MixedPrecision.param_dtype=torch.float32 is plain fp32 training: pass no policy"
                " (mixed_precision=None), or torch.bfloat16 / torch.float16"
            )
        if self.reduce_dtype not in (torch.float32, self.param_dtype):
            raise ValueError(
                f"MixedPrecision.reduce_dtype={self.reduce_dtype} must be torch.float32 or the"
                f" param_dtype ({self.param_dtype})"
            )

    @property
    def loss_scaling(self) -> bool:
        """Whether the policy needs loss scaling (fp16: 5 exponent bits)."""
        return self.param_dtype == torch.float16


def mixed_precision(
    precision: str, reduce_dtype: str | None = None, dtype: str = "float32"
) -> MixedPrecision | None:
    """The policy a lab's ``precision`` ("fp32", "bf16-mixed", "fp16-mixed") and ``reduce_dtype``
    ("fp32", or the parameters' own: "bf16" / "fp16"; None: fp32) name; None for fp32. ``dtype``
    is the lab's fp32 run's dtype, which a mixed precision needs to be "float32"."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    if precision != "fp32" and dtype != "float32":
        raise ValueError(
            f"dtype={dtype!r} with precision={precision!r}: mixed precision keeps fp32 masters of"
            " bf16/fp16 weights; use dtype='float32'"
        )
    if reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} is not one of {tuple(REDUCE_DTYPES)}")
    if precision == "fp32":
        if reduce_dtype not in (None, "fp32"):
            raise ValueError(
                f"reduce_dtype={reduce_dtype!r} needs a mixed precision: fp32 training reduces"
                " in fp32; use precision='bf16-mixed' (or 'fp16-mixed') with it"
            )
        return None
    param_dtype = PARAM_DTYPES[precision]
    reduce = REDUCE_DTYPES[reduce_dtype or "fp32"]
    if reduce not in (torch.float32, param_dtype):
        own = "bf16" if param_dtype == torch.bfloat16 else "fp16"
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r} with precision={precision!r}: reduce in 'fp32' or in"
            f" the parameters' own dtype ({own!r})"
        )
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training", ICLR 2018,
    §3.2), by the rule of ``torch.amp.GradScaler``:

        backward on ``scale(loss)`` = loss · S     small gradients move up into fp16's range
        a step whose gradients overflowed           skipped, and S ← S · backoff_factor
          (inf or nan on any rank)
        growth_interval steps in a row without      S ← S · growth_factor
          overflow

    fp16 has 5 exponent bits: nothing above 65504, and gradients below ~6e-8 flush to zero; bf16
    keeps fp32's 8 exponent bits and needs no scaling. The gradients are divided by S again in
    fp32 (the master's copy), never in fp16. ``history``: one ``(S used, skipped)`` per step.

        scaler = LossScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer, group=group)   # or a mixed-precision optimizer built with it
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                "LossScaler needs growth_factor > 1, 0 < backoff_factor < 1 and"
                f" growth_interval >= 1; got {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.value = float(init_scale)  # S, the scale the next backward uses
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # steps in a row without overflow
        self.history: list[tuple[float, bool]] = []

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss · S`` (the loss is fp32: the course model computes it from fp32 logits)."""
        return loss * self.value

    def update(self, overflow: bool) -> None:
        """After a step: record it, then back off (overflow) or count towards growth."""
        self.history.append((self.value, bool(overflow)))
        if overflow:
            self.value *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.value *= self.growth_factor
            self.good_steps = 0

    @property
    def skipped_steps(self) -> list[int]:
        """The steps (1-based) whose gradients overflowed and that were skipped."""
        return [i + 1 for i, (_, skipped) in enumerate(self.history) if skipped]

    @property
    def scales(self) -> list[float]:
        """The scale each step's backward used."""
        return [scale for scale, _ in self.history]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, *, group=None) -> bool:
        """``GradScaler.step`` for an optimizer whose parameters hold fp32 gradients (ZeRO-3's
        master pieces; FSDP's ``ShardedGradScaler`` does the same): divide every gradient by S,
        skip the step if any rank's overflowed (a MAX all-reduce of the flag over ``group``: a
        rank holds only its pieces), then ``update``. Returns whether the optimizer stepped."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for grad in grads:
            if grad.dtype != torch.float32:
                raise ValueError(
                    f"LossScaler.step unscales fp32 gradients, got {grad.dtype}: dividing an fp16"
                    " gradient by the scale would flush it to zero; step the fp32 masters"
                )
            grad.div_(self.value)
        overflow = overflowed_on_any_rank(grads, group=group)
        if not overflow:
            optimizer.step()
        self.update(overflow)
        return not overflow


def overflowed(grads: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``grads`` (on this rank) holds an inf or a nan."""
    return any(not torch.isfinite(g).all() for g in grads)


def overflowed_on_any_rank(grads: Iterable[torch.Tensor], *, group=None) -> bool:
    """``overflowed`` on any rank of ``group``: one MAX all-reduce of a 0/1 flag on this rank's
    device (every rank must call it)."""
    grads = list(grads)
    device = grads[0].device if grads else rank_device()
    flag = torch.tensor(float(overflowed(grads)), device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item())
