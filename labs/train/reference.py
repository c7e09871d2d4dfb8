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
from labs.runtime.device import exact_fp32, one_thread
from labs.train.precision import LossScaler, MixedPrecision, overflowed


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

    ``mixed``: train under that policy instead (``_train_mixed_reference``; ``batches``: its global
    batches (x, y), each cut into ``dp`` slices); ``loss_scale``: the
    first scale of fp16's ``LossScaler`` (default: torch's, 2^16)."""
    exact_fp32()  # TF32 off, as in every rank
    with one_thread():  # as the ranks run: same arithmetic, and no thread contention with them
        if mixed is not None:
            return _train_mixed_reference(
                model_cfg, cfg, mixed, dp=dp, model=model, batches=batches, loss_scale=loss_scale
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
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
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
    for step, (x, y) in enumerate(batches if batches is not None else data_for(cfg, dp)):
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
