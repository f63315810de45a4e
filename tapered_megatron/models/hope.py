"""Hope-attention's Continuum Memory System (CMS), the MLP slot of ``hope_attention``.

Behrouz, Razaviyayn, Zhong, Mirrokni, "Nested Learning: The Illusion of Deep Learning
Architectures" (arXiv 2512.24695), sections on Hope and the Continuum Memory System;
tlm-spec.md section 5.4. A Hope-attention block is causal softmax attention followed by a chain of
``K`` MLP levels; level ``i`` has an update period ``C_i`` (tokens) and its weights change inside
the sequence only at multiples of ``C_i``, by the accumulated inner-loop update of the last
``C_i`` tokens (paper's CMS rule ``W <- W - sum_{t in period} eta_t f(W; x_t)`` applied when
``t = 0 mod C_i``). Slow levels hold persistent knowledge, fast levels adapt in context.

Choices the paper leaves open, and ours:

* Level form: a SwiGLU MLP ``f_i(u) = W_2 (silu(W_g u) * W_u u)``, the same kind as every other
  architecture's MLP slot; the chain is residual, ``u_i = u_{i-1} + f_i(u_{i-1})`` with ``u_0``
  the block's normalised input, and the slot returns ``u_K - u_0 = sum_i f_i(u_{i-1})`` (the block
  adds it to the residual stream). No extra norms inside the chain (none to budget).
* Budget (the tapered site): level widths ``h_i`` split layer ``l``'s ``d_ff(l)`` as evenly as
  possible in units of the taper plan's rounding unit (``taper.multiple``; earlier levels get
  the remainder), so ``sum_i h_i = d_ff(l)`` and the CMS has exactly ``3 d d_ff(l)`` parameters,
  the SwiGLU MLP it replaces; tapered and uniform stay budget-equal. With ``K = 1`` and period 0
  the slot *is* the SwiGLU MLP.
* Inner objective (the paper allows any local objective): an associative next-position loss
  ``l_t(W) = 1/2 ||f_i(u_t; W) - u_{t+1}||^2`` -- each level learns in context to map its input
  at one position to its input at the next (the "lookahead value" of Zhao & Jones,
  arXiv 2601.00671; an induction-style memory). It needs no outer-loss signal, so it works the
  same in training, evaluation and generation, under pipeline parallelism, without a second pass.
* Update: plain gradient steps with constant rate ``eta = hope.lr / d_model`` per token (the
  inputs are RMS-normalised, so ``||u||^2 ~ d_model`` and ``hope.lr`` is the effective step on a
  repeated input), summed over the period (the paper's sum, not a mean), all gradients taken at
  the period-start weights. ``hope.lr = 0`` or period 0 disables updates for a level (plain MLP).
* Each token's inner gradient is clipped to norm ``sqrt(d_model)`` (norm 1 per unit-norm
  input; Frobenius over the level's three matrices). Without it a large ``hope.lr`` let the fast
  levels diverge inside a sequence (fp32 overflow within a few training steps at ``lr = 0.5``);
  with it the weights can only drift linearly in the sequence length.
* Causality: the update applied at boundary ``(p+1) C`` uses pairs ``(u_t, u_{t+1})`` for
  ``t`` in period ``p``, i.e. inputs at positions ``<= (p+1) C``; it first affects the output at
  position ``(p+1) C``. Outputs at ``<= t`` never see tokens ``> t``.
* The updates are differentiable: the outer loop learns initial weights that work well *after*
  the in-context updates (second-order terms included, as for Titans' memory). Updated weights
  are per sequence; a new sequence starts from the learned weights.
* Computation: the accumulated updates are kept as factors (``W_13 = W^0 - eta sum D^T X``,
  ``W_2 = W^0 - eta sum E^T A``) and applied in dual form (``x W^T = x W_0^T - eta (x X^T) D``);
  they are folded into per-sequence weights once ``d_model`` tokens have accumulated, which
  bounds the per-token cost. Building per-sequence weight copies every period instead was 25x
  slower than a static level on CPU (elementwise passes over ``B x 3 d w`` per period).
* Tensor parallelism: every level's hidden width is split over TP ranks (``W_g, W_u``
  column-parallel, ``W_2`` row-parallel); the inner gradient needs the full level output, which
  the row-parallel all-reduce already provides, so updates cost no extra communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.config import ConfigError, at_least
from tapered_megatron.models.attention import Attention
from tapered_megatron.models.base import Architecture, Counts, MLPSlot, register_architecture
from tapered_megatron.models.layers import silu_grad
from tapered_megatron.models.mlp import SwiGLU
from tapered_megatron.parallel.mappings import copy_to_tp_region, reduce_from_tp_region

if TYPE_CHECKING:
    from tapered_megatron.config import Config


@dataclass(frozen=True)
class HopeOptions:
    """``model.hope``: hope_attention's Continuum Memory System (tlm-spec.md section 5.4)."""

    levels: int = at_least(1, 3)  # K MLP levels in the chain
    periods: tuple[int, ...] = at_least(0, (0, 64, 16))  # update period per level; 0 = never
    lr: float = at_least(0.0, 0.01)  # inner-loop update rate scale; 0 disables the updates


