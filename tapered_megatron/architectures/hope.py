"""The record of ``hope_attention`` (causal attention followed by a Continuum Memory System;
modules: :mod:`tapered_megatron.models.hope`): its ``model.hope`` options, their checks and the
cost of the teach signal's first pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tapered_megatron.architectures.record import Architecture, register_architecture
from tapered_megatron.config_fields import ConfigError, at_least

if TYPE_CHECKING:
    from tapered_megatron.config import Config

MODULES = "tapered_megatron.models.hope.modules"


@dataclass(frozen=True)
class HopeOptions:
    """``model.hope``: hope_attention's Continuum Memory System."""

    levels: int = at_least(1, 3)  # K MLP levels in the chain
    periods: tuple[int, ...] = at_least(0, (0, 64, 16))  # update period per level; 0 = never
    lr: float = at_least(0.0, 0.1)  # inner-loop rate scale (effective step on a repeated input)
    rate: Literal["learned", "constant"] = "learned"  # learned: sigmoid of a map of the input
    rate_init: float = 0.1  # learned rate: initial sigmoid value (gate bias logit(rate_init))
    update: Literal["association", "teach"] = "association"  # next position | outer-loss signal
    # W_2's step: over the level input's squared norm (input), over its own input's (own), or
    # over its own input's with a gate of its own (split; hope.window's module doc)
    step_norm: Literal["input", "own", "split"] = "split"
    w2_rate_init: float = 1e-5  # split: initial value of W_2's gate (which can reach 1)
    # split: the least init std over tokens of W_2's gate logit (gain x (u w' + b')); 0 keeps
    # the weights' init_std (recall vs language modelling: docs/memory_architectures.md)
    w2_gate_spread: float = at_least(0.0, 0.0)


def validate(cfg: Config) -> None:
    """One period per level; the narrowest layer splits into that many rounding units; a
    learned rate's initial value lies in (0, 1); ``w2_gate_spread`` needs ``W_2``'s gate;
    ``teach`` needs the whole model (no pipeline)."""
    h, plan = cfg.model.hope, cfg.taper_plan
    if len(h.periods) != h.levels:
        raise ConfigError(
            f"model.hope.periods: give one period per level ({h.levels}), got {list(h.periods)}"
        )
    if min(plan.widths) < h.levels * plan.unit:
        raise ConfigError(
            f"model.hope.levels: the narrowest layer (d_ff={min(plan.widths)}) cannot be split "
            f"into {h.levels} CMS levels of at least one rounding unit ({plan.unit}); use fewer "
            "levels, a wider model.d_ff or a smaller taper.multiple"
        )
    for key in ("rate_init", "w2_rate_init"):
        if not 0 < getattr(h, key) < 1:
            raise ConfigError(f"model.hope.{key}: {getattr(h, key)} must lie in (0, 1)")
    if h.w2_gate_spread and (h.step_norm != "split" or h.rate != "learned"):
        raise ConfigError(
            f"model.hope.w2_gate_spread: {h.w2_gate_spread} sets W_2's own gate, which exists "
            "only with model.hope.step_norm split and model.hope.rate learned; drop it or use both"
        )
    if h.update == "teach" and cfg.parallel.pp != 1:
        raise ConfigError(
            "model.hope.update: teach needs a first pass of the whole model (parallel.pp = 1); "
            "use association under pipeline parallelism"
        )


def first_pass_config(cfg: Config) -> Config | None:
    """What the teach signal's first pass costs: a forward of the same model with static CMS
    levels (the config without in-context updates); None under ``association``."""
    if cfg.model.hope.update != "teach":
        return None
    return cfg.with_overrides(["--model.hope.update", "association", "--model.hope.lr", "0"])


# A static level, a slow one, a fast one; at the paper's first three sizes learning in context
# from the LM loss's error signal (update teach). At the `cpu` scale of scripts/reproduce_tlm.py,
# tlm_cpu with the teach signal: the association rule's updates, the library default, lower the
# trained model's loss by under 0.001 nats at that scale.
LEVELS = {"levels": 3, "periods": [0, 1024, 64]}
TEACH = {"model": {"hope": {**LEVELS, "update": "teach"}}}

HOPE_ATTENTION = register_architecture(
    Architecture(
        "hope_attention",
        "tapered_megatron.models.attention:Attention",
        f"{MODULES}:ContinuumMemory",
        HopeOptions,
        "hope",
        validate=validate,
        compiles=True,  # the CMS period loop stays eager (torch.compiler.disable)
        first_pass=f"{MODULES}:first_pass",
        first_pass_config=first_pass_config,
        in_context=True,
        presets={
            "cpu": {"model": {"hope": {"update": "teach"}}},
            "440m": TEACH,
            "760m": TEACH,
            "1.3b": TEACH,
            "7b": {"model": {"hope": LEVELS}},
            "30b": {"model": {"hope": LEVELS}},
            "70b": {"model": {"hope": LEVELS}},
        },
    )
)
