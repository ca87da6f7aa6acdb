"""The model: plain PyTorch, no parallel code (parallelism is applied from outside)."""

from fivefold.model.transformer import Block, Transformer, build_model, lm_loss, materialize

__all__ = ["Block", "Transformer", "build_model", "lm_loss", "materialize"]
