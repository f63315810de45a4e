"""Architectures of Tapered Language Models, as one block design with pluggable token mixers.

Public entry (stable)::

    from tapered_megatron.models import build_model
    model = build_model(cfg)              # forward(input_ids) -> logits [b, s, padded_vocab]
    specs = pipeline_layer_specs(cfg)     # DeepSpeed LayerSpecs; loss_fn=lm_loss
    counts = count_model(cfg)             # params / FLOPs / activation bytes per layer
    table = units(cfg, "sublayer")        # the pipeline units everything above maps over

See :mod:`tapered_megatron.models.base` for the mixer / MLP-slot protocol,
:mod:`tapered_megatron.architectures` for the records (the registry) and
:mod:`tapered_megatron.models.registry` for the import of a record's modules.
"""

from tapered_megatron.architectures import (
    ARCHITECTURES,
    Architecture,
    ArchitectureError,
    load_plugins,
    register_architecture,
    resolve_architecture,
)
from tapered_megatron.models.base import (
    Counts,
    MLPSlot,
    TokenMixer,
    in_context_memory,
    take_diagnostics,
)
from tapered_megatron.models.counters import LayerCounts, ModelCounts, count_model
from tapered_megatron.models.language_model import (
    Block,
    Embedding,
    Head,
    HeadOutput,
    LanguageModel,
    Unit,
    allow_layer_recompiles,
    build_model,
    canonical_parameters,
    lm_loss,
    pipeline_layer_specs,
    set_recompute,
    unit_prefixes,
    units,
)
from tapered_megatron.models.registry import Blocks, blocks

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ArchitectureError",
    "Block",
    "Blocks",
    "Counts",
    "Embedding",
    "Head",
    "HeadOutput",
    "LanguageModel",
    "LayerCounts",
    "MLPSlot",
    "ModelCounts",
    "TokenMixer",
    "Unit",
    "allow_layer_recompiles",
    "blocks",
    "build_model",
    "canonical_parameters",
    "count_model",
    "in_context_memory",
    "lm_loss",
    "load_plugins",
    "pipeline_layer_specs",
    "register_architecture",
    "resolve_architecture",
    "set_recompute",
    "take_diagnostics",
    "unit_prefixes",
    "units",
]
