"""Hope-attention's Continuum Memory System (CMS), the MLP slot of ``hope_attention``."""

from tapered_megatron.models.hope.modules import (  # noqa: F401 - the tests'
    NORM_EPS,
    W2_GATE_GAIN,
    ContinuumMemory,
    HopeOptions,
    _scales,
    _UpdatingWindow,
    _WindowSpec,
    level_widths,
    teach_pass,
)

__all__ = [
    "NORM_EPS",
    "W2_GATE_GAIN",
    "ContinuumMemory",
    "HopeOptions",
    "level_widths",
    "teach_pass",
]
