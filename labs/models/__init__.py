"""The course model (``labs.models.transformer``) and ``transformers`` adapters
(``labs.models.hf``)."""

from labs.models.transformer import ModelConfig, Transformer, build_model, count_params

__all__ = ["ModelConfig", "Transformer", "build_model", "count_params"]
