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
  level adds a rate gate of ``d + 1`` parameters (below; 0.03 % of the level at d 1024), the same
  in every layer, so tapered and uniform still differ by exactly ``3 d`` times the width
  deviation. With ``K = 1`` and period 0 the slot *is* the SwiGLU MLP.
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
  (Behrouz et al. 2025), with ``w_i ~ normal(0, init_std)`` and ``b_i = logit(hope.rate_init)``.
  ``constant``: ``eta = hope.lr / d_model`` for every token. ``W_13``'s step is divided by the
  squared norm of the level's input ``||u_t||^2``; the inputs are RMS-normalised, so
  ``||u||^2 ~ d_model`` and ``hope.lr * sigmoid(.)`` is the effective step on a repeated input
  (the fraction of the error on that input one update removes, for a linear level).
* ``hope.step_norm``, what divides ``W_2``'s step (its input is the hidden activation ``a_t``,
  not normalised, and small at init). The two choices trade language modelling against fast
  in-context binding; measured, not derived:
  ``input`` (default): ``||u_t||^2`` as for ``W_13``. At the ``tlm_cpu`` reproduction scale
  (hope_attention, uniform, seed 1234, validation loss after 120 of 320 iterations) the defaults
  ``lr 0.1``, ``rate_init 0.1`` (an effective step of 0.01 at init that the gate can raise to
  0.1) reach 5.08, against 5.41 with no in-context updates (``hope.lr 0``), 5.18 with a constant
  0.01, 5.48 with ``lr 1`` / ``rate_init 0.5``; the transformer 5.10. But the updates of a fresh
  model are tiny (tests/test_memory_in_context.py) and the associative-recall benchmark
  (scripts/bench_memory_recall.py, 300 steps) stays at chance (0.014; 0.12 with ``lr 1`` /
  ``rate_init 0.5``).
  ``own``: ``||a_t||^2``, i.e. each matrix a normalised-LMS step on its own input: one token's
  ``W_2`` step removes the given fraction of its error. With ``lr 1`` / ``rate_init 0.5`` the
  recall benchmark reaches 0.999, but summed over a period these steps overshoot in language
  modelling: at ``tlm_cpu`` training stalled at validation loss 6.07 (perplexity 430; 4.62 for
  the transformer), and every rate tried (0.01 to 0.5) was worse than no updates (5.45-6.08 vs
  5.41 after 120 iterations).
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
  they are folded into per-sequence weights once ``d_model`` tokens have accumulated, which
  bounds the per-token cost. ``x W_13^T`` for every token is one matmul before the period loop
  (redone for the rest of the sequence after a fold), so the loop only adds the dual-form
  corrections and ``W_2``. Building per-sequence weight copies every period instead was 25x
  slower than a static level on CPU (elementwise passes over ``B x 3 d w`` per period).
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
from tapered_megatron.models.layers import silu_grad
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


@dataclass(frozen=True)
class HopeOptions:
    """``model.hope``: hope_attention's Continuum Memory System (tlm-spec.md section 5.4)."""

    levels: int = at_least(1, 3)  # K MLP levels in the chain
    periods: tuple[int, ...] = at_least(0, (0, 64, 16))  # update period per level; 0 = never
    lr: float = at_least(0.0, 0.1)  # inner-loop rate scale (effective step on a repeated input)
    rate: Literal["learned", "constant"] = "learned"  # learned: sigmoid of a map of the input
    rate_init: float = 0.1  # learned rate: initial sigmoid value (gate bias logit(rate_init))
    update: Literal["association", "teach"] = "association"  # next position | outer-loss signal
    # what divides W_2's step: the level input's squared norm, or its own input's (module doc)
    step_norm: Literal["input", "own"] = "input"


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
    if not 0 < h.rate_init < 1:
        raise ConfigError(f"model.hope.rate_init: {h.rate_init} must lie in (0, 1)")
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


