"""The single-process reference every lab is checked against, and the pieces labs share with it.

    ref = train_reference(ModelConfig(), TrainConfig(steps=5))
    ref.losses          # [loss at step 1, ..., loss at step 5]
    ref.grads           # {name: gradient after step 1's backward}   (return_grads=True)
    ref.params          # {name: parameter after the last step}
    ref = train_multimodal_reference(MultimodalConfig(), TrainConfig(steps=5))   # notebook 11

A parallel lab builds the same model from the same seed, trains with the same
optimizer settings on the same global batches (``labs.data.global_batches``) and
must reproduce these numbers: bit for bit where the arithmetic is the same, within
the tolerance of the course's one table (``TOLERANCE_TABLE``, read with ``rule``) where a
parallel sum changes the order of additions, per dtype and per backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from labs.data import global_batches, shapes
from labs.models.transformer import ModelConfig, build_model
from labs.models.vision import MultimodalConfig, build_multimodal
from labs.runtime.device import exact_fp32, one_thread, rank_device

# --- The course's tolerance table: every comparison with a reference, by backend ----------------
# A check reads its rule here, by (quantity, dtype, backend): ``rule("value", torch.float32,
# "nccl")``. The backend is the ranks' ("gloo": CPU tensors; "nccl": one GPU per rank), as a
# summary reports it. On a GPU, TF32 is off for every comparison (``exact_fp32`` in
# ``labs.runtime.device``: TF32 would round fp32 matmul inputs to ~5e-4), so fp32 agrees with the
# CPU's reference as closely as on the CPU. What is bit for bit on the CPU gets its own row per
# backend: on a GPU it stays exact where torch offers deterministic algorithms (the ranks turn
# them on: ``labs.runtime.device.deterministic_algorithms``), and is a stated tolerance where it
# does not.
GLOO = "gloo"
NCCL = "nccl"
BACKENDS = (GLOO, NCCL)


@dataclass(frozen=True)
class Rule:
    """How one check compares: the largest relative difference allowed (0.0: bit for bit), why,
    and whether the ranks must run deterministic algorithms for it. A rule for a comparison after
    optimizer steps may grow with them (see _DRIFT): ``at(step)`` is its bound after ``step``
    steps, ``rel`` up to ``grows_after`` steps, then doubling every ``doubling_steps`` steps, up
    to ``max_growth`` times ``rel``."""

    rel: float
    why: str
    deterministic: bool = False
    grows_after: int | None = None  # None: the same bound after any number of steps
    doubling_steps: int | None = None
    max_growth: float = 1.0

    def at(self, step: int) -> float:
        """The bound for a comparison after ``step`` optimizer steps (1 = the first)."""
        if self.grows_after is None or step <= self.grows_after:
            return self.rel
        growth = 2.0 ** ((step - self.grows_after) / self.doubling_steps)
        return self.rel * min(growth, self.max_growth)

    def per_step(self, steps: int) -> list[float]:
        """The bounds after steps 1..``steps``: a loss curve's tolerance, step by step."""
        return [self.at(step) for step in range(1, steps + 1)]


# In fp32 a sum split across ranks adds the same numbers in another order: each addition rounds to
# 2^-24 ~ 6e-8 relative, so losses and gradients agree to ~1e-7 and 1e-5 is a safe bound.
_VALUE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}
# Parameters after AdamW steps. AdamW divides each gradient element by its own running RMS plus
# eps (1e-8): an element whose gradient nearly cancels, |g| near eps, moves by up to ~lr whatever
# the last bits of g, so the rounding of a sum split over ranks can change it by a sizeable part of
# one step. That is a property of AdamW in fp32, not of the parallel code: torch's DDP and FSDP2
# drift alike. Measured (course model, 5 to 50 steps, 2 and 4 ranks): up to 7e-5 on an AMD EPYC
# and 2.3e-4 on an Intel Xeon (its AVX-512 kernels round differently), with no growth from 5 to 50
# steps. A wrong update is at least lr / max|p| ~ 3e-2 of a tensor's scale, so 1e-3 still catches
# every real bug; the tests check parameters tightly in float64, where the same code agrees to
# ~1e-13.
_PARAM = {
    torch.float64: 1e-12,
    torch.float32: 1e-3,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}
