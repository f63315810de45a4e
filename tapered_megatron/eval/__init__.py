"""Evaluation of trained models: the offline tools' computations (:func:`perplexity_of`,
:func:`alignment_of`) and, re-exported from :mod:`tapered_megatron.training.validation`, the
validation loss training logs. The command-line tools are the submodules ``perplexity``,
``alignment`` and ``zeroshot``."""

from tapered_megatron.eval.alignment import LayerAlignment, alignment_of
from tapered_megatron.eval.perplexity import Perplexity, perplexity_of
from tapered_megatron.training.validation import validation_loss

__all__ = ["LayerAlignment", "Perplexity", "alignment_of", "perplexity_of", "validation_loss"]
