"""Titans: a neural long-term memory that learns inside the sequence."""

from tapered_megatron.models.titans.scan import (
    MAX_GRAD_NORM,
    MemoryState,
    NeuralMemory,
    TitansMixer,
    TitansOptions,
    _head_rms_norm,  # noqa: F401 - the tests'
    conv_silu_normalize,
    gated_head_norms,
    memory_scan,
    window_attention,
    window_mask,
)

__all__ = [
    "MAX_GRAD_NORM",
    "MemoryState",
    "NeuralMemory",
    "TitansMixer",
    "TitansOptions",
    "conv_silu_normalize",
    "gated_head_norms",
    "memory_scan",
    "window_attention",
    "window_mask",
]