# Long runs. Two runs that round one sum differently follow two training trajectories that part
# exponentially, like any chaotic dynamics: a last-bit difference doubles every few dozen steps.
# Measured (course model, fp32, gloo on an Intel Xeon, 200 steps), the loss curve's largest
# relative difference from the reference up to step s, and the "value" rule's bound at s:
#     s                    20      50      100     150     200
#     ddp, 2 ranks         2.1e-7  1.7e-6  5.7e-6  2.0e-5  8.7e-5  (ZeRO-3, torch's DDP: the same)
#     ddp, 4 ranks         1.6e-7  3.7e-6  1.3e-5  4.5e-5  2.0e-4
#     ZeRO-3, 4 ranks      1.6e-7  2.5e-6  8.8e-6  3.0e-5  1.3e-4
#     torch's DDP, 4 ranks 1.6e-7  2.7e-6  9.8e-6  3.3e-5  1.5e-4
#     bound, fp32          1e-5    2.8e-5  1.6e-4  9.1e-4  5.1e-3
# Past ~100 steps a fixed 1e-5 fails correct code (torch's too). The difference doubles about every
# 26 steps after step 20; the "value" rows hold their bound for 20 steps, then double it every 20
# steps: at least 4x the measured drift at every step (tightest at step 28 on 4 ranks), 25x at
# step 200, and faster than the measured growth, for runs that part a little faster. The
# parameters after the last step (max |p - p_ref| / max |p_ref|, per tensor) sit on AdamW's floor
# (_PARAM) up to ~100 steps, then part too: 2.8e-4 at 100, 9.6e-4 at 150, 1.7e-3 at 200 (ddp, 4
# ranks; ZeRO-3 1.1e-3, torch's DDP 1.2e-3); the "param" rows hold 1e-3 for 50 steps, then double
# every 50: 2e-3 at 100, 4e-3 at 150, 8e-3 at 200, at least 4x the measured. Both stop growing at
# 1e-2 in fp32 (after ~220 steps), under the ~3e-2 of a tensor's scale one wrong update leaves
# (see _PARAM): fp32 runs much longer than that are no longer comparable step by step; compare them
# in float64 (``--dtype float64`` in ddp and zero). A real bug shows in the first steps, where the
# bounds are still the base ones.
_DRIFT = {
    "value": dict(grows_after=20, doubling_steps=20, max_growth=1e3),
    "param": dict(grows_after=50, doubling_steps=50, max_growth=10.0),
}
_SAME_KERNELS = "the same CPU kernels on the same numbers, in the same order"
_DETERMINISTIC = (
    "every rank runs the same kernels on the same numbers; on a GPU only with deterministic"
    " algorithms (cuDNN's convolution backward and the embedding backward otherwise add with"
    " atomics, in an order that varies run to run)"
)
# Mixed precision against the single-process reference under the same policy (``MixedPrecision``;
# the reference runs one backward per rank's slice of the global batch, as the ranks do, and adds
# the slices' gradients in the reduce dtype: ``train_reference``). Step 1's forward is then the
# very computation of the ranks; what differs is where the gradient is rounded. The calculator's
# layout holds it in bf16 (fp16): DDP and ZeRO-1/2 round the averaged gradient to bf16 once, where
# the reference keeps it in fp32, and a bf16 reduction rounds each partial sum too (on 2 ranks a
# single addition: the same numbers either way). ZeRO-3 keeps the reduced gradient in fp32 and
# matches the reference to ~1e-8. Keyed by the parameters' dtype. Measured on the course model on
# gloo, 2 and 4 ranks, 5 to 30 steps, DDP and stages 0-3, both reduce dtypes (the figures in each
# reason); the NCCL rows are the same, not yet measured on GPUs (whose bf16 kernels round unlike
# the CPU's reference).
_MIXED = {
    ("mixed_loss", torch.bfloat16): (
        5e-3,
        "losses are fp32 from bf16 logits; the bf16 rounding of the averaged gradient moves"
        " AdamW's updates, so later losses part (measured <= 2.9e-4 after 20 steps, 1.2e-3 after"
        " 30: DDP, 4 ranks reducing in bf16)",
    ),
    ("mixed_grad", torch.bfloat16): (
        3e-2,
        "one bf16 rounding of the averaged gradient is <= 2^-9 ~ 2e-3 of an element, a bf16"
        " reduction on 4 ranks rounds 3 partial sums more (measured <= 1.2e-2 of a tensor's"
        " largest, DDP's buckets)",
    ),
    ("mixed_param", torch.bfloat16): (
        0.25,
        "the fp32 masters: AdamW moves an element by ~lr whatever its gradient's size, so where"
        " rounding the averaged gradient to bf16 flips or flushes a tiny element the masters part"
        " by a few lr (measured <= 0.12 of a tensor's largest, 4 ranks reducing in bf16, 20"
        " steps); the losses, gradients, bytes and state are the tight checks",
    ),
    ("mixed_loss", torch.float16): (
        5e-4,
        "as bf16-mixed, with fp16's finer rounding (measured <= 5.6e-5, 4 ranks, 20 steps)",
    ),
    ("mixed_grad", torch.float16): (
        5e-3,
        "one fp16 rounding of the averaged, scaled gradient is <= 2^-12 ~ 2.4e-4 of an element"
        " (measured <= 1.2e-3 of a tensor's largest, 4 ranks reducing in fp16)",
    ),
    ("mixed_param", torch.float16): (
        0.3,
        "the fp32 masters, as bf16-mixed; fp16 also flushes the smallest scaled gradients to zero"
        " (measured <= 0.14 of a tensor's largest, 4 ranks, 20 steps)",
    ),
}
TOLERANCE_TABLE: dict[tuple[str, torch.dtype | None, str], Rule] = {
    # losses, gradients, outputs, logits against the single-process reference
    **{
        ("value", dtype, backend): Rule(
            rel,
            "a sum split over ranks rounds in another order (after step 20, the runs part: see"
            " _DRIFT)",
            **_DRIFT["value"],
        )
        for dtype, rel in _VALUE.items()
        for backend in BACKENDS
    },
    # parameters after AdamW steps against the reference (see _PARAM, and _DRIFT after 50 steps)
    **{
        ("param", dtype, backend): Rule(
            rel,
            "AdamW turns last-bit gradient differences into ~1e-4 parameter differences",
            **_DRIFT["param"],
        )
        for dtype, rel in _PARAM.items()
        for backend in BACKENDS
    },
    # notebook 03: ZeRO-1/2/3 give the model data parallelism gives (equal SHA-1 on gloo)
    ("zero_stages", None, GLOO): Rule(
        0.0, "gloo's reduce-scatter and all-reduce add each element's terms in the same order"
    ),
    ("zero_stages", None, NCCL): Rule(
        _PARAM[torch.float32],
        "NCCL picks its algorithm and chunking per collective and size, so a reduce-scatter and"
        " an all-reduce round one sum differently, and torch has no deterministic collective:"
        " each stage is held to the parameter tolerance against the reference instead",
    ),
    # notebook 05: layers placed stage after stage compute the very ops of the full model
    ("same_ops", None, GLOO): Rule(0.0, _SAME_KERNELS),
    ("same_ops", None, NCCL): Rule(
        _VALUE[torch.float32],
        "the reference runs on the CPU and the stages on GPUs: other kernels, other rounding",
    ),
    # notebook 11's encoder replicas; DDP's ranks after a step
    ("replicas", None, GLOO): Rule(0.0, _SAME_KERNELS),
    ("replicas", None, NCCL): Rule(0.0, _DETERMINISTIC, deterministic=True),
    # the same computation again: notebook 03's run resumed from a checkpoint on as many ranks
    # as saved it, notebook 01's losses with and without recomputation
    ("rerun", None, GLOO): Rule(0.0, _SAME_KERNELS),
    ("rerun", None, NCCL): Rule(0.0, _DETERMINISTIC, deterministic=True),
    # notebook 09: greedy tokens; rel is a margin between the reference's two best logits, as a
    # fraction of its largest logit (``tokens_agree``)
    ("greedy_tokens", None, GLOO): Rule(0.0, "measured: no prompt of the lab comes near a tie"),
    ("greedy_tokens", None, NCCL): Rule(
        2 * _VALUE[torch.float32],
        "TP sums each logit in another order and a GPU rounds unlike the CPU's reference (~1e-6"
        " of the logits' scale): where the reference's two best logits are closer than twice the"
        " fp32 tolerance either token is right, and the sequences may part from there",
    ),
    # notebooks 02 and 03 in mixed precision (bf16-mixed, fp16-mixed): see _MIXED
    **{
        (quantity, dtype, backend): Rule(rel, why)
        for (quantity, dtype), (rel, why) in _MIXED.items()
        for backend in BACKENDS
    },
    # notebook 01: saved-activation bytes against the calculator
    ("activation_bytes", None, GLOO): Rule(
        0.0, "the formula lists every tensor autograd saves (checked to the byte)"
    ),
    ("activation_bytes", None, NCCL): Rule(
        0.05,
        "CUDA's kernels save a little more (flash attention's RNG state) and were not measured",
    ),
}


