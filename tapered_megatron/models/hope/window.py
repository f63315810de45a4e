"""The kernel of an updating CMS level: one fold window of in-context updates with its
hand-written backward (:class:`_UpdatingWindow`), and the choice of the window's length
(:func:`fold_window`, costed by :func:`window_macs`).

A level ``f(u) = W_2 (silu(g) * v)``, ``[g | v] = W_13 u``, with period ``c`` takes at every
multiple of ``c`` the sum of the last period's inner gradient steps, all taken at the
period-start weights. With ``a_t`` the hidden activation, ``e_t`` the output error
(association: ``f(u_t) - u_{t+1}``; teach: the given signal) and ``d_t`` its backprop to
``[g | v]``, each token's step is::

    W_13 <- W_13 - s13_t d_t u_t^T,   s13_t = clip_t r13_t,   r13_t = eta_t / ||u_t||^2
    W_2  <- W_2  - s2_t  e_t a_t^T,   s2_t  = clip_t r2_t / den_t
    clip_t = rsqrt(max(1, (||d_t||^2 ||u_t||^2 + ||e_t||^2 ||a_t||^2) / d))

``den_t`` follows ``hope.step_norm``: ``input``, ``W_2`` steps as ``W_13`` (``s2 = s13``);
``own``, ``||a_t||^2`` with ``W_13``'s rate as ``r2_t``; ``split`` (default), ``||a_t||^2``
plus the period's mean ``||a||^2``, with ``W_2``'s own gate as ``r2_t``. The accumulated
updates are kept as factors, ``W_13 = W^0 - sum D^T X`` and ``W_2 = W^0 - sum E^T A``, and
applied in dual form (``x W^T = x W_0^T - (x X^T) D``), so no per-sequence weight copy is built
per period; ``W_2``'s factors are folded into per-sequence weights at the end of every window,
which bounds the dual form's cost per token. The backward runs the periods in reverse and
equals autograd's gradients of the same forward, second-order terms included (the outer loop
learns through the updates). Design and measurements: docs/memory_architectures.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.autograd.function import once_differentiable

from tapered_megatron.parallel import reduce_from_tp_region

NORM_EPS = 1e-2  # added to a squared input norm before it divides a step (module doc)
# choosing a level's fold window, a fold is costed as if its window had at least this many
# tokens: folds of short windows are slower than their FLOPs say (calibration:
# docs/memory_architectures.md)
FOLD_DEPTH = 160


@lru_cache(maxsize=1024)  # the cost model asks for every unit of every layout
def fold_window(d: int, h: int, c: int, seq: int) -> int:
    """Tokens per window of a level of width ``h`` (all TP ranks) and period ``c`` over a
    sequence of ``seq``: the whole number of periods with the fewest multiply-adds per token
    (:func:`window_macs`), each fold costed at a depth of at least ``FOLD_DEPTH`` tokens; ties
    go to the longer window."""
    counts = range(1, -(-seq // c) + 1)
    best = min(counts, key=lambda k: (window_macs(d, h, c, seq, k * c, FOLD_DEPTH), -k))
    return best * c


@lru_cache(maxsize=4096)  # as fold_window: asked per level of every unit costed
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


@lru_cache(maxsize=4096)
def held_products(c: int, seq: int, window: int) -> float:
    """Elements per token of the dual-form products a window of a level of period ``c`` keeps
    for backward, over a sequence of ``seq`` in windows of ``window`` tokens: per window of
    ``n`` tokens ``x X^T`` over its later periods (``(n - c) (P - 1) c``, ``P`` its periods)
    and, per period ``j > 0``, ``a A^T`` and ``e E^T`` over the ``j c`` held tokens."""
    total = 0
    for w0 in range(0, seq, window):
        n = min(window, seq - w0)
        periods = -(-n // c)
        total += max(n - c, 0) * (periods - 1) * c
        total += sum(2 * min(c, n - j * c) * j * c for j in range(1, periods))
    return total / seq


def window_backward_elems(
    d: int, h: int, c: int, n: int, final: bool, first: bool, tp: bool
) -> tuple[float, float]:
    """Elements :class:`_UpdatingWindow`'s backward holds at its peak (its end) beyond what its
    forward saved, for a window of ``n`` tokens of a level of width ``h`` (this rank's) and
    period ``c``: per sequence, and once for the batch (the window-start ``W_2``, shared by the
    sequences in the ``first`` window). Per token the gradient buffers of ``D``, ``E``, ``A``,
    the pre-activations, ``e W_2``, the output, the input and the association targets
    (``4 d + 5 h``; the teach signal takes no gradient: counted alike), silu's chain-rule
    terms (``5 h``) and the per-token scalars (norms, rates, step scales and their gradients:
    at most 16); the ``x X^T`` gradient; the last periods' temporaries (the first period's
    update, with ``tp`` its all-reduced error gradient; the second's products, and where that
    one updated, its concatenated factors); unless ``final``, the gradients of the factors
    ``D`` and the folded ``W_2`` the later windows gave it; ``W_2``'s gradient: two products
    and their sum, per sequence, or once beside the weight's cast, and in a final window (its
    last period makes no update) the update tokens' error and activation gradients copied to
    multiply them."""
    periods = -(-n // c)
    last = (periods - 1) * c
    per_seq = n * (4 * d + 11 * h + 16) + (n - c) * last
    if periods > 1 or not final:
        per_seq += c * (d * (1 + tp) + 3 * h)
    if periods > 1:
        per_seq += c * c
    if periods > 1 + final:
        per_seq += 2 * c * (d + h) + 5 * c * c
    if not final:
        per_seq += n * 2 * h + d * h
    if not first:
        return per_seq + 3 * d * h, 0.0
    if final:
        per_seq += last * (d + h)
    return per_seq, 4.0 * d * h


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


class _UpcastLinear(torch.autograd.Function):
    """``x w^T`` with the weight ``w`` cast to ``x``'s dtype for the product, keeping ``w`` in its
    own dtype for backward, which casts it again (exact), instead of a wider copy per forward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.to(x.dtype).mT

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w.to(dy.dtype) if ctx.needs_input_grad[0] else None
        dw = _wgrad(dy, x, True) if ctx.needs_input_grad[1] else None
        return dx, dw