class CMSLevel(SwiGLU):
    """One level of the chain: a SwiGLU of width ``d_ff`` with an update period (0: never).

    ``forward`` is the plain SwiGLU (static weights); :meth:`forward_updating` adds the in-context
    updates. An updating level with ``hope.rate = learned`` owns its rate gate ``rate_w`` [d],
    ``rate_b`` [1] (replicated over TP ranks).
    """

    def __init__(self, cfg, layer: int, d_ff: int, period: int) -> None:
        super().__init__(cfg, layer, d_ff=d_ff)
        m, h = cfg.model, cfg.model.hope
        self.period = period
        self.updating = period > 0 and h.lr > 0
        self.own_norm = h.step_norm == "own"
        self.rate_w = self.rate_b = None
        if self.updating and h.rate == "learned":
            self.rate_w = nn.Parameter(torch.empty(m.d_model))
            self.rate_w.init_std = m.init_std
            self.rate_b = nn.Parameter(torch.full((1,), _logit(h.rate_init)))

    def rates(self, u: torch.Tensor, eta: float) -> torch.Tensor:
        """Per-token step sizes [B, S]: ``eta * sigmoid(u w + b)`` (learned) or ``eta``."""
        if self.rate_w is None:
            return torch.full(u.shape[:-1], eta, dtype=u.dtype, device=u.device)
        r = eta * torch.sigmoid(u @ self.rate_w.to(u.dtype) + self.rate_b.to(u.dtype))
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
        have accumulated, which bounds the dual form's cost per token.
        """
        seq, c, d = u.shape[1], self.period, u.shape[-1]
        ul = copy_to_tp_region(u)
        w13, w2 = self.w13.weight, self.w2.weight  # shared [2h, d], [d, h] until materialised
        # per-period pieces by split (one backward concatenation, not a zero-filled full-size
        # gradient per slice); x W_13^T for every token is one matmul
        xs_all = ul.split(c, dim=1)
        x_sq_all = ul.pow(2).sum(-1).split(c, dim=1)
        rate_all = self.rates(u, eta).split(c, dim=1)
        if teach is None:
            err_all = u[:, 1:].split(c, dim=1)  # association targets u_{t+1}
        else:
            err_all = teach.to(u.dtype).split(c, dim=1)  # the error itself
        gv_all, gv_from = (ul @ w13.mT).split(c, dim=1), 0
        xs: list[torch.Tensor] = []  # factors: X, D (for W_13) and A, E (for W_2)
        ds: list[torch.Tensor] = []
        as_: list[torch.Tensor] = []
        es: list[torch.Tensor] = []
        outs = []
        for p, x in enumerate(xs_all):
            end = min((p + 1) * c, seq)
            gv = gv_all[p - gv_from]
            if xs:
                xp, dp, ap, ep = (torch.cat(f, dim=1) for f in (xs, ds, as_, es))
                gv = gv - (x @ xp.mT) @ dp
            g, v = gv.chunk(2, dim=-1)
            a = F.silu(g) * v
            o = a @ w2.mT
            if xs:
                o = o - (a @ ap.mT) @ ep
            out = reduce_from_tp_region(o)
            outs.append(out)
            if end >= seq:
                break
            e = err_all[p]
            e = copy_to_tp_region(out - e) if teach is None else e
            da = e @ w2
            if xs:
                da = da - (e @ ep.mT) @ ap
            dgv = torch.cat([da * v * silu_grad(g), da * F.silu(g)], dim=-1)
            # per token: the gradient's norm (||d x^T|| = ||d|| ||x||) clipped to sqrt(d), the
            # rate, and each step divided by a squared input norm (hope.step_norm, module doc)
            # (full norms on every rank; the copy sums their rank-local gradients in backward)
            a_sq, dgv_sq = copy_to_tp_region(
                reduce_from_tp_region(torch.stack((a.pow(2).sum(-1), dgv.pow(2).sum(-1))))
            ).unbind(0)
            x_sq = x_sq_all[p]
            clip = torch.rsqrt(((a_sq * e.pow(2).sum(-1) + dgv_sq * x_sq) / d).clamp_min(1.0))
            step = clip * rate_all[p]
            xs.append(x)
            step13 = step / x_sq.clamp_min(NORM_EPS)
            step2 = step / (a_sq + NORM_EPS) if self.own_norm else step13
            ds.append(dgv * step13[..., None])
            as_.append(a)
            es.append(e * step2[..., None])
            if record is not None and bool(ds[-1].abs().amax() + es[-1].abs().amax() > 0):
                record.append(end)
            if sum(f.shape[1] for f in xs) >= d:
                xp, dp, ap, ep = (torch.cat(f, dim=1) for f in (xs, ds, as_, es))
                w13 = w13 - dp.mT @ xp
                w2 = w2 - ep.mT @ ap
                xs, ds, as_, es = [], [], [], []
                # the rest of the sequence with the folded weights
                gv_all, gv_from = (ul[:, end:] @ w13.mT).split(c, dim=1), p + 1
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
                # dual form over n ~ min(s, d)/2 held factor tokens: x X^T D, a A^T E, e E^T A
                # (n (3d + 4w)), e W2 (d w) and the fold into weights every d tokens (3 d w);
                # kept: D, E, clip scale (2w + d + 1), the three n-wide products, the folded
                # per-sequence weights (3 d w per d tokens); a learned rate: d + 1 params, d MACs
                n = min(m.seq_len, d) / 2
                macs = 4 * d * w + n * (3 * d + 4 * w)
                elems = 2 * w + d + 1 + 3 * n + 3 * w
                gate = d + 1 if h.rate == "learned" else 0
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