def rule(quantity: str, dtype: torch.dtype | None = torch.float32, backend: str = GLOO) -> Rule:
    """The table's rule for ``quantity`` in ``dtype`` on ``backend`` (a row for any dtype if the
    quantity has no dtype-specific rows)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    found = TOLERANCE_TABLE.get((quantity, dtype, backend)) or TOLERANCE_TABLE.get(
        (quantity, None, backend)
    )
    if found is None:
        quantities = sorted({q for q, _, _ in TOLERANCE_TABLE})
        raise ValueError(
            f"no tolerance for quantity={quantity!r} in dtype={dtype}; quantities: {quantities}"
        )
    return found


def within(
    quantity: str,
    difference: float,
    *,
    dtype: torch.dtype | None = torch.float32,
    backend=GLOO,
    step: int = 1,
) -> bool:
    """True when a relative ``difference`` after ``step`` optimizer steps passes the table's rule
    (0.0 rules: only 0.0 does)."""
    return difference <= rule(quantity, dtype, backend).at(step)


def tokens_agree(
    tokens: torch.Tensor, reference: torch.Tensor, margins: torch.Tensor | None, *, backend=GLOO
) -> bool:
    """Greedy tokens [B, N] against the reference's, by the "greedy_tokens" rule: equal, or (where
    the rule allows a margin) equal in every sequence up to a first difference at a step where the
    reference's two best logits were within the margin (``margins`` [B, N]: (best - second) /
    max |logit| at each step)."""
    if tokens.shape == reference.shape and torch.equal(tokens, reference):
        return True
    margin = rule("greedy_tokens", None, backend).rel
    if margin == 0.0 or margins is None or tokens.shape != reference.shape:
        return False
    for got, want, gaps in zip(tokens, reference, margins):
        differ = (got != want).nonzero()
        if len(differ) and gaps[differ[0, 0]] > margin:
            return False
    return True


# The fp32-era names, by dtype (the "value" and "param" rows, the same on both backends).
TOLERANCES = {dtype: rule("value", dtype).rel for dtype in _VALUE}
PARAM_TOLERANCES = {dtype: rule("param", dtype).rel for dtype in _PARAM}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 5
    batch_size: int = 8  # global batch: sequences per optimizer step, all ranks together
    seq_len: int = 32
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    seed: int = 0  # model initialisation
    data_seed: int = 0  # order of the data

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")

    def per_rank_batch(self, dp: int) -> int:
        """Sequences per rank per step when ``dp`` data-parallel ranks share the global batch."""
        if self.batch_size % dp:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by the data-parallel degree {dp};"
                f" use a batch_size that is a multiple of {dp}"
            )
        return self.batch_size // dp


def make_optimizer(params: Iterable[torch.Tensor], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW as every lab uses it. ``foreach=False``: the plain per-parameter loop, which
    works on any mix of tensors (DTensor included) and gives the same numbers everywhere."""
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False
    )


