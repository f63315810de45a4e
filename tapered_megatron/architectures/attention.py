"""The records of ``transformer`` (causal softmax attention) and ``gated_attention`` (its output
gated per head), whose modules are :mod:`tapered_megatron.models.attention`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tapered_megatron.architectures.record import Architecture, register_architecture

MODULES = "tapered_megatron.models.attention"


@dataclass(frozen=True)
class GateOptions:
    """``gated_attention``'s setting, written directly under ``model`` (``--model.gate``)."""

    gate: Literal["elementwise", "headwise"] = "elementwise"


TRANSFORMER = register_architecture(
    Architecture("transformer", f"{MODULES}:Attention", compiles=True)
)
GATED_ATTENTION = register_architecture(
    Architecture(
        "gated_attention",
        f"{MODULES}:GatedAttention",
        options=GateOptions,
        section="",
        mixer_efficiency=0.95,  # the gate's elementwise pass beside the attention core
        compiles=True,
    )
)
