"""SwiGLU MLP, the MLP slot of transformer, gated_attention and titans: the tapered site."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tapered_megatron.autocast import autocast_off, autocast_operands
from tapered_megatron.models.base import Counts, MLPSlot, sequence_parallel
from tapered_megatron.parallel import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from tapered_megatron.config import Config


class _SwiGLUFn(torch.autograd.Function):
    """``(silu(x W1^T) * (x W3^T)) W2^T`` with ``W13 = [W1; W3]``, hand-written backward.

    Same arithmetic as autograd's, but the gradient of the fused ``[gate | up]`` projection is
    written straight into one buffer (autograd's ``chunk`` backward concatenates a copy) and the
    silu derivative is one fused kernel. Eager only (under ``torch.compile`` inductor fuses the
    plain form).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, w13)
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate)
        prod = act * up
        ctx.save_for_backward(x, gate, up, act, prod, w13, w2)
        return F.linear(prod, w2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, up, act, prod, w13, w2 = ctx.saved_tensors
        f = w2.shape[1]
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w2 = g2.t().mm(prod.reshape(-1, f))
        grad_prod = g2.mm(w2).view(prod.shape)
        grad_h = torch.empty(*prod.shape[:-1], 2 * f, dtype=grad_prod.dtype, device=grad.device)
        grad_gate, grad_up = grad_h.chunk(2, dim=-1)
        torch.mul(grad_prod, act, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad_prod * up, gate, grad_input=grad_gate)
        gh2 = grad_h.view(-1, 2 * f)
        grad_x = gh2.mm(w13).view(x.shape)
        grad_w13 = gh2.t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w13, grad_w2


class SwiGLU(MLPSlot):
    """``F(x) = W2 (silu(x W1) * (x W3))`` of width ``d_ff(l)`` from the taper plan.

    W1 and W3 are fused into one column-parallel weight ``w13`` of full shape ``[2 d_ff, d]``
    (W1 rows first), split per block so each TP rank holds ``d_ff(l)/tp`` columns of both;
    W2 is row-parallel. ``d_ff`` may be given explicitly (e.g. by a chain of MLP levels); the
    output projection's init std is scaled by ``1/sqrt(2 L)`` (GPT-2 / Megatron habit). Under
    sequence parallelism ``w13`` all-gathers the sequence shards and ``w2`` reduce-scatters them.
    """

    takes_sequence_shards = True

    def __init__(self, cfg: Config, layer: int, d_ff: int | None = None) -> None:
        super().__init__(cfg, layer)
        m = cfg.model
        self.d_ff = d_ff if d_ff is not None else cfg.taper_plan.widths[layer]
        std_out = m.init_std / math.sqrt(2 * m.layers)
        sp = self.takes_sequence_shards and sequence_parallel(cfg)
        self.w13 = ColumnParallelLinear(
            m.d_model,
            2 * self.d_ff,
            std=m.init_std,
            out_blocks=(2, self.d_ff),
            split_dim=1,
            sequence_parallel=sp,
        )
        self.w2 = RowParallelLinear(self.d_ff, m.d_model, std=std_out, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        # the same as above: enter the TP region, both projections, leave it
        operands = autocast_operands(self.w13.enter(x), self.w13.weight, self.w2.weight)
        with autocast_off(x.device):
            y = _SwiGLUFn.apply(*operands)
        return self.w2.leave(y)

    @classmethod
    def counts(
        cls, cfg: Config, layer: int, dtype_bytes: int = 2, d_ff: int | None = None
    ) -> Counts:
        d = cfg.model.d_model
        f = d_ff if d_ff is not None else cfg.taper_plan.widths[layer]
        params = 3 * d * f
        # kept for backward: input (d), gate, up, silu(gate) and the product fed to W2 (4 f)
        return Counts(params, 2.0 * params, float((d + 4 * f) * dtype_bytes))

    @classmethod
    def backward_peaks(
        cls,
        cfg: Config,
        layer: int,
        dtype_bytes: int,
        batch: int,
        tp: int,
        saved: float,
        d_ff: int | None = None,
    ) -> list[tuple[float, float]]:
        """:class:`_SwiGLUFn`'s backward on one of ``tp`` ranks (width ``f = d_ff / tp``) for
        ``batch`` sequences: with ``W2``'s gradient made, the product's gradient (f), the fused
        projection's (2 f) and silu's input gradient (f); at the end, with every gradient, the
        product's and the projection's gradients and the input's (d, whole)."""
        d = cfg.model.d_model
        f = (d_ff if d_ff is not None else cfg.taper_plan.widths[layer]) / tp
        tokens = batch * cfg.model.seq_len * dtype_bytes
        return [(4 * f * tokens, 1 / 3), ((3 * f + d) * tokens, 1.0)]
