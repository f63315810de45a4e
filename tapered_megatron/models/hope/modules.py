"""Hope-attention's Continuum Memory System (CMS) as modules: :class:`CMSLevel` (one SwiGLU
level with an update period), :class:`ContinuumMemory` (the chain, ``hope_attention``'s MLP
slot) and the teach signal's first pass (options and record:
:mod:`tapered_megatron.architectures.hope`).

A ``hope_attention`` block is causal softmax attention followed by a chain of ``K`` SwiGLU
levels, residual inside the chain; level ``i`` changes its weights inside the sequence only at
multiples of its period ``C_i`` (the paper's CMS rule ``W <- W - sum_{t in period} eta_t
grad l_t(W)``, kernel: :mod:`.window`)::

    u_0 = norm(z),  u_i = u_{i-1} + f_i(u_{i-1}),  CMS(u_0) = u_K - u_0 = sum_i f_i(u_{i-1})
    association (default):  l_t(W) = 1/2 ||f_i(u_t; W) - u_{t+1}||^2
    teach:                  the error of token t is (softmax(z_t) - one_hot(x_{t+1})) W_head
    learned rate:           eta_t = hope.lr sigmoid(u_t w_i + b_i),  W_13's step eta_t / ||u_t||^2

The level widths split the layer's ``d_ff(l)`` in rounding units (:func:`level_widths`), so the
CMS has the ``3 d d_ff(l)`` parameters of the SwiGLU it replaces (plus ``d + 1`` per rate gate):
tapered and uniform stay budget-equal, and ``K = 1`` with period 0 is the SwiGLU MLP. Updating
levels compute in fp32 whatever the autocast dtype (their per-sequence weights accumulate small
updates). Every level's hidden width is split over TP ranks; the updates need the full level
output, which the row-parallel all-reduce already provides. Design, choices and measurements:
docs/memory_architectures.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.autocast import autocast_dtype, autocast_off
from tapered_megatron.models.base import Counts, MLPSlot
from tapered_megatron.models.hope.window import (
    NORM_EPS,
    _UpcastLinear,
    _UpdatingWindow,
    _WindowSpec,
    fold_window,
    held_products,
    window_backward_elems,
    window_macs,
)
from tapered_megatron.models.mlp import SwiGLU
from tapered_megatron.parallel import (
    copy_to_tp_region,
    get_tensor_model_parallel_world_size,
    reduce_from_tp_region,
    vocab_parallel_linear_cross_entropy_mean,
)

W2_GATE_GAIN = 10.0  # split: W_2's gate is sigmoid(gain (u w + b)), so it can open in few steps


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


class CMSLevel(SwiGLU):
    """One level of the chain: a SwiGLU of width ``d_ff`` with an update period (0: never).

    ``forward`` is the plain SwiGLU (static weights); :meth:`forward_updating` adds the in-context
    updates. An updating level with ``hope.rate = learned`` owns its rate gate ``rate_w`` [d],
    ``rate_b`` [1] (replicated over TP ranks), and with ``hope.step_norm = split`` also ``W_2``'s
    gate ``w2_rate_w``, ``w2_rate_b``. It runs on the whole sequence (its updates need it).
    """

    takes_sequence_shards = False

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
        # accumulate small updates over thousands of tokens, which bf16 rounds away (the
        # targets are cast per window, by _replayed)
        dtype = torch.float64 if u.dtype == torch.float64 else torch.float32
        xs, r13, r2, xsq = (t.to(dtype) for t in (ul, r13, r2, x_sq / d))
        w2 = self.w2.weight  # cast by the first window (the weights are kept in their dtype)
        out_dtype = autocast_dtype(u) or u.dtype
        window = fold_window(d, w2.shape[-1] * get_tensor_model_parallel_world_size(), c, seq)
        outs, factors = [], []  # the windows' outputs, W_13 factors D
        with autocast_off(u.device):
            gv_all = _UpcastLinear.apply(xs, self.w13.weight)  # x W_13^T, the whole sequence
            for w0 in range(0, seq, window):
                # x W_13^T with the earlier windows' W_13 updates in dual form:
                # x W_13^T - (x X^T) D over each earlier window's inputs X and factors D (one
                # product per window: autograd keeps the factors the windows made, no copy)
                win = slice(w0, w0 + window)
                gv = gv_all[:, win]
                if w0 == 0 and window < seq and self.recomputing:
                    gv = gv.clone()  # the recompute keeps its input: a view keeps all of gv_all
                for k, fac_d in enumerate(factors):
                    held = xs[:, k * window : (k + 1) * window]
                    gv = torch.baddbmm(gv, xs[:, win] @ held.mT, fac_d, alpha=-1)
                spec = _WindowSpec(
                    period=c,
                    step_norm=self.step_norm,
                    teach=teach is not None,
                    final=w0 + window >= seq,
                    tp=get_tensor_model_parallel_world_size() > 1,
                    start=w0,
                    record=record,
                )
                res = self.recomputed(
                    _replayed(spec), xs[:, win], gv, w2, tgt[:, win], r13[:, win], r2[:, win],
                    xsq[:, win],
                )  # fmt: skip
                if spec.final:
                    out = res
                else:
                    out, fac_d, w2 = res
                    factors.append(fac_d)
                outs.append(out)
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return y.to(out_dtype)


def _replayed(spec: _WindowSpec) -> Callable[..., Any]:
    """:class:`_UpdatingWindow` of ``spec`` as a function that selective recompute may run
    twice: the run in backward records no update positions (the first one did). It takes the
    association targets in the activations' dtype and casts them to the window's inputs' (the
    recompute keeps the targets it was given, not an fp32 copy)."""
    quiet, runs = replace(spec, record=None), []

    def window(xw: torch.Tensor, gv: torch.Tensor, w2: torch.Tensor, tgt: torch.Tensor,
               *rest: torch.Tensor) -> Any:  # fmt: skip
        runs.append(None)
        return _UpdatingWindow.apply(
            spec if len(runs) == 1 else quiet, xw, gv, w2, tgt.to(xw.dtype), *rest
        )

    return window


class ContinuumMemory(MLPSlot):
    """The CMS MLP slot of layer ``layer``: ``forward(u [B, S, d]) -> sum_i f_i(u_{i-1})``.

    With ``hope.update = teach`` the levels learn from ``self.teach_signal`` [B, S, d], which
    :func:`teach_pass` sets before the model's forward (without it the chain is static).
    ``in_context = False`` makes every level static (its learned weights for the whole sequence;
    the memory probe, :func:`tapered_megatron.models.base.in_context_memory`).
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
        self.in_context = True
        self.record_updates = False
        self.last_updates: list[list[int]] = []

    @classmethod
    def counts(cls, cfg, layer: int, dtype_bytes: int = 2, d_ff: int | None = None) -> Counts:
        """Full-model params (``3 d d_ff(l)`` plus ``d + 1`` per learned rate gate), forward
        FLOPs/token, activation bytes: the sum of :meth:`level_counts`."""
        total = Counts(0, 0.0, 0.0)
        for c in cls.level_counts(cfg, layer, dtype_bytes, d_ff):
            total = total + c
        return total

    @classmethod
    def level_counts(
        cls, cfg, layer: int, dtype_bytes: int = 2, d_ff: int | None = None
    ) -> list[Counts]:
        """:meth:`counts` of each level, in the chain's order."""
        m, h = cfg.model, cfg.model.hope
        d = m.d_model
        d_ff = cfg.taper_plan.widths[layer] if d_ff is None else d_ff
        widths = level_widths(d_ff, h.levels, cfg.taper_plan.unit)
        out = []
        for i, (w, period) in enumerate(zip(widths, h.periods)):
            base = SwiGLU.counts(cfg, layer, dtype_bytes, d_ff=w)
            # a later level's input u_{i-1} (d) is every TP rank's whole (the first's is the
            # half's input)
            whole = d * (i > 0) * dtype_bytes
            if period > 0 and h.lr > 0:
                gates = (1 + (h.step_norm == "split")) if h.rate == "learned" else 0
                gate, s = gates * (d + 1), m.seq_len
                if s > period:  # else the level runs static
                    # per token: window_macs (e W_2, x X^T, the dual form, the folds) at the
                    # window forward_updating picks, the gates' d MACs. Kept, in fp32 (fp64)
                    # whatever the activation dtype (_UpdatingWindow): the pre-activation, its
                    # gradient factor and D (2w each), A and e W_2 (w each), the materialised
                    # per-sequence W_2 (d w per sequence per fold); over d or tokens only, whole
                    # on every TP rank: the level input's fp32 copy (below fp32), the error and
                    # E (2d), norms and rates (5), the windows' dual-form products
                    # (held_products) and x X^T over earlier windows
                    win = fold_window(d, w, period, s)
                    folds = -(-s // win) - 1
                    macs = window_macs(d, w, period, s, win) + gate
                    inner = held_products(period, s, win)
                    cross = sum(min(win, s - w0) * w0 for w0 in range(0, s, win)) / s
                    tokens = 5 + inner + cross
                    f = max(4, dtype_bytes)
                    rep = f * (d * (dtype_bytes < f) + 2 * d + tokens)
                    act = d * dtype_bytes + f * (8 * w + folds * d * w / s) + rep
                    whole += rep
                    # selective recompute runs each window again in backward: its inputs (the
                    # window, its pre-activation, W_2, rates, norms) and the factors D later
                    # windows multiply stay; the rest of what it keeps goes
                    core_whole = f * (2 * d + inner)
                    core = f * (4 * w + 2 * w / (folds + 1)) + core_whole
                    base = Counts(
                        base.params + gate, base.flops + 2.0 * macs, act,
                        core_bytes=core, core_flops=2.0 * (macs - gate),
                        core_replicated=core_whole,
                    )  # fmt: skip
                else:
                    base = base + Counts(gate, 0.0, 0.0)
            out.append(replace(base, act_replicated=float(whole)))
        return out

    @classmethod
    def recomputed_core(cls, cfg, layer: int, dtype_bytes: int, tp: int) -> float:
        """Selective recompute re-runs one window of one updating level at a time: the
        largest window's share of its level's core."""
        m, h = cfg.model, cfg.model.hope
        widths = level_widths(cfg.taper_plan.widths[layer], h.levels, cfg.taper_plan.unit)
        most = 0.0
        for c, w, period in zip(cls.level_counts(cfg, layer, dtype_bytes), widths, h.periods):
            if c.core_bytes:  # an updating level
                share = min(fold_window(m.d_model, w, period, m.seq_len), m.seq_len) / m.seq_len
                most = max(most, share * c.local_core(tp))
        return most

    @classmethod
    def backward_peaks(
        cls, cfg, layer: int, dtype_bytes: int, batch: int, tp: int, saved: float
    ) -> list[tuple[float, float]]:
        """One moment per level, its backward's end: a static level's as
        :class:`~tapered_megatron.models.mlp.SwiGLU`'s; an updating level's its largest window's
        (:func:`window_backward_elems`) beside, in fp32 (fp64 stays fp64), the gradient of the
        level's output and, where the level runs more than one window, those its windows' slices
        are summed into: of its input, the association targets (the teach signal has none:
        counted alike), the pre-activations and the rates and norms (``2 d + 2 h + 3`` per
        token); and the chain's input gradient in the activations' dtype. The levels run
        backward last first: by a level's moment the levels after it have freed what they
        saved (their :meth:`level_counts` share of ``saved``). Every gradient counted made."""
        m, h = cfg.model, cfg.model.hope
        d, s = m.d_model, m.seq_len
        widths = level_widths(cfg.taper_plan.widths[layer], h.levels, cfg.taper_plan.unit)
        acts = [c.act_bytes for c in cls.level_counts(cfg, layer, dtype_bytes)]
        f = max(4, dtype_bytes)
        out = []
        for i, (w, c) in enumerate(zip(widths, h.periods)):
            freed = saved * sum(acts[i + 1 :]) / sum(acts)
            if not (c > 0 and h.lr > 0 and s > c):
                static = SwiGLU.backward_peaks(cfg, layer, dtype_bytes, batch, tp, saved, d_ff=w)
                out.append((max(b for b, _ in static) - freed, 1.0))
                continue
            win, hl = fold_window(d, w, c, s), w / tp
            starts = range(0, s, win)
            windows = [
                window_backward_elems(d, hl, c, min(win, s - w0), w0 + win >= s, w0 == 0, tp > 1)
                for w0 in starts
            ]
            glue = s * (d + (2 * d + 2 * hl + 3) * (len(starts) > 1))
            held = max(f * (batch * (e + glue) + once) for e, once in windows)
            out.append((held + batch * s * d * dtype_bytes - freed, 1.0))
        return out

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        teach = self.teach_signal if self.update == "teach" else None
        if teach is not None and teach.shape != u.shape:
            raise RuntimeError(
                f"hope teach signal of shape {tuple(teach.shape)} for input {tuple(u.shape)}: "
                "it is set by teach_pass(model, input_ids) for this very input"
            )
        active = self.in_context and (self.update == "association" or teach is not None)
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
        x = head.proj.enter(head.norm(h)).detach().requires_grad_()  # the whole sequence
        loss = vocab_parallel_linear_cross_entropy_mean(copy_to_tp_region(x), weight, target, mask)
        (grad,) = torch.autograd.grad(loss, x)
    ms = reduce_from_tp_region(weight.float().pow(2).sum())
    ms = ms / (weight.numel() * get_tensor_model_parallel_world_size())
    signal = grad * (mask.sum() * torch.rsqrt(ms)).to(grad.dtype)
    for c in cms:
        c.teach_signal = signal


def first_pass(model: nn.Module, input_ids: torch.Tensor) -> None:
    """The record's first pass: :func:`teach_pass` when ``hope.update = teach``."""
    if model.cfg.model.hope.update == "teach":
        teach_pass(model, input_ids)
