"""Hope: the ``hope_attention`` architecture, causal attention followed by a Continuum Memory System
whose MLP levels update inside the sequence (Behrouz, Razaviyayn, Zhong, Mirrokni, "Nested
Learning: The Illusion of Deep Learning Architectures", arXiv 2512.24695), one of the four
architectures of Tapered Language Models (arXiv 2606.23670).

:mod:`~.window` is the kernel (one fold window of an updating level, with its hand-written
backward, and the choice of the window's length), :mod:`~.modules` the modules (:class:`CMSLevel`,
:class:`ContinuumMemory`) and the teach signal's first pass; the options and the record are
:mod:`tapered_megatron.architectures.hope`. Ours, beyond the paper: updates inside the sequence at
period boundaries, normalised and clipped steps, and either the association rule (the default; one
pass, any parallelism) or the final layer's error signal as every level's error (``hope.update
teach``, what the presets use). Design and measurements: docs/memory_architectures.md.
"""

from tapered_megatron.architectures.hope import HopeOptions
from tapered_megatron.models.hope.modules import (
    W2_GATE_GAIN,
    CMSLevel,
    ContinuumMemory,
    level_widths,
    teach_pass,
)
from tapered_megatron.models.hope.window import NORM_EPS, fold_window, window_macs

__all__ = [
    "NORM_EPS",
    "W2_GATE_GAIN",
    "CMSLevel",
    "ContinuumMemory",
    "HopeOptions",
    "fold_window",
    "level_widths",
    "teach_pass",
    "window_macs",
]