def data_for(cfg: TrainConfig, dp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step, laid out as ``dp`` data-parallel ranks would load it."""
    return global_batches(
        steps=cfg.steps,
        batch_size=cfg.per_rank_batch(dp),
        seq_len=cfg.seq_len,
        world_size=dp,
        seed=cfg.data_seed,
    )


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


def add_precision_arguments(parser) -> None:
    """The ``labs.run`` options of a lab that trains in mixed precision (ddp, zero)."""
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="bf16-mixed / fp16-mixed: bf16/fp16 weights and compute, fp32 masters and AdamW",
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=tuple(REDUCE_DTYPES),
        default=None,
        help="mixed precision: reduce the gradients in fp32 (default) or in the weights' dtype",
    )
    parser.add_argument(
        "--loss-scale",
        type=float,
        default=FP16_LOSS_SCALE,
        help="fp16-mixed: the first loss scale (2^19: the first step overflows and is skipped)",
    )


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


@dataclass
class ReferenceResult:
    losses: list[float]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # after step 1's backward
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step
    # mixed precision: the grads are those of the first step taken (fp16 may skip step 1)
    grads_step: int = 1
    skipped_steps: list[int] = field(default_factory=list)  # fp16: steps that overflowed
    loss_scales: list[float] = field(default_factory=list)  # fp16: S of each step


def train_reference(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    *,
    dp: int = 1,
    model: torch.nn.Module | None = None,
    batches: list[tuple[torch.Tensor, ...]] | None = None,
    return_grads: bool = False,
    mixed: MixedPrecision | None = None,
    loss_scale: float | None = None,
) -> ReferenceResult:
    """Train single-process for ``cfg.steps`` steps; the global batches are laid out as ``dp``
    ranks would load them (same samples for any ``dp``, in rank order). ``model`` overrides
    the course model (it must return ``(logits, loss)`` given a batch, ``(x, y)`` unless
    ``batches`` gives others).

    ``mixed``: train under that policy instead (``_train_mixed_reference``); ``loss_scale``: the
    first scale of fp16's ``LossScaler`` (default: torch's, 2^16)."""
    exact_fp32()  # TF32 off, as in every rank
    with one_thread():  # as the ranks run: same arithmetic, and no thread contention with them
        if mixed is not None:
            return _train_mixed_reference(
                model_cfg, cfg, mixed, dp=dp, model=model, loss_scale=loss_scale
            )
        return _train_reference(
            model_cfg, cfg, dp=dp, model=model, batches=batches, return_grads=return_grads
        )


def _train_reference(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    *,
    dp: int,
    model: torch.nn.Module | None,
    batches: list[tuple[torch.Tensor, ...]] | None,
    return_grads: bool,
) -> ReferenceResult:
    torch.manual_seed(cfg.seed)
    model = model if model is not None else build_model(model_cfg, seed=cfg.seed)
    optimizer = make_optimizer(model.parameters(), cfg)
    result = ReferenceResult(losses=[])
    for step, batch in enumerate(batches if batches is not None else data_for(cfg, dp)):
        _, loss = model(*batch)
        loss.backward()
        if step == 0 and return_grads:
            result.grads = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.item())
    result.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def _train_mixed_reference(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    mixed: MixedPrecision,
    *,
    dp: int,
    model: torch.nn.Module | None,
    loss_scale: float | None,
) -> ReferenceResult:
    """Mixed-precision training in one process, the textbook loop (Micikevicius et al. 2018):

        the model in ``param_dtype`` (fp32 weights rounded once); fp32 master copies of them
        per step: one backward per rank's slice of the global batch (the B/dp sequences rank r
        loads), on the loss times S (fp16) -> the slices' gradients added up in ``reduce_dtype``
        and averaged -> in fp32, divided by S -> overflow (fp16): skip the step and halve S;
        else AdamW on the masters -> the model's weights rounded from the masters

    Why one backward per slice: in low precision a backward over B sequences and N backwards over
    B/N each round differently, and fp16 overflows or not by the batch a backward sees, so the
    reference runs what the ranks run and differs only where they communicate. Returns the
    losses (mean over slices), the fp32 gradients of the first step taken, the masters after the
    last step, and (fp16) the steps skipped and the scales used, all by parameter name."""
    torch.manual_seed(cfg.seed)
    model = model if model is not None else build_model(model_cfg, seed=cfg.seed)
    model.to(mixed.param_dtype)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]  # fp32 copies: what AdamW steps
    optimizer = make_optimizer(masters, cfg)
    scaler = LossScaler(loss_scale or 2.0**16) if mixed.loss_scaling else None
    result = ReferenceResult(losses=[])
    for step, (x, y) in enumerate(data_for(cfg, dp)):
        sums = [None] * len(params)  # per parameter: the slices' gradients, in reduce_dtype
        losses = []
        for xs, ys in zip(x.chunk(dp), y.chunk(dp)):  # rank r's [B/dp, T]
            _, loss = model(xs, ys)
            (scaler.scale(loss) if scaler else loss).backward()
            for i, p in enumerate(params):
                if p.grad is not None:
                    g = p.grad.to(mixed.reduce_dtype)
                    sums[i] = g if sums[i] is None else sums[i] + g
            model.zero_grad(set_to_none=True)
            losses.append(loss.item())
        scale = scaler.value if scaler else 1.0
        for m, g in zip(masters, sums):
            m.grad = None if g is None else g.float() / dp / scale  # [same as the parameter]
        overflow = scaler is not None and overflowed(m.grad for m in masters if m.grad is not None)
        if not overflow:
            if not result.grads:
                result.grads_step = step + 1
                result.grads = {
                    n: m.grad.clone() for n, m in zip(names, masters) if m.grad is not None
                }
            optimizer.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)  # round the updated master into the compute copy
        if scaler:
            scaler.update(overflow)
        for m in masters:
            m.grad = None
        result.losses.append(sum(losses) / len(losses))
    result.params = {n: m.clone() for n, m in zip(names, masters)}
    result.params.update(
        {n: p.detach().float().clone() for n, p in model.named_parameters() if n not in names}
    )
    if scaler:
        result.skipped_steps = scaler.skipped_steps
        result.loss_scales = scaler.scales
    return result


def multimodal_data_for(
    cfg: MultimodalConfig, train: TrainConfig, dp: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The vision-language model's global batch of every step, (images, tokens, targets), laid
    out as ``dp`` data-parallel ranks load it (``train.batch_size`` sequences in all,
    ``train.data_seed`` orders them; ``train.seq_len`` is unused: a sequence is n_prefix +
    caption_len tokens)."""
    return shapes.global_batches(
        steps=train.steps,
        batch_size=train.per_rank_batch(dp),
        n_prefix=cfg.n_prefix,
        world_size=dp,
        seed=train.data_seed,
        image_size=cfg.vision.image_size,
    )


