"""SwiGLU MLP, the MLP slot of transformer, gated_attention and titans: the tapered site."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tapered_megatron.models.base import Counts, MLPSlot
from tapered_megatron.parallel import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from tapered_megatron.config import Config


class SwiGLU(MLPSlot):
    """``F(x) = W2 (silu(x W1) * (x W3))`` of width ``d_ff(l)`` from the taper plan.

    W1 and W3 are fused into one column-parallel weight ``w13`` of full shape ``[2 d_ff, d]``
    (W1 rows first), split per block so each TP rank holds ``d_ff(l)/tp`` columns of both;
    W2 is row-parallel. ``d_ff`` may be given explicitly (e.g. by a chain of MLP levels); the
    output projection's init std is scaled by ``1/sqrt(2 L)`` (GPT-2 / Megatron habit).
    """

    def __init__(self, cfg: Config, layer: int, d_ff: int | None = None) -> None:
        super().__init__(cfg, layer)
        m = cfg.model
        self.d_ff = d_ff if d_ff is not None else cfg.taper_plan.widths[layer]
        std_out = m.init_std / math.sqrt(2 * m.layers)
        self.w13 = ColumnParallelLinear(
            m.d_model, 2 * self.d_ff, std=m.init_std, out_blocks=(2, self.d_ff), split_dim=1
        )
        self.w2 = RowParallelLinear(self.d_ff, m.d_model, std=std_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    @classmethod
    def counts(
        cls, cfg: Config, layer: int, dtype_bytes: int = 2, d_ff: int | None = None
    ) -> Counts:
        d = cfg.model.d_model
        f = d_ff if d_ff is not None else cfg.taper_plan.widths[layer]
        params = 3 * d * f
        # kept for backward: input (d), gate, up, silu(gate) and the product fed to W2 (4 f)
        return Counts(params, 2.0 * params, float((d + 4 * f) * dtype_bytes))
