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
  the remainder), so ``sum_i h_i = d_ff(l)`` and the CMS matrices have exactly ``3 d d_ff(l)``
  parameters, the SwiGLU MLP it replaces; tapered and uniform stay budget-equal. Each updating
  level adds rate gates of ``d + 1`` parameters each (below: two with the default
  ``step_norm split``; 0.07 % of the level at d 1024), the same in every layer, so tapered and
  uniform still differ by exactly ``3 d`` times the width deviation. With ``K = 1`` and period
  0 the slot *is* the SwiGLU MLP.
* Inner objective, ``hope.update`` (the paper allows any local objective):
  ``association`` (default): the next-position loss ``l_t(W) = 1/2 ||f_i(u_t; W) - u_{t+1}||^2``
  -- each level learns in context to map its input at one position to its input at the next (the
  "lookahead value" of Zhao & Jones, arXiv 2601.00671; an induction-style memory). It needs no
  outer-loss signal, so it works the same in training, evaluation and generation, under pipeline
  parallelism, in one pass.
  ``teach``: the error of token ``t`` is the outer language-model loss's own signal, the "teach
  signal" of the Nested Learning reference implementation (nested-learning on PyPI,
  ``training.compute_teach_signal`` and the CMS chunk loss ``||f(u) - (f(u) - teach)||^2``):
  ``delta_t = (softmax(z_t) - one_hot(x_{t+1})) W_head``, the gradient of token ``t``'s
  cross-entropy w.r.t. the (normalised) final hidden state, used as every level's output error.
  It comes from a first, no-grad pass of the whole model with static CMS levels
  (:func:`teach_pass`, called by ``LanguageModel.forward``); the second pass is the real one.
  Ours differs from the reference in three stated ways: the signal is per token (not divided by
  the token count), divided by the RMS entry of ``W_head`` (so its size does not follow the head's
  weight growth; ``||delta_t|| ~ sqrt(d) ||softmax - one_hot||``, the scale of the association
  error), and the updates act inside the same sequence at the period boundaries (the reference
  applies them between chunks of a stream). Causal: ``delta_t`` depends on tokens ``<= t + 1``
  and enters the weights at the boundary after ``t``, i.e. at positions ``>= t + 1``. Costs one
  extra forward pass; needs the whole model in one process (``parallel.pp = 1``).