def train_multimodal_reference(
    cfg: MultimodalConfig, train: TrainConfig, *, dp: int = 1, return_grads: bool = False
) -> ReferenceResult:
    """The single-process run every parallel mode of notebook 11 is compared with:
    ``train_reference`` on ``build_multimodal(cfg, train.seed)`` and the (images, tokens,
    targets) global batches. Returns ``losses``, ``grads`` (by name, after step 1's backward;
    with ``return_grads``) and ``params``."""
    return train_reference(
        cfg.decoder,
        train,
        model=build_multimodal(cfg, seed=train.seed),
        batches=multimodal_data_for(cfg, train, dp),
        return_grads=return_grads,
    )


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative difference the course's tolerances bound."""
    scale = b.abs().max().item() or 1.0
    return (a - b).abs().max().item() / scale


def compare_losses(losses: list[float], reference: list[float]) -> dict[str, float]:
    """Step-by-step comparison: max absolute and relative difference."""
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses vs {len(reference)} reference losses")
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    return {
        "max_abs_loss_diff": max(diffs),
        "max_rel_loss_diff": max(d / abs(b) for d, b in zip(diffs, reference)),
    }


def assert_close_tensors(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    what: str = "parameter",
    step: int | None = None,
    rank: int | None = None,
) -> float:
    """Every tensor in ``expected`` matched by name in ``actual`` within the tolerance for
    ``dtype`` (relative to the reference tensor's largest magnitude): ``PARAM_TOLERANCES``
    for parameters after optimizer steps, ``TOLERANCES`` for anything else (gradients).
    Raises naming step, rank, tensor and the difference. Returns the largest relative
    difference found."""
    tol = (PARAM_TOLERANCES if what == "parameter" else TOLERANCES)[dtype]
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise AssertionError(f"{what}s missing from the parallel run: {missing}")
    worst = 0.0
    for name, ref in expected.items():
        got = actual[name]
        if got.shape != ref.shape:
            raise AssertionError(
                f"{what} {name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
            )
        rel = max_rel_diff(got.double(), ref.double())
        worst = max(worst, rel)
        if rel > tol:
            where = "".join(
                [
                    f" at step {step}" if step is not None else "",
                    f" on rank {rank}" if rank is not None else "",
                ]
            )
            raise AssertionError(
                f"{what} {name}{where}: max relative difference {rel:.3e} > tolerance {tol:g}"
            )
    return worst