def _validate(cfg: Config) -> None:
    """One period per level; the narrowest layer splits into that many rounding units."""
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


def level_widths(d_ff: int, levels: int, unit: int) -> list[int]:
    """Split ``d_ff`` into ``levels`` widths, multiples of ``unit``, as even as possible."""
    n, rem = divmod(d_ff, unit)
    if rem or n < levels:
        raise ValueError(
            f"model.hope.levels: d_ff={d_ff} cannot be split into {levels} levels of multiples of "
            f"{unit}; use fewer levels or a wider d_ff"
        )
    base, extra = divmod(n, levels)
    return [(base + (1 if i < extra else 0)) * unit for i in range(levels)]


class CMSLevel(SwiGLU):
    """One level of the chain: a SwiGLU of width ``d_ff`` with an update period (0: never).

    ``forward`` is the plain SwiGLU (static weights); :meth:`forward_updating` adds the in-context
    updates.
    """

    def __init__(self, cfg, layer: int, d_ff: int, period: int) -> None:
        super().__init__(cfg, layer, d_ff=d_ff)
        self.period = period

    def forward_updating(
        self, u: torch.Tensor, eta: float, record: list | None = None
    ) -> torch.Tensor:
        """Output with in-context updates at every multiple of ``period``; ``u`` [B, S, d].

        The updated weights are kept in factored form, ``W_13 = W_13^0 - eta sum D^T X`` and
        ``W_2 = W_2^0 - eta sum E^T A`` over the tokens seen so far, and applied as
        ``x W^T = x W_0^T - eta (x X^T) D`` (the dual form), so no per-sequence weight copy is
        built; the factors are folded into materialised per-sequence weights once more than
        ``d_model`` tokens have accumulated, which bounds the dual form's cost per token.
        """
        seq, c, d = u.shape[1], self.period, u.shape[-1]
        ul = copy_to_tp_region(u)
        w13, w2 = self.w13.weight, self.w2.weight  # shared [2h, d], [d, h] until materialised
        xs: list[torch.Tensor] = []  # factors: X, D (for W_13) and A, E (for W_2)
        ds: list[torch.Tensor] = []
        as_: list[torch.Tensor] = []
        es: list[torch.Tensor] = []
        outs = []
        for start in range(0, seq, c):
            x = ul[:, start : start + c]
            gv = x @ w13.transpose(-1, -2)
            if xs:
                xp, dp, ap, ep = (torch.cat(f, dim=1) for f in (xs, ds, as_, es))
                gv = gv - eta * ((x @ xp.transpose(1, 2)) @ dp)
            g, v = gv.chunk(2, dim=-1)
            a = F.silu(g) * v
            o = a @ w2.transpose(-1, -2)
            if xs:
                o = o - eta * ((a @ ap.transpose(1, 2)) @ ep)
            out = reduce_from_tp_region(o)
            outs.append(out)
            if start + c >= seq:
                break
            e = copy_to_tp_region(out - u[:, start + 1 : start + c + 1])
            da = e @ w2
            if xs:
                da = da - eta * ((e @ ep.transpose(1, 2)) @ ap)
            dgv = torch.cat([da * v * silu_grad(g), da * F.silu(g)], dim=-1)
            # per-token clip of the gradient norm (||d x^T|| = ||d|| ||x||), scale 1/sqrt(d)
            sq = reduce_from_tp_region(
                a.pow(2).sum(-1) * e.pow(2).sum(-1) + dgv.pow(2).sum(-1) * x.pow(2).sum(-1)
            )
            scale = torch.rsqrt((sq / d).clamp_min(1.0))[..., None]
            xs.append(x)
            ds.append(dgv * scale)
            as_.append(a)
            es.append(e * scale)
            if record is not None and bool(ds[-1].abs().amax() + es[-1].abs().amax() > 0):
                record.append(start + c)
            if sum(f.shape[1] for f in xs) >= d:
                xp, dp, ap, ep = (torch.cat(f, dim=1) for f in (xs, ds, as_, es))
                w13 = w13 - eta * (dp.transpose(1, 2) @ xp)
                w2 = w2 - eta * (ep.transpose(1, 2) @ ap)
                xs, ds, as_, es = [], [], [], []
        return torch.cat(outs, dim=1)