class _UpdatingWindow(torch.autograd.Function):
    """One window of :meth:`CMSLevel.forward_updating`: its periods' outputs and, unless it is
    the final window, its ``W_13`` factors ``D`` [B, L, 2h] (later windows apply them in dual
    form) and the per-sequence ``W_2`` with its factors folded in.

    Inputs: the window's level inputs ``xw`` [B, L, d], their pre-activations ``gv`` [B, L, 2h]
    under the window-start ``W_13`` (``x W_13^T`` with the earlier windows' updates), the
    window-start ``w2`` ([d, h] shared, in the parameter's dtype, or [B, d, h] per sequence; kept
    for backward in its own dtype and cast to the window's again there), the targets
    (association: ``u_{t+1}``; teach: the signal), per-token ``W_13`` / ``W_2`` rates ``r13``,
    ``r2`` [B, L] and ``||x||^2 / d``. The factors live in preallocated window buffers (no
    concatenation); the backward runs the periods in reverse, recomputing the elementwise
    chain from the saved pre-activations, products and norms, and accumulates the factors'
    gradients in buffers; it gives autograd's gradients of the same forward, second-order
    terms included (tests/test_hope.py compares them in fp64).
    """

    @staticmethod
    def forward(ctx, spec, xw, gv, w2_own, tgt, r13, r2, xsq):
        w2 = w2_own.to(xw.dtype)
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
        # the held products too go through save_for_backward (never a ctx attribute): a
        # checkpoint around the window (recompute) drops only what its saved-tensor hooks see
        ctx.spec, ctx.tgt_len = spec, tgt.shape[1]
        ctx.save_for_backward(
            xw, w2_own, r13, r2, xsq, gv0, dgvs, fac_d, fac_a, fac_e, errs, das, norms, xx,
            *(t for pair in held for t in pair),
        )  # fmt: skip
        if spec.final:
            return out
        return out, fac_d, w2 - fac_e.mT @ fac_a  # W_2 folded

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dfac_d=None, dw2n=None):
        spec = ctx.spec
        xw, w2, r13, r2, xsq, gvs, dgv, fac_d, fac_a, fac_e, errs, das, norms, xx, *flat = (
            ctx.saved_tensors
        )
        held = list(zip(flat[::2], flat[1::2], strict=True))  # per period: (a A^T, e E^T)
        w2 = w2.to(xw.dtype)  # exact: the forward's cast again
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