* Rate, ``hope.rate``: ``learned`` (default): per level and token, ``eta_t = (hope.lr / d_model)
  sigmoid(u_t w_i + b_i)`` from the level's own input, as Titans computes its step size theta
  (Behrouz et al. 2025), with ``w_i ~ normal(0, init_std)`` and ``b_i = logit(hope.rate_init)``
  (``W_2``'s own gate under ``step_norm split``: below). ``constant``: ``eta = hope.lr / d_model``
  for every token (and ``W_2``'s rate ``hope.w2_rate_init`` under ``split``). ``W_13``'s step
  is divided by the squared norm of the level's input ``||u_t||^2``; the inputs are
  RMS-normalised, so ``||u||^2 ~ d_model`` and ``hope.lr * sigmoid(.)`` is the effective step
  on a repeated input (the fraction of the error on that input one update removes, for a
  linear level).
* ``hope.step_norm``, how ``W_2``'s step is normalised (its input is the hidden activation
  ``a_t``, not normalised, and small at init). Measured, not derived: language modelling at the
  ``tlm_cpu`` reproduction scale (hope_attention, uniform, seed 1234, validation loss after 120
  of 320 iterations; the transformer: 5.099, no in-context updates (``hope.lr 0``): 5.41) and
  the associative-recall benchmark (scripts/bench_memory_recall.py, 300 steps, chance 0.016;
  the transformer: 0.015):
  ``split`` (default): ``W_2`` has a rate gate of its own, ``rho_t = sigmoid(10 (u_t w'_i +
  b'_i))``, started at ``hope.w2_rate_init`` (1e-5) and able to reach 1, and its step is
  divided by ``||a_t||^2`` plus the period's mean ``||a||^2``: a normalised-LMS step on its own
  input (on a repeated input of typical size one token's step removes about ``rho / 2`` of its
  error) whose regulariser, the period's mean power, keeps a token with a tiny ``a_t`` from
  taking a huge step. ``W_13``'s step is as with ``input``. The gain 10 lets Adam move the
  gate's logit ten times faster, so the gate can open within a few hundred steps where binding
  pays while the ``W_2`` writes stay negligible where they do not. Language modelling 5.088
  (seed 1235: 5.079 against 5.118 with ``input``), recall 0.9998 (seed 1 of the benchmark:
  0.118, its loss only leaving chance level by step 300) (session 4 of issue 14). Without the
  gain the gate does not open from 1e-4 or 1e-5 within 300 steps (recall at chance; language
  modelling 5.151, 5.119); started at 1e-3 it opens (recall 1.0) but language modelling
  suffers (5.153; with the period's sum as the divisor and 0.01: 5.193). At d_model 1024 the
  gain also widens the gate's spread over tokens at init (logit std ~6 there, ~2 at d 128);
  not measured at that scale.
  ``input``: ``||u_t||^2`` as for ``W_13`` (the default before). Language modelling 5.116 with
  ``lr 0.1``, ``rate_init 0.1`` (5.18 with a constant 0.01, 5.48 with ``lr 1`` /
  ``rate_init 0.5``); recall at chance (0.014; 0.12 with ``lr 1`` / ``rate_init 0.5``): on a
  repeated input ``W_2``'s step removes only ``||a||^2 / ||u||^2`` of the rate.
  ``own``: ``||a_t||^2`` with ``W_13``'s gate, i.e. each matrix a normalised-LMS step on its
  own input. With ``lr 1`` / ``rate_init 0.5`` recall 0.999 (``rate_init`` 0.01 or 0.05: 1.0),
  but language modelling stalls: 6.07 after 320 iterations (perplexity 430; 4.62 for the
  transformer), and every rate tried was worse than no updates (5.45-6.08 after 120; ``lr 1``,
  ``rate_init 0.01``: 5.47): one gate cannot be small for ``W_2`` and useful for ``W_13``.
* Update: gradient steps summed over the period (the paper's sum, not a mean), all gradients
  taken at the period-start weights; ``hope.lr = 0`` or period 0 disables updates for a level
  (plain MLP).
* Each token's inner gradient is clipped to norm ``sqrt(d_model)`` (norm 1 per unit-norm
  input; Frobenius over the level's three matrices). Without it a large ``hope.lr`` let the fast
  levels diverge inside a sequence (fp32 overflow within a few training steps at ``lr = 0.5``);
  with it the weights can only drift linearly in the sequence length.
* Causality: the update applied at boundary ``(p+1) C`` uses pairs ``(u_t, u_{t+1})`` (or
  ``delta_t``) for ``t`` in period ``p``, i.e. inputs at positions ``<= (p+1) C``; it first
  affects the output at position ``(p+1) C``. Outputs at ``<= t`` never see tokens ``> t``.
* The updates are differentiable: the outer loop learns initial weights (and the rate gates) that
  work well *after* the in-context updates (second-order terms included, as for Titans' memory).
  Updated weights are per sequence; a new sequence starts from the learned weights.
* Computation: the accumulated updates are kept as factors (``W_13 = W^0 - sum r D^T X``,
  ``W_2 = W^0 - sum r E^T A``) and applied in dual form (``x W^T = x W_0^T - (x X^T) D``);
  they are folded into per-sequence weights once ``d_model`` tokens (a window, rounded up to
  whole periods) have accumulated, which bounds the per-token cost. Per window, ``x W_13^T``
  for every token and ``x_t X^T`` for every later period (``X`` are the level's inputs, known
  in advance) are one matmul each before the period loop (with ``teach``, so is ``e W_2``), so
  the loop only adds the dual-form corrections (fused ``baddbmm``) and ``W_2``; each period's
  ``D | A | E`` factors are one tensor (one concatenation per period for all three). Building
  per-sequence weight copies every period instead was 25x slower than a static level on CPU
  (elementwise passes over ``B x 3 d w`` per period).
* Tensor parallelism: every level's hidden width is split over TP ranks (``W_g, W_u``
  column-parallel, ``W_2`` row-parallel); the inner gradient needs the full level output, which
  the row-parallel all-reduce already provides, so updates cost no extra communication. The rate
  gates are replicated; their gradient is summed over ranks (``copy_to_tp_region``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.config import ConfigError, at_least
from tapered_megatron.models.attention import Attention
from tapered_megatron.models.base import Architecture, Counts, MLPSlot, register_architecture
from tapered_megatron.models.mlp import SwiGLU
from tapered_megatron.parallel import (
    copy_to_tp_region,
    get_tensor_model_parallel_world_size,
    reduce_from_tp_region,
    vocab_parallel_linear_cross_entropy_mean,
)

if TYPE_CHECKING:
    from tapered_megatron.config import Config

NORM_EPS = 1e-2  # added to a level input's squared norm before it divides the step (module doc)
W2_GATE_GAIN = 10.0  # split: W_2's gate is sigmoid(gain (u w + b)), so it can open in few steps


@dataclass(frozen=True)
class HopeOptions:
    """``model.hope``: hope_attention's Continuum Memory System (tlm-spec.md section 5.4)."""

    levels: int = at_least(1, 3)  # K MLP levels in the chain
    periods: tuple[int, ...] = at_least(0, (0, 64, 16))  # update period per level; 0 = never
    lr: float = at_least(0.0, 0.1)  # inner-loop rate scale (effective step on a repeated input)
    rate: Literal["learned", "constant"] = "learned"  # learned: sigmoid of a map of the input
    rate_init: float = 0.1  # learned rate: initial sigmoid value (gate bias logit(rate_init))
    update: Literal["association", "teach"] = "association"  # next position | outer-loss signal
    # W_2's step: over the level input's squared norm (input), over its own input's (own), or
    # over its own input's with a gate of its own (split; module doc)
    step_norm: Literal["input", "own", "split"] = "split"
    w2_rate_init: float = 1e-5  # split: initial value of W_2's gate (which can reach 1)


def _validate(cfg: Config) -> None:
    """One period per level; the narrowest layer splits into that many rounding units; a
    learned rate's initial value lies in (0, 1); ``teach`` needs the whole model (no pipeline)."""
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
    if h.update == "teach" and cfg.parallel.pp != 1:
        raise ConfigError(
            "model.hope.update: teach needs a first pass of the whole model (parallel.pp = 1); "
            "use association under pipeline parallelism"
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


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def _gate(
    d: int, init_std: float, init: float, gain: float = 1.0
) -> tuple[nn.Parameter, nn.Parameter]:
    """A learned rate gate ``sigmoid(gain (u w + b))``: ``w`` [d] ~ normal(0, init_std) (drawn
    by ``init_parameters``), ``b`` = logit(init) / gain, so the gate starts near ``init``."""
    w = nn.Parameter(torch.empty(d))
    w.init_std = init_std
    return w, nn.Parameter(torch.full((1,), _logit(init) / gain))


class CMSLevel(SwiGLU):
    """One level of the chain: a SwiGLU of width ``d_ff`` with an update period (0: never).

    ``forward`` is the plain SwiGLU (static weights); :meth:`forward_updating` adds the in-context
    updates. An updating level with ``hope.rate = learned`` owns its rate gate ``rate_w`` [d],
    ``rate_b`` [1] (replicated over TP ranks), and with ``hope.step_norm = split`` also ``W_2``'s
    gate ``w2_rate_w``, ``w2_rate_b``.
    """

    def __init__(self, cfg, layer: int, d_ff: int, period: int) -> None:
        super().__init__(cfg, layer, d_ff=d_ff)
        m, h = cfg.model, cfg.model.hope
        self.period = period
        self.updating = period > 0 and h.lr > 0
        self.step_norm = h.step_norm
        self.w2_rate = h.w2_rate_init  # split with constant rates: W_2's constant rate
        self.rate_w = self.rate_b = self.w2_rate_w = self.w2_rate_b = None
        if self.updating and h.rate == "learned":
            self.rate_w, self.rate_b = _gate(m.d_model, m.init_std, h.rate_init)
            if h.step_norm == "split":
                self.w2_rate_w, self.w2_rate_b = _gate(
                    m.d_model, m.init_std, h.w2_rate_init, W2_GATE_GAIN
                )

    def rates(self, u: torch.Tensor, eta: float, w2: bool = False) -> torch.Tensor:
        """Per-token step sizes [B, S]: ``eta * sigmoid(u w + b)`` (learned) or ``eta``; with
        ``w2``, ``W_2``'s own under ``step_norm = split``: ``sigmoid(gain (u w' + b'))`` or the
        constant ``w2_rate_init``."""
        w, b = (self.w2_rate_w, self.w2_rate_b) if w2 else (self.rate_w, self.rate_b)
        if w is None:
            const = self.w2_rate if w2 else eta
            return torch.full(u.shape[:-1], const, dtype=u.dtype, device=u.device)
        logit = u @ w.to(u.dtype) + b.to(u.dtype)
        r = torch.sigmoid(W2_GATE_GAIN * logit) if w2 else eta * torch.sigmoid(logit)
        return copy_to_tp_region(r)  # used on this rank's slice: sum the gradient over ranks

    @torch.compiler.disable  # an outer torch.compile would unroll the loop over periods
    def forward_updating(
        self,
        u: torch.Tensor,
        eta: float,
        teach: torch.Tensor | None = None,
        record: list | None = None,
    ) -> torch.Tensor:
        """Output with in-context updates at every multiple of ``period``; ``u`` [B, S, d].

        The error of token ``t`` is ``f(u_t) - u_{t+1}`` (association), or ``teach[:, t]`` when
        given (the outer loss's signal). The updated weights are kept in factored form,
        ``W_13 = W_13^0 - sum r D^T X`` and ``W_2 = W_2^0 - sum r E^T A`` over the tokens seen so
        far (``r`` the per-token rate and clip, folded into ``D`` and ``E``), and applied as
        ``x W^T = x W_0^T - (x X^T) D`` (the dual form), so no per-sequence weight copy is built;
        the factors are folded into materialised per-sequence weights once ``d_model`` tokens
        have accumulated (a *window*), which bounds the dual form's cost per token.
        """
        seq, c, d = u.shape[1], self.period, u.shape[-1]
        tp = get_tensor_model_parallel_world_size() > 1
        ul = copy_to_tp_region(u)
        w13, w2 = self.w13.weight, self.w2.weight  # shared [2h, d], [d, h] until materialised
        h = w2.shape[-1]
        # per-token quantities of the whole sequence in one pass each, split into periods (one
        # backward concatenation, not a zero-filled full-size gradient per slice)
        rate = self.rates(u, eta)
        x_sq = ul.square().sum(-1)
        r13_all = (rate / x_sq.clamp_min(NORM_EPS)).split(c, dim=1)  # W_13: rate / ||u_t||^2
        if self.step_norm == "split":
            rate = self.rates(u, eta, w2=True)
        r2_all = rate.split(c, dim=1)
        xsq_all = (x_sq / d).split(c, dim=1)
        if teach is None:
            err_all = u[:, 1:].split(c, dim=1)  # association targets u_{t+1}
        else:
            teach = teach.to(u.dtype)
            err_all = teach.split(c, dim=1)  # the error itself
        window = -(-d // c) * c  # tokens between folds
        outs = []
        for w0 in range(0, seq, window):
            xw = ul[:, w0 : w0 + window]
            gv_all = (xw @ w13.mT).split(c, dim=1)  # x W_13^T of the window, one matmul
            if teach is not None:  # the error is known: e W_2 of the window in one matmul too
                ew2_all = (teach[:, w0 : w0 + window] @ w2).split(c, dim=1)
            # x_t X^T for every later period of the window: one product, rows split per period
            last = (xw.shape[1] - 1) // c * c  # where the window's last period starts
            if last:
                xx_all = (xw[:, c:] @ xw[:, :last].mT).split(c, dim=1)
            pieces: list[torch.Tensor] = []  # per period [B, c, 2h + h + d]: D | A | E
            for j, gv in enumerate(gv_all):
                p = w0 // c + j
                end = min((p + 1) * c, seq)
                if j:
                    fac = torch.cat(pieces, dim=1) if j > 1 else pieces[0]
                    dp, ap, ep = fac.split((2 * h, h, d), dim=-1)
                    gv = torch.baddbmm(gv, xx_all[j - 1][..., : j * c], dp, alpha=-1)
                g, v = gv.chunk(2, dim=-1)
                sig = torch.sigmoid(g)
                sg = g * sig  # silu(g)
                a = sg * v
                o = a @ w2.mT
                if j:
                    o = torch.baddbmm(o, a @ ap.mT, ep, alpha=-1)
                out = reduce_from_tp_region(o)
                outs.append(out)
                if end >= seq:
                    break
                if teach is None:
                    e = copy_to_tp_region(out - err_all[p])
                    da = e @ w2
                else:
                    e, da = err_all[p], ew2_all[j]
                if j:
                    da = torch.baddbmm(da, e @ ep.mT, ap, alpha=-1)
                # silu'(g) = sig (1 + g (1 - sig)) = sig + silu(g) (1 - sig)
                dgv = torch.cat([da * (v * torch.addcmul(sig, sg, 1 - sig)), da * sg], dim=-1)
                # per token: the gradient's norm (||d x^T|| = ||d|| ||x||) clipped to sqrt(d), the
                # rate, and each step divided by a squared input norm (hope.step_norm, module doc)
                a_sq, dgv_sq = a.square().sum(-1), dgv.square().sum(-1)
                if tp:  # full norms on every rank; the copy sums their rank-local gradients
                    a_sq, dgv_sq = copy_to_tp_region(
                        reduce_from_tp_region(torch.stack((a_sq, dgv_sq)))
                    ).unbind(0)
                clip = torch.addcmul(dgv_sq * xsq_all[p], a_sq, e.square().sum(-1), value=1 / d)
                clip = clip.clamp_min(1.0).rsqrt()
                step13 = clip * r13_all[p]
                if self.step_norm == "input":
                    e2 = e * step13[..., None]
                elif self.step_norm == "own":
                    e2 = e * (clip * r2_all[p] / (a_sq + NORM_EPS))[..., None]
                else:  # split: W_2's own rate over ||a_t||^2 + the period's mean ||a||^2
                    a_sq_mean = a_sq.mean(1, keepdim=True)
                    e2 = e * (clip * r2_all[p] / (a_sq + a_sq_mean + NORM_EPS))[..., None]
                pieces.append(torch.cat([dgv * step13[..., None], a, e2], -1))
                if record is not None and bool(
                    pieces[-1][..., : 2 * h].abs().amax() + pieces[-1][..., 3 * h :].abs().amax()
                    > 0
                ):
                    record.append(end)
                if (j + 1) * c >= window:  # fold the window's factors into the weights
                    fac = torch.cat(pieces, dim=1) if j else pieces[0]
                    dp, ap, ep = fac.split((2 * h, h, d), dim=-1)
                    w13 = w13 - dp.mT @ xw
                    w2 = w2 - ep.mT @ ap
        return torch.cat(outs, dim=1)


class ContinuumMemory(MLPSlot):
    """The CMS MLP slot of layer ``layer``: ``forward(u [B, S, d]) -> sum_i f_i(u_{i-1})``.

    With ``hope.update = teach`` the levels learn from ``self.teach_signal`` [B, S, d], which
    :func:`teach_pass` sets before the model's forward (without it the chain is static).
    ``record_updates = True`` makes each forward store, per level, the token positions at which
    that level's weights were updated (``self.last_updates``), for tests and diagnostics.
    """

    def __init__(self, cfg, layer: int, d_ff: int | None = None) -> None:
        super().__init__(cfg, layer)
        h = cfg.model.hope
        plan = cfg.taper_plan
        d_ff = plan.widths[layer] if d_ff is None else d_ff
        self.widths = level_widths(d_ff, h.levels, plan.unit)
        self.eta = h.lr
        self.update = h.update
        self.levels = nn.ModuleList(
            CMSLevel(cfg, layer, w, p) for w, p in zip(self.widths, h.periods)
        )
        self.teach_signal: torch.Tensor | None = None
        self.record_updates = False
        self.last_updates: list[list[int]] = []

    @classmethod
    def counts(cls, cfg, layer: int, dtype_bytes: int = 2, d_ff: int | None = None) -> Counts:
        """Full-model params (``3 d d_ff(l)`` plus ``d + 1`` per learned rate gate), forward
        FLOPs/token, activation bytes."""
        m, h = cfg.model, cfg.model.hope
        d = m.d_model
        d_ff = cfg.taper_plan.widths[layer] if d_ff is None else d_ff
        widths = level_widths(d_ff, h.levels, cfg.taper_plan.unit)
        total = Counts(0, 0.0, 0.0)
        for w, period in zip(widths, h.periods):
            base = SwiGLU.counts(cfg, layer, dtype_bytes, d_ff=w)
            if period > 0 and h.lr > 0:
                # per token: e W2 (d w); in a window of win = min(s, L) tokens (L: d rounded up
                # to whole periods) the dual form over n ~ (win - C) / 2 held factor tokens,
                # G D, a A^T E, e E^T A (n (2d + 4w)), and x X^T for the window ((win - C)^2 d
                # per window); the fold into weights (3 d w per token of a folded window, every
                # window but the last); kept: D, E, clip scale (2w + d + 1), the three n-wide
                # products, the folded per-sequence weights; a learned rate: d + 1 params, d MACs
                s, win_full = m.seq_len, -(-d // period) * period
                win = min(s, win_full)
                n = (win - period) / 2
                folded = (s - 1) // win_full * win_full / s  # share of tokens in folded windows
                macs = (
                    d * w + 3 * d * w * folded + n * (2 * d + 4 * w) + (win - period) ** 2 * d / win
                )
                elems = 2 * w + d + 1 + 3 * n + 3 * w
                gates = (1 + (h.step_norm == "split")) if h.rate == "learned" else 0
                gate = gates * (d + 1)
                base = base + Counts(gate, 2.0 * (macs + gate), (elems + 1) * dtype_bytes)
            total = total + base
        return total

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        teach = self.teach_signal if self.update == "teach" else None
        if teach is not None and teach.shape != u.shape:
            raise RuntimeError(
                f"hope teach signal of shape {tuple(teach.shape)} for input {tuple(u.shape)}: "
                "it is set by teach_pass(model, input_ids) for this very input"
            )
        active = self.update == "association" or teach is not None
        total = None
        self.last_updates = []
        for level in self.levels:
            rec: list[int] = []
            if level.updating and active:
                o = level.forward_updating(u, self.eta, teach, rec if self.record_updates else None)
            else:
                o = level(u)
            self.last_updates.append(rec)
            u = u + o
            total = o if total is None else total + o
        return total


@torch.no_grad()
def teach_pass(model: nn.Module, input_ids: torch.Tensor) -> None:
    """First pass of ``hope.update = teach``: run ``model`` with static CMS levels, take the
    per-token gradient of the next-token cross-entropy w.r.t. the normalised final hidden state
    (``(softmax - one_hot(next id)) W_head``, zero at the last position, divided by the RMS
    entry of ``W_head``) and hand it to every :class:`ContinuumMemory` as its teach signal."""
    cms = [m for m in model.modules() if isinstance(m, ContinuumMemory)]
    for c in cms:
        c.teach_signal = None
    h = model.embedding(input_ids)
    for block in model.layers:
        h = block(h)
    head = model.head
    target = F.pad(input_ids[:, 1:], (0, 1))
    mask = torch.ones(input_ids.shape, device=h.device)
    mask[:, -1] = 0
    weight = head.proj.weight.detach()
    with torch.enable_grad():
        x = head.norm(h).detach().requires_grad_()
        loss = vocab_parallel_linear_cross_entropy_mean(copy_to_tp_region(x), weight, target, mask)
        (grad,) = torch.autograd.grad(loss, x)
    ms = reduce_from_tp_region(weight.float().pow(2).sum())
    ms = ms / (weight.numel() * get_tensor_model_parallel_world_size())
    signal = grad * (mask.sum() * torch.rsqrt(ms)).to(grad.dtype)
    for c in cms:
        c.teach_signal = signal


def _first_pass(model: nn.Module, input_ids: torch.Tensor) -> None:
    """The record's first pass: :func:`teach_pass` when ``hope.update = teach``."""
    if model.cfg.model.hope.update == "teach":
        teach_pass(model, input_ids)


register_architecture(
    Architecture(
        "hope_attention",
        Attention,
        ContinuumMemory,
        HopeOptions,
        "hope",
        validate=_validate,
        compiles=True,  # the CMS period loop stays eager (torch.compiler.disable)
        first_pass=_first_pass,
    )
)
