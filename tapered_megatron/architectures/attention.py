"""The records of ``transformer`` (causal softmax attention) and ``gated_attention`` (its output
gated per head), whose modules are :mod:`tapered_megatron.models.attention`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tapered_megatron.architectures.record import Architecture, register_architecture

if TYPE_CHECKING:
    from tapered_megatron.config import Config

MODULES = "tapered_megatron.models.attention"


@dataclass(frozen=True)
class GateOptions:
    """``gated_attention``'s setting, written directly under ``model`` (``--model.gate``)."""

    gate: Literal["elementwise", "headwise"] = "elementwise"


def describe_gated(cfg: Config) -> str:
    """``gated_attention (gate elementwise)``."""
    return f"gated_attention (gate {cfg.model.gate})"


TRANSFORMER = register_architecture(
    Architecture("transformer", f"{MODULES}:Attention", compiles=True, kv_cache=True)
)
# d_ff: the gate projection's parameters given back by the MLP, within 2 % of the transformer's
# (within 1 % at the cpu scale of scripts/reproduce_tlm.py)
GATED_ATTENTION = register_architecture(
    Architecture(
        "gated_attention",
        f"{MODULES}:GatedAttention",
        options=GateOptions,
        section="",
        mixer_efficiency=0.95,  # the gate's elementwise pass beside the attention core
        compiles=True,
        kv_cache=True,
        describe=describe_gated,
        presets={
            "cpu": {"model": {"d_ff": 336}},
            "440m": {"model": {"d_ff": 3200}},
            "760m": {"model": {"d_ff": 3584}},
            "1.3b": {"model": {"d_ff": 4992}},
        },
    )
)
