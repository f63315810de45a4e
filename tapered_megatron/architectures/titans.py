"""The record of ``titans`` (a token mixer whose neural long-term memory learns inside the
sequence; modules: :mod:`tapered_megatron.models.titans`): its ``model.titans`` options and
their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tapered_megatron.architectures.record import Architecture, register_architecture
from tapered_megatron.config_fields import ConfigError, at_least

if TYPE_CHECKING:
    from tapered_megatron.config import Config

GATE_BIAS_INIT = {"theta": -3.0, "eta": 2.0}  # alpha: per head, see alpha_half_lives
# theta (~0.047) and eta (~0.881) at init, whatever their caps (max_step, max_momentum)
GATE_INIT = {g: 1.0 / (1.0 + math.exp(-b)) for g, b in GATE_BIAS_INIT.items()}


@dataclass(frozen=True)
class TitansOptions:
    """``model.titans``: the neural long-term memory of the ``titans`` architecture."""

    variant: Literal["mag", "mal", "mac", "lmm"] = "mag"
    memory_depth: int = at_least(2, 2)  # layers of the per-head memory MLP
    memory_expansion: int = at_least(1, 2)  # memory MLP hidden width, as a multiple of head_dim
    chunk_size: int = at_least(1, 16)  # tokens per chunk of the chunk-parallel update
    conv_size: int = at_least(1, 4)  # short causal depthwise convolution on q, k, v
    window: int = at_least(1, 64)  # attention window (MAG / MAL); MAC: segment length
    persistent_tokens: int = at_least(0, 0)  # learned key/value pairs before every attention
    # per-token clip of the memory gradient's Frobenius norm over all layers; 0: no clip
    memory_clip: float = at_least(0.0, 1.0)
    # each token's memory step normalised by the memory's curvature along its error (NLMS,
    # models.titans.scan's step scales) instead of the plain gradient step
    normalized_step: bool = False
    # truncated backpropagation through the memory: the outer gradient flows back through the
    # memory state across at most this many chunks (cut at every block of that many); 0: none
    backprop_chunks: int = at_least(0, 0)
    # initial forgetting half-lives of the first and last head, in windows (log-spaced between)
    forget_half_lives: tuple[float, float] = (0.25, 16.0)
    # the largest step size and momentum: theta = max_step * sigmoid(x W + b), likewise eta
    # with max_momentum, the biases set so that both start at GATE_INIT whatever the caps;
    # 1: the plain sigmoid gate
    max_step: float = 1.0
    max_momentum: float = 1.0


def validate(cfg: Config) -> None:
    """Persistent tokens need an attention (not lmm); MAC segments start at chunk starts;
    forgetting half-lives positive, first <= last."""
    t = cfg.model.titans
    lo, hi = t.forget_half_lives
    if not 0 < lo <= hi:
        raise ConfigError(
            f"model.titans.forget_half_lives: {list(t.forget_half_lives)} must be two positive "
            "numbers of windows, the first no larger than the second (e.g. 0.25 16)"
        )
    for key, gate, cap in (
        ("max_step", "theta", t.max_step),
        ("max_momentum", "eta", t.max_momentum),
    ):
        if not GATE_INIT[gate] < cap <= 1.0:
            raise ConfigError(
                f"model.titans.{key}: {cap} must lie in ({GATE_INIT[gate]:.4f}, 1] ({gate} "
                "starts at that lower bound); or 1 for the uncapped gate"
            )
    if t.variant == "lmm" and t.persistent_tokens:
        raise ConfigError(
            "model.titans.persistent_tokens: variant lmm has no attention to prepend them to; "
            "use 0 or another variant"
        )
    if t.variant == "mac" and t.window % t.chunk_size:
        raise ConfigError(
            f"model.titans.window ({t.window}) must be a multiple of model.titans.chunk_size "
            f"({t.chunk_size}) for variant mac (segments start at chunk starts)"
        )


def describe(cfg: Config) -> str:
    """``titans (variant mag)``."""
    return f"titans (variant {cfg.model.titans.variant})"


# The memory rule of every GPU preset, `cpu`'s (below) at 4096-token sequences: the normalised
# step without a per-token clip, the step size capped at 0.1, the outer gradient cut every 64
# tokens, in chunks of 8: a chunk's tokens all step from its start weights, so one chunk can move
# a read-out by up to chunk_size x max_step of its error; in chunks of 64 the memory diverges
# within a sequence (measurements: docs/memory_architectures.md, scripts/bench_titans_stability.py).
GPU = {
    "chunk_size": 8,
    "window": 1024,
    "max_step": 0.1,
    "memory_clip": 0,
    "normalized_step": True,
    "backprop_chunks": 8,
}
# The paper's persistent tokens before the window; d_ff (below): the memory branch's parameters
# given back by the MLP, within 2 % of the transformer's.
PAPER = {**GPU, "persistent_tokens": 4}
# The `cpu` scale of scripts/reproduce_tlm.py: tlm_cpu's model and recipe with sequences of 512
# tokens, 2 per micro-batch (the same 1024 tokens per step and per evaluation iteration), MAG
# attention over a 64-token window (1/8 of the sequence, as titans_440m's 1024 of 4096) and the
# paper's persistent tokens in front of it, so the memory carries what the window cannot see;
# d_ff 208 (not 384) gives the memory branch's parameters back: within 1 % of the transformer's.
# Chunks of 4 tokens: with 16 (the default) the gradient norm at init is 50-170x larger at this
# shape and sequence length. Forgetting half-lives from 2 windows: from 0.25 (the default) the
# fastest head's memory decays to ~0 over 512 tokens, where a deep memory gets no gradient
# (docs/memory_architectures.md). Each token's step normalised by the memory's curvature along
# its error (normalized_step, NLMS) with no per-token clip: with the plain gradient step the
# gradient norm explodes unless a clip of 0.25 scales down nearly every token's step. The step
# size theta capped at 0.1 (it starts at 0.047) with the outer gradient cut every 16 chunks (64
# tokens, one window; backprop_chunks): uncut, a cap of 0.075 or 0.1 lets the gradient through
# the sequence's 128 chunks explode, and the cap of 0.05 that is stable uncut leaves the memory
# worth less than 0.02 nats; cut every 16 chunks the memory is worth more than cut every 32
# (same doc).
CPU = {
    "model": {
        "seq_len": 512,
        "d_ff": 208,
        "titans": {
            "window": 64,
            "persistent_tokens": 4,
            "chunk_size": 4,
            "forget_half_lives": [2, 16],
            "max_step": 0.1,
            "memory_clip": 0,
            "normalized_step": True,
            "backprop_chunks": 16,
        },
    },
    "train": {"micro_batch_size": 2},
}

TITANS = register_architecture(
    Architecture(
        "titans",
        "tapered_megatron.models.titans.modules:TitansMixer",
        options=TitansOptions,
        validate=validate,
        mixer_efficiency=0.6,  # chunked memory scan: small batched matmuls and a Python loop
        compiles=True,  # the chunk step compiles on its own; the chunk loop stays eager
        in_context=True,
        describe=describe,
        presets={
            "cpu": CPU,
            "440m": {"model": {"d_ff": 2432, "titans": PAPER}},
            "760m": {"model": {"d_ff": 2432, "titans": PAPER}},
            "1.3b": {"model": {"d_ff": 3456, "titans": PAPER}},
            "7b": {"model": {"titans": GPU}},
            "30b": {"model": {"titans": GPU}},
            "70b": {"model": {"titans": GPU}},
        },
    )
)