class ContinuumMemory(MLPSlot):
    """The CMS MLP slot of layer ``layer``: ``forward(u [B, S, d]) -> sum_i f_i(u_{i-1})``.

    ``record_updates = True`` makes each forward store, per level, the token positions at which
    that level's weights were updated (``self.last_updates``), for tests and diagnostics.
    """

    def __init__(self, cfg, layer: int, d_ff: int | None = None) -> None:
        super().__init__(cfg, layer)
        m, h = cfg.model, cfg.model.hope
        plan = cfg.taper_plan
        d_ff = plan.widths[layer] if d_ff is None else d_ff
        self.widths = level_widths(d_ff, h.levels, plan.unit)
        self.eta = h.lr / m.d_model
        self.levels = nn.ModuleList(
            CMSLevel(cfg, layer, w, p) for w, p in zip(self.widths, h.periods)
        )
        self.record_updates = False
        self.last_updates: list[list[int]] = []

    @classmethod
    def counts(cls, cfg, layer: int, dtype_bytes: int = 2, d_ff: int | None = None) -> Counts:
        """Full-model params (exactly ``3 d d_ff(l)``), forward FLOPs/token, activation bytes."""
        m, h = cfg.model, cfg.model.hope
        d = m.d_model
        d_ff = cfg.taper_plan.widths[layer] if d_ff is None else d_ff
        widths = level_widths(d_ff, h.levels, cfg.taper_plan.unit)
        total = Counts(0, 0.0, 0.0)
        for w, period in zip(widths, h.periods):
            base = SwiGLU.counts(cfg, layer, dtype_bytes, d_ff=w)
            if period > 0 and h.lr > 0:
                # dual form over n ~ min(s, d)/2 held factor tokens: x X^T D, a A^T E, e E^T A
                # (n (3d + 4w)), e W2 (d w) and the fold into weights every d tokens (3 d w);
                # kept: D, E, clip scale (2w + d + 1), the three n-wide products, the folded
                # per-sequence weights (3 d w per d tokens)
                n = min(m.seq_len, d) / 2
                macs = 4 * d * w + n * (3 * d + 4 * w)
                elems = 2 * w + d + 1 + 3 * n + 3 * w
                base = base + Counts(0, 2.0 * macs, elems * dtype_bytes)
            total = total + base
        return total

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        total = None
        self.last_updates = []
        for level in self.levels:
            rec: list[int] = []
            if level.period > 0 and self.eta > 0:
                o = level.forward_updating(u, self.eta, rec if self.record_updates else None)
            else:
                o = level(u)
            self.last_updates.append(rec)
            u = u + o
            total = o if total is None else total + o
        return total


register_architecture(
    Architecture(
        "hope_attention", Attention, ContinuumMemory, HopeOptions, "hope", validate=_validate
    )
)
