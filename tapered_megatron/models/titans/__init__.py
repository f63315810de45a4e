"""Titans: the ``titans`` architecture, a token mixer whose neural long-term memory learns inside
the sequence (Behrouz, Zhong, Mirrokni, "Titans: Learning to Memorize at Test Time", arXiv
2501.00663), one of the four architectures of Tapered Language Models (arXiv 2606.23670).

:mod:`~.scan` is the memory's kernel (the chunk-parallel scan and its hand-written backward),
:mod:`~.ops` the fused autograd nodes around it, :mod:`~.attention` the sliding-window attention
and :mod:`~.modules` the modules (:class:`NeuralMemory`, :class:`TitansMixer`); the options and the
record are :mod:`tapered_megatron.architectures.titans`. Ours, beyond the paper's equations:
chunk-start (mini-batch) gradients, an optional normalised (NLMS) step
(``titans.normalized_step``), a per-token clip of each memory step (``titans.memory_clip``),
forgetting half-lives spread over heads at init, an optional cap on the step size
(``titans.max_step``). Design and measurements: docs/memory_architectures.md.
"""

from tapered_megatron.architectures.titans import GATE_INIT, TitansOptions
from tapered_megatron.models.titans.attention import window_attention, window_mask
from tapered_megatron.models.titans.modules import NeuralMemory, TitansMixer
from tapered_megatron.models.titans.ops import (  # noqa: F401 - _head_rms_norm: the tests'
    _head_rms_norm,
    conv_silu_normalize,
    gated_head_norms,
)
from tapered_megatron.models.titans.scan import MAX_GRAD_NORM, NLMS_EPS, MemoryState, memory_scan

__all__ = [
    "GATE_INIT",
    "MAX_GRAD_NORM",
    "NLMS_EPS",
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
