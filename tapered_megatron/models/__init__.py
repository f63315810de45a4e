"""Architectures of Tapered Language Models, as one block design with pluggable token mixers.

Public entry (stable)::

    from tapered_megatron.models import build_model
    model = build_model(cfg)              # forward(input_ids) -> logits [b, s, padded_vocab]
    specs = pipeline_layer_specs(cfg)     # DeepSpeed LayerSpecs; loss_fn=lm_loss
    counts = count_model(cfg)             # params / FLOPs / activation bytes per layer

See :mod:`tapered_megatron.models.base` for the mixer / MLP-slot protocol and the registry.
"""

from tapered_megatron.models.base import (
    ARCHITECTURES,
    ArchitectureError,
    Counts,
    MLPSlot,
    TokenMixer,
    register_architecture,
    resolve_architecture,
)
from tapered_megatron.models.counters import LayerCounts, ModelCounts, count_model
from tapered_megatron.models.language_model import (
    Block,
    Embedding,
    Head,
    LanguageModel,
    MixerUnit,
    MLPUnit,
    build_model,
    lm_loss,
    pipeline_layer_specs,
    set_activation_checkpointing,
)

__all__ = [
    "ARCHITECTURES",
    "ArchitectureError",
    "Block",
    "Counts",
    "Embedding",
    "Head",
    "LanguageModel",
    "LayerCounts",
    "MLPSlot",
    "MLPUnit",
    "MixerUnit",
    "ModelCounts",
    "TokenMixer",
    "build_model",
    "count_model",
    "lm_loss",
    "pipeline_layer_specs",
    "register_architecture",
    "resolve_architecture",
    "set_activation_checkpointing",
]
