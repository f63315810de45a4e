"""Evaluation: validation loss of a DeepSpeed engine (plain or pipeline) during training, and
the offline tools' computations a training loop can call too (:func:`perplexity_of`,
:func:`alignment_of`). The command-line tools are the submodules ``perplexity``, ``alignment``
and ``zeroshot``."""

from tapered_megatron.eval.alignment import LayerAlignment, alignment_of
from tapered_megatron.eval.perplexity import Perplexity, perplexity_of
from tapered_megatron.eval.validation import validation_loss

__all__ = ["LayerAlignment", "Perplexity", "alignment_of", "perplexity_of", "validation_loss"]
