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
  0.118, its loss only leaving chance level by step 300) (session 4 of issue 14); whether the
  gate opens within 300 steps depends on the seed and on float rounding (the same rule with
  the hand-written window backward, equal to fp64 round-off: 1 of 6 seeds, see
  docs/BENCHMARKS.md). Without the gain the gate does not open from 1e-4 or 1e-5 within 300
  steps (recall at chance; language modelling 5.151, 5.119); started at 1e-3 it opens (recall
  1.0) but language modelling suffers (5.153; with the period's sum as the divisor and 0.01:
  5.193). At d_model 1024 the
  gain also widens the gate's spread over tokens at init (logit std ~6 there, ~2 at d 128);
  not measured at that scale.
  ``hope.w2_gate_spread`` (default 0: the weights' ``init_std``) raises the init std of the
  gate's weights so that its logit spreads over tokens with at least that std
  (:func:`w2_gate_std`). On the recall benchmark (d 64, where ``init_std`` gives 1.6) 4.8
  lets the gate open on keys and queries while it stays nearly shut on filler, and the task is
  learnt within 300 steps on 5 of 6 seeds (recall 0.999-1.0; the default: 1 of 6). At the
  ``tlm_cpu`` scale the same spread costs language modelling 0.47 and 0.30 nats (5.546 and
  5.391 against 5.075 and 5.087, seeds 1234 and 1235), still 0.32 after all 320 iterations
  (4.968 against 4.643, seed 1234); with ``w2_rate_init 1e-7`` beside it 0.09 and 0.06 after
  120 (5.168, 5.143), but recall then came on 1 of 3 seeds. Recall reliability and language
  modelling pull this gate's init in opposite directions at these widths, so the default keeps
  ``init_std``. A faster gate is not the answer either: gain 20 with the weights' std halved
  (the same gate at init, twice the logit's Adam step) learnt recall on 2 of 6 seeds, language
  modelling 5.088 and 5.074 (issue 14, sessions 7-8).
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
  ``W_2``'s are folded into per-sequence weights at the end of every *window* of whole
  periods, which bounds the per-token cost; the window is the one with the fewest multiply-adds
  per token (:func:`window_macs`, each fold costed as at least ``FOLD_DEPTH`` tokens deep; at
  the library shape, d 256, periods 64 and 16, seq 256: 128 tokens; at d 1024, period 64, seq
  1024: 256). ``W_13`` is only applied to the level's inputs ``X``, known in advance, so it is
  never folded: per window, ``x W_13^T`` (shared weights) minus the earlier windows' updates
  ``(x X^T) D`` and ``x_t X^T`` for every later period are a few matmuls before the period loop
  (with ``teach``, so is ``e W_2``), so the loop only adds the in-window dual-form corrections
  and ``W_2``; the factors live in preallocated window buffers. Each window is one autograd
  function with a hand-written backward (:class:`_UpdatingWindow`: the periods in reverse, the
  chain rule's elementwise factors computed for the whole window at once, the factors'
  gradients accumulated in place, each weight's gradient one product per window), exact to
  autograd's gradients of the same forward (fp64 gradcheck in tests). Building per-sequence
  weight copies every period instead was 25x slower than a static level on CPU (elementwise
  passes over ``B x 3 d w`` per period).
* Precision: an updating level computes in fp32 whatever the autocast dtype (fp64 inputs stay
  fp64) and returns the autocast dtype: its per-sequence weights accumulate small updates over
  thousands of tokens. With ``W_2``'s gates half open, the CMS output at 4096 tokens under bf16
  autocast was 1.3-1.5 % off fp64 when the levels ran in bf16 (at d_model 128; where the updates
  moved the output by only 2 %, that is most of their effect) and is 0.3 % off in fp32
  (tests/test_hope.py). Static levels follow autocast.
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
from torch.autograd.function import once_differentiable

from tapered_megatron.autocast import autocast_dtype, autocast_off
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
# choosing a level's fold window, a fold is costed as if its window had at least this many
# tokens: folds of short windows were slower than their FLOPs say. Calibrated on one CPU thread
# (issue 14, session 5): at the library shape (d 256, seq 256, periods 64 and 16, batch 8)
# windows of 128 tokens were the fastest (64: 1.1-1.2x its time, 16: 1.7x, 256: 1.0-1.2x; with
# W_13 in dual form across windows: 64 and 256 1.0-1.16x); at d 1024, seq 1024, period 64,
# batch 1, 128 tokens took 1.12x the time of 256 (256 to 1024: within 3 %). 160 picks 128 and
# 256 there.
FOLD_DEPTH = 160


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
    # split: the least init std over tokens of W_2's gate logit (gain x (u w' + b')); 0 keeps
    # the weights' init_std (recall vs language modelling: module doc)
    w2_gate_spread: float = at_least(0.0, 0.0)


def _validate(cfg: Config) -> None:
    """One period per level; the narrowest layer splits into that many rounding units; a
    learned rate's initial value lies in (0, 1); ``w2_gate_spread`` needs ``W_2``'s gate;
    ``teach`` needs the whole model (no pipeline)."""
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
    if h.w2_gate_spread and (h.step_norm != "split" or h.rate != "learned"):
        raise ConfigError(
            f"model.hope.w2_gate_spread: {h.w2_gate_spread} sets W_2's own gate, which exists "
            "only with model.hope.step_norm split and model.hope.rate learned; drop it or use both"
        )
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


def w2_gate_std(init_std: float, d_model: int, spread: float) -> float:
    """Init std of ``W_2``'s gate weights ``w'``: ``init_std``, raised where needed so that the
    gate's logit ``W2_GATE_GAIN (u w' + b')`` on an RMS-normalised input (``||u||^2 ~ d_model``)
    spreads over tokens with a std of at least ``spread`` (``hope.w2_gate_spread``)."""
    return max(init_std, spread / (W2_GATE_GAIN * math.sqrt(d_model)))


def fold_window(d: int, h: int, c: int, seq: int) -> int:
    """Tokens per window of a level of width ``h`` (all TP ranks) and period ``c`` over a
    sequence of ``seq``: the whole number of periods with the fewest multiply-adds per token
    (:func:`window_macs`), each fold costed at a depth of at least ``FOLD_DEPTH`` tokens; ties
    go to the longer window."""
    counts = range(1, -(-seq // c) + 1)
    best = min(counts, key=lambda k: (window_macs(d, h, c, seq, k * c, FOLD_DEPTH), -k))
    return best * c


def window_macs(d: int, h: int, c: int, seq: int, window: int, fold_depth: int = 0) -> float:
    """Forward multiply-adds per token of an updating level of width ``h`` and period ``c``
    beyond its static ``3 d h``, with windows of ``window`` tokens over a sequence of ``seq``:
    ``e W_2`` (``d h``; the error's ``W_2`` product), per window ``x X^T`` over its later periods
    (``(L - c) (L - c) d``, ``L`` the window's length), the dual-form corrections of period ``j``
    over the ``j c`` held tokens (``c j c (2 h + 2 (h + d))``: ``G D``, ``a A^T E``,
    ``e E^T A``), the earlier windows' ``W_13`` updates in dual form (``L s (d + 2 h)`` for a
    window starting at ``s``: ``(x X^T) D``) and the fold of ``W_2`` at the end of every window
    but the last (``d h L``; with ``fold_depth``, ``d h max(L, fold_depth)``)."""
    total = 0.0
    for w0 in range(0, seq, window):
        n = min(window, seq - w0)
        total += max(n - c, 0) * ((n - 1) // c * c) * d + n * w0 * (d + 2 * h)
        for j in range(1, -(-n // c)):
            total += min(c, n - j * c) * j * c * (2 * h + 2 * (h + d))
        if w0 + window < seq:
            total += d * h * max(n, fold_depth)
    return d * h + total / seq


@dataclass(frozen=True, eq=False)
class _WindowSpec:
    """What one :class:`_UpdatingWindow` does besides its tensors."""

    period: int
    step_norm: str
    teach: bool  # the error is the given signal (else: the association error f(u_t) - u_{t+1})
    final: bool  # the window ends the sequence: its last period makes no update, no fold
    tp: bool  # tensor parallel: all-reduce the output and the norms (and their gradients)
    start: int  # the window's first position in the sequence (for ``record``)
    record: list | None  # positions at which the level's weights change are appended here


def _scales(
    norm: str,
    a_sq: torch.Tensor,
    g_sq: torch.Tensor,
    e_sq: torch.Tensor,
    xsq: torch.Tensor,
    r13: torch.Tensor,
    r2: torch.Tensor,
    d: int,
    c: int,
) -> tuple[torch.Tensor, ...]:
    """Per token of a period [B, c]: the squared inner-gradient norm over ``d`` (``q``), its
    clip ``rsqrt(max(q, 1))``, ``W_13``'s and ``W_2``'s step scales and ``W_2``'s divisor
    (``None`` with ``step_norm input``, whose ``W_2`` step is ``W_13``'s)."""
    q = torch.addcmul(g_sq * xsq, a_sq, e_sq, value=1 / d)
    clip = q.clamp_min(1.0).rsqrt()
    s13 = clip * r13
    if norm == "input":
        return q, clip, s13, s13, None
    if norm == "own":
        den = a_sq + NORM_EPS
    else:  # split: plus the mean over each period of c tokens
        mean = a_sq.unflatten(1, (-1, c)).mean(-1, keepdim=True)
        den = (a_sq.unflatten(1, (-1, c)) + mean).flatten(1) + NORM_EPS
    return q, clip, s13, clip * r2 / den, den


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """Squared norms over the last dimension, one pass."""
    return torch.linalg.vector_norm(x, dim=-1).square()


def _wgrad(dy: torch.Tensor, x: torch.Tensor, shared: bool) -> torch.Tensor:
    """``dy^T x`` for ``dy`` [B, L, m], ``x`` [B, L, k]: ``[m, k]`` summed over the batch for a
    shared weight, ``[B, m, k]`` for per-sequence weights."""
    return dy.flatten(0, 1).mT @ x.flatten(0, 1) if shared else dy.mT @ x


class _UpdatingWindow(torch.autograd.Function):
    """One window of :meth:`CMSLevel.forward_updating`: its periods' outputs and, unless it is
    the final window, its ``W_13`` factors ``D`` [B, L, 2h] (later windows apply them in dual
    form) and the per-sequence ``W_2`` with its factors folded in.

    Inputs: the window's level inputs ``xw`` [B, L, d], their pre-activations ``gv`` [B, L, 2h]
    under the window-start ``W_13`` (``x W_13^T`` with the earlier windows' updates), the
    window-start ``w2`` ([d, h] shared or [B, d, h] per sequence), the targets
    (association: ``u_{t+1}``; teach: the signal), per-token ``W_13`` / ``W_2`` rates ``r13``,
    ``r2`` [B, L] and ``||x||^2 / d``. The factors live in preallocated window buffers (no
    concatenation); the backward runs the periods in reverse, recomputing the elementwise
    chain from the saved pre-activations, products and norms, and accumulates the factors'
    gradients in buffers; it gives autograd's gradients of the same forward, second-order
    terms included (tests/test_hope.py compares them in fp64).
    """

    @staticmethod
    def forward(ctx, spec, xw, gv, w2, tgt, r13, r2, xsq):
        bsz, n, d = xw.shape
        h, c = w2.shape[-1], spec.period
        periods = -(-n // c)
        last = (periods - 1) * c  # where the window's last period starts
        gv0 = gv.clone(memory_format=torch.contiguous_format)  # corrected in place below
        # x_t X^T for every later period of the window: one product, rows split per period
        xx = xw[:, c:] @ xw[:, :last].mT if last else None
        ew2 = tgt @ w2 if spec.teach else None  # the error is known: e W_2 in one matmul
        # window buffers; rows of a final period without update stay unset and are never read
        fac_d, fac_a, fac_e = (
            gv0.new_empty(gv0.shape),
            xw.new_empty(bsz, n, h),
            xw.new_empty(xw.shape),
        )
        out, errs, das = torch.empty_like(xw), torch.empty_like(xw), torch.empty_like(fac_a)
        dgvs, norms = torch.empty_like(gv0), xw.new_empty(2, bsz, n)
        held = []  # per period: a A^T and e E^T over the held factors (dual form)
        # the buffers split into their periods once (views); gv0 is corrected in place and
        # ends as the pre-activations
        bufs = [gv0, fac_a, out, errs, das, dgvs, norms[0], norms[1], fac_d, fac_e, xsq, r13, r2]
        parts = [x.split(c, dim=1) for x in bufs]
        for j in range(periods):
            gv, a, oj, e, da, dgv, a_sq, g_sq, dj, ej, xsqj, r13j, r2j = (x[j] for x in parts)
            s, t = j * c, min((j + 1) * c, n)
            if j:
                gv.baddbmm_(xx[:, s - c : t - c, :s], fac_d[:, :s], alpha=-1)
            g, v = gv.chunk(2, dim=-1)
            sig = torch.sigmoid(g)
            sg = g * sig  # silu(g)
            torch.mul(sg, v, out=a)
            o = a @ w2.mT
            qa = pe = None
            if j:
                qa = a @ fac_a[:, :s].mT
                o = torch.baddbmm(o, qa, fac_e[:, :s], alpha=-1)
            o = reduce_from_tp_region(o)
            oj.copy_(o)
            if spec.final and j == periods - 1:
                held.append((qa, pe))
                break
            if spec.teach:
                e.copy_(tgt[:, s:t])
                da.copy_(ew2[:, s:t])
            else:
                torch.sub(o, tgt[:, s:t], out=e)
                da.copy_(e @ w2)  # (matmul with a strided out= is not reliable)
            if j:
                pe = e @ fac_e[:, :s].mT
                da.baddbmm_(pe, fac_a[:, :s], alpha=-1)
            held.append((qa, pe))
            # silu'(g) = sig (1 + g (1 - sig)) = sig + silu(g) (1 - sig)
            torch.mul(da * v, torch.addcmul(sig, sg, 1 - sig), out=dgv[..., :h])
            torch.mul(da, sg, out=dgv[..., h:])
            # per token: the gradient's norm (||d x^T|| = ||d|| ||x||) clipped to sqrt(d), the
            # rate, and each step divided by a squared input norm (hope.step_norm, module doc)
            if spec.tp:  # full norms on every rank
                nrm = reduce_from_tp_region(torch.stack((_sq_norm(a), _sq_norm(dgv))))
                a_sq.copy_(nrm[0])
                g_sq.copy_(nrm[1])
            else:
                torch.linalg.vector_norm(a, dim=-1, out=a_sq).square_()
                torch.linalg.vector_norm(dgv, dim=-1, out=g_sq).square_()
            _, _, s13, s2, _ = _scales(
                spec.step_norm, a_sq, g_sq, _sq_norm(e), xsqj, r13j, r2j, d, c
            )
            torch.mul(dgv, s13[..., None], out=dj)
            torch.mul(e, s2[..., None], out=ej)
            if spec.record is not None and bool(dj.abs().amax() + ej.abs().amax() > 0):
                spec.record.append(spec.start + t)
        ctx.spec, ctx.held, ctx.tgt_len = spec, held, tgt.shape[1]
        ctx.save_for_backward(
            xw, w2, r13, r2, xsq, gv0, dgvs, fac_d, fac_a, fac_e, errs, das, norms, xx
        )
        if spec.final:
            return out
        return out, fac_d, w2 - fac_e.mT @ fac_a  # W_2 folded

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dfac_d=None, dw2n=None):
        spec, held = ctx.spec, ctx.held
        xw, w2, r13, r2, xsq, gvs, dgv, fac_d, fac_a, fac_e, errs, das, norms, xx = (
            ctx.saved_tensors
        )
        bsz, n, d = xw.shape
        h, c = w2.shape[-1], spec.period
        periods = -(-n // c)
        last = (periods - 1) * c
        m = last if spec.final else n  # tokens whose period makes an update (whole periods)
        shared, assoc = w2.dim() == 2, not spec.teach
        # gradients of the factor buffers, completed period by period from the last one; D's
        # starts from what later windows' dual form gave it
        d_d = torch.zeros_like(fac_d) if dfac_d is None else dfac_d.clone()
        if dw2n is None:  # else the fold W_2' = W_2 - E^T A
            d_e, d_a = torch.zeros_like(fac_e), torch.zeros_like(fac_a)
        else:
            d_e = torch.baddbmm(fac_e, fac_a, dw2n.mT, beta=0, alpha=-1)
            d_a = torch.baddbmm(fac_a, fac_e, dw2n, beta=0, alpha=-1)
        dgvs, ddas = torch.empty_like(gvs), torch.empty_like(das)
        dgvs[:, m:].zero_()  # the periods with an update write theirs before adding to them
        dos = dout.clone(memory_format=torch.contiguous_format)
        dxx = torch.zeros_like(xx) if xx is not None else None
        dr13, dr2, dxsq = torch.zeros_like(r13), torch.zeros_like(r2), torch.zeros_like(xsq)
        dtgt = None
        if assoc:
            dtgt = xw.new_empty(bsz, ctx.tgt_len, d)
            dtgt[:, m:].zero_()
        # what the periods' chain rule needs, for the whole window at once: silu(g), silu'(g),
        # v silu'(g), v silu''(g) (silu'' = sig (1 - sig) (2 + g (1 - 2 sig))), and per token
        # the step scales' partial derivatives
        g, v = gvs.chunk(2, dim=-1)
        sig = torch.sigmoid(g)
        sg = g * sig
        sp = torch.addcmul(sig, sg, 1 - sig)
        vsp = v * sp
        v2 = v * sig * (1 - sig) * torch.addcmul(torch.full_like(g, 2.0), g, 1 - 2 * sig)
        e, da, dgv = errs[:, :m], das[:, :m], dgv[:, :m]
        a_sq, g_sq, e_sq = norms[0, :, :m], norms[1, :, :m], _sq_norm(e)
        q, clip, s13, s2, den = _scales(
            spec.step_norm, a_sq, g_sq, e_sq, xsq[:, :m], r13[:, :m], r2[:, :m], d, c
        )
        dclip_dq = torch.where(q >= 1.0, -0.5 * clip.pow(3), 0.0)  # rsqrt(max(q, 1))'
        upd = [e, da, dgv, d_d, d_e, ddas, r13, clip, dclip_dq, xsq, g_sq, e_sq / d, 2 / d * a_sq]
        upd += [s13[..., None], s2[..., None], dr13, dr2, dxsq, dtgt]
        upd += [] if den is None else [r2[:, :m] / den, clip / den, -s2 / den]
        # every buffer split into its periods once (views); the update's over the first m tokens
        every = [x.split(c, dim=1) for x in (fac_a, d_a, dos, v, sg, sp, vsp, v2, dgvs)]
        upd = [x[:, :m].split(c, dim=1) if x is not None else None for x in upd]
        for j in reversed(range(periods)):
            s, t = j * c, min((j + 1) * c, n)
            a, dact, do, vj, sgj, spj, vspj, v2j, dgv_j = (x[j] for x in every)
            qa, pe = held[j]
            if t <= m:  # the period's update
                ej, daj, dgvj, dd_j, de_j, ddaj, r13j, clipj, dqj, xsqj, gsqj, esqj, asqj, *rest = (
                    x[j] if x is not None else None for x in upd
                )
                s13j, s2j, dr13j, dr2j, dxsqj, dtgtj, *ratios = rest
                ds2, ds13 = (de_j * ej).sum(-1), (dd_j * dgvj).sum(-1)
                if den is None:  # input: W_2's step is W_13's
                    ds13 = ds13 + ds2
                    dclip, da_sq = ds13 * r13j, None
                else:
                    r2_den, clip_den, s2_den = ratios
                    dclip = torch.addcmul(ds13 * r13j, ds2, r2_den)
                    torch.mul(ds2, clip_den, out=dr2j)
                    da_sq = ds2 * s2_den
                    if spec.step_norm == "split":  # the period's mean ||a||^2 in every divisor
                        da_sq = da_sq + da_sq.mean(1, keepdim=True)
                torch.mul(ds13, clipj, out=dr13j)
                dq = dqj * dclip
                dg_sq = dq * xsqj
                torch.mul(dq, gsqj, out=dxsqj)
                da_sq = dq * esqj if da_sq is None else torch.addcmul(da_sq, dq, esqj)
                if spec.tp:  # the norms' gradients summed over ranks, as their copy does
                    da_sq, dg_sq = reduce_from_tp_region(torch.stack((da_sq, dg_sq))).unbind(0)
                ddgv = torch.addcmul(dd_j * s13j, dgvj, 2 * dg_sq[..., None])
                dact.addcmul_(a, 2 * da_sq[..., None])
                ddg, ddv = ddgv.chunk(2, dim=-1)
                # dgv = [da v silu'(g), da silu(g)]: the parts of dg and dv through dgv
                dda = torch.addcmul(ddg * vspj, ddv, sgj, out=ddaj)
                dgg = ddg * daj
                torch.addcmul(ddv * daj * spj, dgg, v2j, out=dgv_j[..., :h])
                torch.mul(dgg, spj, out=dgv_j[..., h:])
                if j:  # da = e W_2 - (e E^T) A
                    dp = dda @ fac_a[:, :s].mT  # minus the gradient of e E^T
                if assoc:  # e = o - u_{t+1}: its gradient reaches the output and the target
                    de = torch.addcmul(de_j * s2j, ej, (dq * asqj)[..., None])
                    de += dda @ w2.mT
                    if j:
                        de.baddbmm_(dp, fac_e[:, :s], alpha=-1)
                    de = reduce_from_tp_region(de) if spec.tp else de
                    do += de
                    torch.neg(de, out=dtgtj)
            # o = a W_2^T - (a A^T) E
            dact += do @ w2
            if j:
                dqa = do @ fac_e[:, :s].mT  # minus the gradient of a A^T
                dact.baddbmm_(dqa, fac_a[:, :s], alpha=-1)
                # minus the held factors' gradients: both products' terms in one each
                ga, xa, ge, xe = dqa, a, qa, do
                if t <= m:
                    ga, xa = torch.cat([pe, dqa], dim=1), torch.cat([dda, a], dim=1)
                    ge, xe = torch.cat([dp, qa], dim=1), torch.cat([ej, do], dim=1)
                d_a[:, :s].baddbmm_(ga.mT, xa, alpha=-1)
                d_e[:, :s].baddbmm_(ge.mT, xe, alpha=-1)
            # a = silu(g) v
            dgv_j[..., :h].addcmul_(dact * vj, spj)
            dgv_j[..., h:].addcmul_(dact, sgj)
            if j:  # gv = x W_13^T - (x X^T) D
                torch.bmm(dgv_j, fac_d[:, :s].mT, out=dxx[:, s - c : t - c, :s])
                d_d[:, :s].baddbmm_(xx[:, s - c : t - c, :s].mT, dgv_j, alpha=-1)
        dxw = None
        if xx is not None:  # dxx holds -d(x X^T)
            dxw = torch.zeros_like(xw)
            dxw[:, c:].baddbmm_(dxx, xw[:, :last], alpha=-1)
            dxw[:, :last].baddbmm_(dxx.mT, xw[:, c:], alpha=-1)
        dw2 = _wgrad(dos, fac_a, shared) + _wgrad(errs[:, :m], ddas[:, :m], shared)
        if dw2n is not None:
            dw2 = dw2 + (dw2n.sum(0) if shared else dw2n)
        return None, dxw, dgvs, dw2, dtgt, dr13, dr2, dxsq


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
                std = w2_gate_std(m.init_std, m.d_model, h.w2_gate_spread)
                self.w2_rate_w, self.w2_rate_b = _gate(m.d_model, std, h.w2_rate_init, W2_GATE_GAIN)

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
        ``W_2``'s factors are folded into materialised per-sequence weights at the end of every
        *window* of :func:`fold_window` tokens, which bounds the dual form's cost per token;
        ``W_13``'s stay in dual form across windows (it only meets the level's inputs ``X``, so
        each window's ``x W_13^T`` is a few matmuls before its period loop). Each window is one
        :class:`_UpdatingWindow` (hand-written backward).
        """
        seq, c, d = u.shape[1], self.period, u.shape[-1]
        if seq <= c:  # no boundary inside the sequence: the static level
            return self(u)
        ul = copy_to_tp_region(u)
        # per-token quantities of the whole sequence, each in one pass
        rate = self.rates(u, eta)
        x_sq = ul.square().sum(-1)
        r13 = rate / x_sq.clamp_min(NORM_EPS)  # W_13: rate / ||u_t||^2
        r2 = self.rates(u, eta, w2=True) if self.step_norm == "split" else rate
        tgt = u[:, 1:] if teach is None else teach.to(u.dtype)  # association targets u_{t+1}
        # in fp32 whatever the autocast dtype (fp64 stays fp64): the per-sequence weights
        # accumulate small updates over thousands of tokens, which bf16 rounds away
        dtype = torch.float64 if u.dtype == torch.float64 else torch.float32
        ops = (ul, self.w13.weight, self.w2.weight, tgt, r13, r2, x_sq / d)
        xs, w13, w2, tgt, r13, r2, xsq = (t.to(dtype) for t in ops)
        out_dtype = autocast_dtype(u) or u.dtype
        window = fold_window(d, w2.shape[-1] * get_tensor_model_parallel_world_size(), c, seq)
        outs, factors = [], []  # the windows' outputs, W_13 factors D
        with autocast_off(u.device):
            for w0 in range(0, seq, window):
                # x W_13^T with the earlier windows' W_13 updates in dual form:
                # x W_13^T - (x X^T) D over the earlier windows' inputs X and factors D
                win = slice(w0, w0 + window)
                gv = xs[:, win] @ w13.mT
                if w0:
                    fac_d = factors[0] if len(factors) == 1 else torch.cat(factors, dim=1)
                    gv = torch.baddbmm(gv, xs[:, win] @ xs[:, :w0].mT, fac_d, alpha=-1)
                spec = _WindowSpec(
                    period=c,
                    step_norm=self.step_norm,
                    teach=teach is not None,
                    final=w0 + window >= seq,
                    tp=get_tensor_model_parallel_world_size() > 1,
                    start=w0,
                    record=record,
                )
                res = _UpdatingWindow.apply(
                    spec, xs[:, win], gv, w2, tgt[:, win], r13[:, win], r2[:, win], xsq[:, win]
                )
                if spec.final:
                    out = res
                else:
                    out, fac_d, w2 = res
                    factors.append(fac_d)
                outs.append(out)
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return y.to(out_dtype)


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
                gates = (1 + (h.step_norm == "split")) if h.rate == "learned" else 0
                gate, s, macs, elems = gates * (d + 1), m.seq_len, 0.0, 0.0
                if s > period:  # else the level runs static
                    # per token: window_macs (e W_2, x X^T, the dual form, the folds) at the
                    # window forward_updating picks, the gates' d MACs; kept: the corrected
                    # pre-activation, D, A, E, the error and its W_2 product (2w + 2w + w + d +
                    # d + w), norms, rates (5), x X^T and the two held dual-form products
                    # (about 2 (L - c) per token in a window of L), x X^T over earlier windows
                    win = fold_window(d, w, period, s)
                    macs = window_macs(d, w, period, s, win) + gate
                    cross = sum(min(win, s - w0) * w0 for w0 in range(0, s, win)) / s
                    elems = 6 * w + 2 * d + 5 + 2 * (min(win, s) - period) + cross
                base = base + Counts(gate, 2.0 * macs, elems * dtype_bytes)
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


def _first_pass_config(cfg: Config) -> Config | None:
    """What the teach signal's first pass costs: a forward of the same model with static CMS
    levels (the config without in-context updates); None under ``association``."""
    if cfg.model.hope.update != "teach":
        return None
    return cfg.with_overrides(["--model.hope.update", "association", "--model.hope.lr", "0"])


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
        first_pass_config=_first_pass_config,
    )
)
