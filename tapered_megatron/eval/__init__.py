"""Evaluation: validation loss and perplexity of a DeepSpeed engine (plain or pipeline)."""

from tapered_megatron.eval.validation import validation_loss

__all__ = ["validation_loss"]
