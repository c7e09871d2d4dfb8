"""The single-process reference every lab is checked against, the course's tolerance table and
mixed precision: three modules, one import for the labs.

    labs.train.reference     TrainConfig, make_optimizer, data_for, train_reference,
                             train_multimodal_reference: what every lab must reproduce
    labs.train.tolerances    TOLERANCE_TABLE, rule, within, tokens_agree, max_rel_diff:
                             how close it must come, per quantity, dtype and backend
    labs.train.precision     MixedPrecision, mixed_precision, LossScaler: bf16/fp16 training

    from labs.train import TrainConfig, train_reference, rule
"""

from labs.train.precision import (
    FP16_LOSS_SCALE,
    PARAM_DTYPES,
    PRECISIONS,
    REDUCE_DTYPES,
    LossScaler,
    MixedPrecision,
    PrecisionOptions,
    mixed_precision,
    overflowed,
    overflowed_on_any_rank,
)
from labs.train.reference import (
    ReferenceResult,
    TrainConfig,
    data_for,
    make_optimizer,
    multimodal_data_for,
    train_multimodal_reference,
    train_reference,
)
from labs.train.tolerances import (
    _DRIFT,
    BACKENDS,
    GLOO,
    NCCL,
    TOLERANCE_TABLE,
    Rule,
    assert_close_tensors,
    compare_losses,
    max_rel_diff,
    rule,
    tokens_agree,
    within,
)

__all__ = [
    "BACKENDS",
    "FP16_LOSS_SCALE",
    "GLOO",
    "NCCL",
    "PARAM_DTYPES",
    "PRECISIONS",
    "REDUCE_DTYPES",
    "TOLERANCE_TABLE",
    "LossScaler",
    "MixedPrecision",
    "PrecisionOptions",
    "ReferenceResult",
    "Rule",
    "TrainConfig",
    "_DRIFT",
    "assert_close_tensors",
    "compare_losses",
    "data_for",
    "make_optimizer",
    "max_rel_diff",
    "mixed_precision",
    "multimodal_data_for",
    "overflowed",
    "overflowed_on_any_rank",
    "rule",
    "tokens_agree",
    "train_multimodal_reference",
    "train_reference",
    "within",
]
