"""The Titans memory's kernel: the per-head memory MLP trained inside the sequence and read out
at every token, chunk-parallel, as one autograd node with a hand-written backward.

Per head, a memory MLP ``M`` (depth ``L >= 2``, no biases, ``W_L silu(... silu(W_1 k))``) is
trained on the fly with the associative loss ``loss_t = ||M_{t-1}(k_t) - v_t||^2``::

    S_t = eta_t S_{t-1} - theta_t grad loss_t          (surprise with momentum)
    M_t = (1 - alpha_t) M_{t-1} + S_t                  (forgetting)
    y_t = M_t(q_t)                                     (read-out)

Inside a chunk of ``b`` tokens the gradients are taken w.r.t. the chunk-start weights ``M_0``
(the paper's mini-batch approximation; exact at ``b = 1``), written as an explicit backward pass
through the memory MLP, so every per-token gradient is an outer product ``delta_i a_i^T`` per
layer. Unrolling the two linear recurrences inside the chunk gives, for every token ``t``::

    M_t = B_t M_0 + P_t S_0 - sum_{i<=t} c_{t,i} delta_i a_i^T
    B_t = prod_{j<=t}(1-alpha_j),  E_t = prod_{j<=t} eta_j,  P_t = sum_{s<=t} (B_t/B_s) E_s
    c_{t,i} = theta_i sum_{s=i..t} (B_t/B_s)(E_s/E_i)

(ratios formed as differences of cumulative log-gates, masked before ``exp``). The read-out
never materialises ``M_t``: layer by layer ``M_t x_t = B_t M_0 x_t + P_t S_0 x_t - sum_i c_{t,i}
delta_i (a_i . x_t)``, two weight matmuls plus a causally masked ``b x b`` product over the
chunk's gradient factors (the dual form of TTT). At the chunk end ``M`` and ``S`` are
materialised and carried to the next chunk; the loop over chunks is the scan.

Each token's step is ``theta_t`` times its gradient, or with ``normalized`` (NLMS,
``model.titans.normalized_step``) divided by the memory's curvature along its error plus
``NLMS_EPS`` (:func:`_step_scales`), and then clipped to Frobenius norm ``max_norm`` over all
layers (``MAX_GRAD_NORM`` unless ``model.titans.memory_clip`` says otherwise; 0: no clip; free
here: ``||delta a^T|| = ||delta|| ||a||``). The state
and every product of the scan are fp32 (fp64 for fp64 inputs) whatever the activation dtype:
the state accumulates small decays and updates over thousands of tokens. The backward
(:class:`_Scan`) walks the chunks in reverse and carries the state's gradient by hand, which
saves autograd's bookkeeping of many state-sized tensors, and with ``backprop_chunks``
(``model.titans.backprop_chunks``) cuts that gradient at every block of so many chunks; with
``compiled`` each chunk step is one compiled graph and the loop stays eager. Design and choices:
docs/memory_architectures.md; timings: docs/BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from tapered_megatron.models.layers import silu_parts

MAX_GRAD_NORM = 1.0  # per-token clip of the memory gradient (Frobenius, all layers)
NLMS_EPS = 0.5  # the normalised step's regulariser: its scale is 1 / (rho + NLMS_EPS)


@dataclass
class MemoryState:
    """The memory between chunks: per layer the weights ``M`` and momentum ``S`` stacked,
    ``[B or 1, H, 2, out_l, in_l]`` (index 0: ``M``, 1: ``S``), in fp32 (fp64 for fp64 inputs).
    Stacked so that the chunk-end update of both is one batched matmul (:func:`_chunk_forward`)."""

    layers: list[torch.Tensor]

    @property
    def weights(self) -> list[torch.Tensor]:
        """``M`` per layer, ``[B or 1, H, out_l, in_l]``."""
        return [x[:, :, 0] for x in self.layers]

    @classmethod
    def initial(cls, weights: list[torch.Tensor], dtype: torch.dtype) -> MemoryState:
        """The state at the start of a sequence: the learned weights, zero momentum."""
        return cls(
            [torch.stack((w, torch.zeros_like(w)), 1).unsqueeze(0).to(dtype) for w in weights]
        )


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def mlp_read(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``M(x)`` through fixed (per-sequence) memory weights ``[B or 1, H, out, in]``; x
    ``[B, H, n, D]``, computed in the weights' dtype with autocast off, returned in x's."""
    out_dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):
        h = x.to(weights[0].dtype)
        for i, w in enumerate(weights):
            h = h @ w.mT
            if i < len(weights) - 1:
                h = F.silu(h)
    return h.to(out_dtype)


def _chunk_coefficients(
    log_eta: torch.Tensor, log_keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Within-chunk unrolled coefficients from the log-gates [..., n_chunks, b] (module doc).

    Returns ``coef`` [..., b, b] (``c_{t,i} / theta_i``, lower triangular), ``keep`` (``B_t``),
    ``mom`` (``P_t``), ``s_keep`` (``E_b`` at the chunk end, [...]) and ``s_coef``
    (``E_b / E_i``, [..., b]).
    """
    b = log_eta.shape[-1]
    cum_b = torch.cumsum(log_keep, dim=-1)
    cum_e = torch.cumsum(log_eta, dim=-1)
    tril = torch.ones(b, b, dtype=torch.bool, device=log_eta.device).tril()
    neg_inf = torch.tensor(float("-inf"), dtype=log_eta.dtype, device=log_eta.device)
    decay = torch.exp(torch.where(tril, cum_b[..., :, None] - cum_b[..., None, :], neg_inf))
    mom_decay = torch.exp(torch.where(tril, cum_e[..., :, None] - cum_e[..., None, :], neg_inf))
    coef = decay @ mom_decay
    keep = torch.exp(cum_b)
    mom = (decay @ torch.exp(cum_e)[..., None]).squeeze(-1)
    return coef, keep, mom, torch.exp(cum_e[..., -1]), mom_decay[..., -1, :]


def _step_scales(
    sq: torch.Tensor, n: torch.Tensor, max_norm: float, normalized: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's step scale under the rule and under the clip ``[B, H, b]``; its step is
    ``theta min(rule, clip) delta a^T`` per layer (``delta a^T`` half its gradient).

    ``sq = sum_l ||a_l||^2 ||delta_l||^2`` (a quarter of the gradient's squared Frobenius norm),
    ``n = ||delta_L||^2`` (the read-out error's). Plain gradient: ``rule = 2``. Normalised
    (NLMS): ``rule = n / (sq + NLMS_EPS n) = 1 / (rho + NLMS_EPS)`` with ``rho = sq / n`` the
    Gauss-Newton curvature along the error, so that the linearised step moves the key's
    read-out toward ``v`` by at most the fraction ``theta`` of its error, whatever the memory's
    scale. The clip (``max_norm > 0``): ``max_norm / sqrt(sq)``, the gradient's Frobenius norm
    held at ``max_norm``; None without it.
    """
    if normalized:
        rule = n / (sq + NLMS_EPS * n).clamp_min(torch.finfo(sq.dtype).tiny)
    else:
        rule = torch.full_like(sq, 2.0)
    if not max_norm:
        return rule, None
    return rule, max_norm * torch.rsqrt(sq.clamp_min(torch.finfo(sq.dtype).tiny))


def _step_scale_grads(
    g_rs: torch.Tensor, sq: torch.Tensor, n: torch.Tensor, max_norm: float, normalized: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of ``sq`` and ``n`` (None: the rule does not depend on it) from the step
    scale's ``g_rs`` (:func:`_step_scales`: the clip's where it is below the rule's)."""
    rule, clip = _step_scales(sq, n, max_norm, normalized)
    zero = torch.zeros_like(sq)
    clipped = clip < rule if clip is not None else torch.zeros_like(sq, dtype=torch.bool)
    g_sq, g_n = zero, None
    if normalized:  # rule = n / D, D = sq + eps n: d/dsq = -n / D^2, d/dn = sq / D^2
        inv = 1 / (sq + NLMS_EPS * n).clamp_min(torch.finfo(sq.dtype).tiny)
        g_sq = -g_rs * rule * inv
        g_n = torch.where(clipped, zero, g_rs * sq * inv * inv)
    if clip is not None:  # where clipped: clip = max_norm sq^(-1/2), d/dsq = -clip^3 / (2 max^2)
        g_sq = torch.where(clipped, -g_rs * clip.pow(3) / (2 * max_norm**2), g_sq)
    return g_sq, g_n


def _pad_half(x: torch.Tensor) -> torch.Tensor:
    """``[x | 0]``: a gradient factor of ``M`` only, as a factor of ``[M; S]``."""
    return torch.cat((x, torch.zeros_like(x)), -1)


def _state_mix(mix: torch.Tensor) -> torch.Tensor:
    """The chunk-end state mix ``[[B_b, P_b], [0, E_b]]`` [B, H, 2, 2] from ``mix`` [B, H, 3]
    (``[M; S] <- mix [M_0; S_0]``; its transpose carries the state's gradient back)."""
    b_b, p_b, e_b = mix.unbind(-1)
    return torch.stack((b_b, p_b, torch.zeros_like(b_b), e_b), -1).unflatten(-1, (2, 2))


def _chunk_forward(
    state: list[torch.Tensor],
    kq: torch.Tensor,
    v: torch.Tensor,
    qk: torch.Tensor,
    k_sq: torch.Tensor,
    theta: torch.Tensor,
    coef: torch.Tensor,
    rates: torch.Tensor,
    ends: torch.Tensor,
    mix: torch.Tensor,
    max_norm: float = MAX_GRAD_NORM,
    normalized: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One chunk of the scan, without autograd: read-out ``M_t(q_t)`` for its tokens, the
    chunk-end state, and what :func:`_chunk_backward` needs.

    ``state``: chunk-start ``[M | S]`` per layer (:class:`MemoryState` layout); ``kq`` [B, H,
    2b, D]: the chunk's keys then its queries; ``v`` [B, H, b, D]; ``qk`` [B, H, b, b]: ``q_t .
    k_i``; ``k_sq`` and ``theta`` [B, H, b]; ``coef`` [B, H, b, b]; ``rates`` [B, H, b, 2, 1]:
    ``(B_t, P_t)``; ``ends`` [B, H, b, 2]: ``(c_{b,i}, E_b / E_i) / theta_i``; ``mix`` [B, H, 3]:
    ``(B_b, P_b, E_b)``. Few, large kernels: the first layer of the key pass and of the
    read-out through ``M_0`` and ``S_0`` is one matmul (the keys' product with ``S_0`` is
    computed and unused: cheaper than two), every layer's read-out through ``[M_0; S_0]`` is one,
    and the chunk-end ``[M | S] = mix [M_0 | S_0] - updates`` is one matmul added in place.
    """
    depth, b = len(state), v.shape[-2]
    flat = [ms.flatten(2, 3) for ms in state]  # [M_0; S_0] per layer, [B', H, 2 out, in]
    m0 = [ms[:, :, 0] for ms in state]
    out = [w.shape[-2] for w in m0]
    # keys: the key pass's first layer; queries: the read-out's first layer (through M_0, S_0)
    zk, zq = (kq @ flat[0].mT).unflatten(-1, (2, out[0])).split(b, dim=-3)
    acts, pre, dsilu = [kq[..., :b, :]], [zk[..., 0, :]], []
    for w in m0[1:]:  # the rest of the key pass
        a, ds = silu_parts(pre[-1])
        acts.append(a)
        dsilu.append(ds)
        pre.append(a @ w.mT)
    deltas = [pre[-1] - v]  # half the gradient of ||M(k) - v||^2 w.r.t. the output
    dms = []  # delta_l M_l, l >= 1 (in layer order after the reverse)
    for layer in range(depth - 1, 0, -1):
        dms.append(deltas[-1] @ m0[layer])
        deltas.append(dms[-1] * dsilu[layer - 1])
    deltas.reverse()
    dms.reverse()
    # each token's step scale (_step_scales): theta_i rs_i multiplies delta a^T
    sq = k_sq * deltas[0].pow(2).sum(-1)
    for a, d in zip(acts[1:], deltas[1:]):
        sq = sq + a.pow(2).sum(-1) * d.pow(2).sum(-1)
    rule, clip = _step_scales(sq, deltas[-1].pow(2).sum(-1), max_norm, normalized)
    rs = rule if clip is None else torch.minimum(rule, clip)
    th = theta * rs
    c = coef * th[..., None, :]
    zs, us, xsilu, scores = [zq], [], [], [qk]
    x = (zq * rates).sum(-2) - (qk * c) @ deltas[0]
    for layer in range(1, depth):
        u, ds = silu_parts(x)
        us.append(u)
        xsilu.append(ds)
        zs.append((u @ flat[layer].mT).unflatten(-1, (2, out[layer])))
        scores.append(u @ acts[layer].mT)
        x = (zs[-1] * rates).sum(-2) - (scores[-1] * c) @ deltas[layer]
    # chunk end: [M; S] = [[B_b, P_b], [0, E_b]] [M_0; S_0] - [c_b delta | (E_b/E) delta]^T a
    h = (ends * th[..., None])[..., None]
    diag, off = mix[..., 0::2, None, None], mix[..., 1, None, None]
    functional = torch.compiler.is_compiling()  # compiled: no in-place updates of views
    mat = _state_mix(mix) if functional else None
    new = []
    for ms, a, d in zip(state, acts, deltas):
        upd = (d[..., None, :] * h).flatten(-2).flatten(0, 1).mT  # [B H, 2 out, b]
        if functional:
            shape = (*mat.shape[:2], *ms.shape[2:])  # a shared state broadcasts to the batch
            nxt = (mat @ ms.flatten(3)).view(shape).flatten(0, 1).flatten(1, 2)
            nxt = torch.baddbmm(nxt, upd, a.flatten(0, 1), alpha=-1).view(shape)
        else:
            nxt = ms * diag
            nxt[:, :, 0].addcmul_(ms[:, :, 1], off)
            nxt.flatten(0, 1).flatten(1, 2).baddbmm_(upd, a.flatten(0, 1), alpha=-1)
        new.append(nxt)
    saved = [*acts[1:], *pre[:-1], *dsilu, *deltas, *dms, *zs, *us, *xsilu, *scores, sq, rs, th]
    clipped = (clip < rule).sum() if clip is not None else None
    return x, new, saved, clipped


def _chunk_backward(
    state: list[torch.Tensor],
    kq: torch.Tensor,
    k_sq: torch.Tensor,
    theta: torch.Tensor,
    coef: torch.Tensor,
    rates: torch.Tensor,
    ends: torch.Tensor,
    mix: torch.Tensor,
    saved: list[torch.Tensor],
    gy: torch.Tensor,
    g_new: list[torch.Tensor],
    max_norm: float = MAX_GRAD_NORM,
    normalized: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of one chunk of the scan (:func:`_chunk_forward`), written by hand.

    ``gy`` [B, H, b, D] and ``g_new`` (per layer, the chunk-end state's gradient, contiguous
    ``[B, H, ...]``) in; out: the chunk-start state's gradient per layer, written over
    ``g_new`` (compiled: new tensors; summed over sequences by the caller when the state is
    shared), and the gradients of ``kq, v, qk, k_sq, theta, coef, rates, ends, mix`` in that
    order.
    """
    depth = len(state)
    n1 = depth - 1
    it = iter(saved)
    acts = [kq[..., : k_sq.shape[-1], :], *(next(it) for _ in range(n1))]
    pre, dsilu = [next(it) for _ in range(n1)], [next(it) for _ in range(n1)]
    deltas, dms = [next(it) for _ in range(depth)], [None, *(next(it) for _ in range(n1))]
    zs, us = [next(it) for _ in range(depth)], [None, *(next(it) for _ in range(n1))]
    xsilu, scores = [next(it) for _ in range(n1)], [next(it) for _ in range(depth)]
    sq, rs, th = next(it), next(it), next(it)
    b = k_sq.shape[-1]
    out = [ms.shape[-2] for ms in state]
    flat = [ms.flatten(2, 3) for ms in state]
    c = coef * th[..., None, :]
    h = ends * th[..., None]  # the chunk-end update's weights (c_{b,i}, theta_i E_b / E_i)
    # the chunk end: the state mix and the updates
    g_mix, gd, ga = 0, [], []
    rows: list[list[torch.Tensor]] = [[] for _ in state]  # of the state's gradient: X^T Y
    gh = 0
    functional = torch.compiler.is_compiling()  # compiled: no in-place updates of views
    mat_t = _state_mix(mix).mT if functional else None  # [[B_b, 0], [P_b, E_b]]
    carried = []
    for ms, g, a, d, o in zip(state, g_new, acts, deltas, out):
        prods = g.flatten(3) @ ms.flatten(3).mT  # [B, H, 2, 2]: <g_r, old_c>
        g_mix = g_mix + torch.stack((prods[..., 0, 0], prods[..., 0, 1], prods[..., 1, 1]), -1)
        gf = g.flatten(2, 3)
        t = (a @ gf.mT).unflatten(-1, (2, o))  # [B, H, b, 2, out]: g_r a_i
        gd.append(-(t * h[..., None]).sum(-2))
        gh = gh - (t * d[..., None, :]).sum(-1)
        ga.append(-((d[..., None, :] * h[..., None]).flatten(-2) @ gf))
        # [g_M; g_S] <- [B_b g_M; P_b g_M + E_b g_S], eager in place (the buffer stays in cache)
        if functional:
            g = (mat_t @ g.flatten(3)).view_as(g)
        else:
            g[:, :, 1].mul_(mix[..., 2, None, None]).addcmul_(g[:, :, 0], mix[..., 1, None, None])
            g[:, :, 0].mul_(mix[..., 0, None, None])
        carried.append(g)
    # the read-out, last layer first
    g = gy
    gc = 0
    g_rates = 0
    for layer in range(n1, -1, -1):
        g_rates = g_rates + (zs[layer] * g[..., None, :]).sum(-1, keepdim=True)
        gr = (g[..., None, :] * rates).flatten(-2)  # [B, H, b, 2 out]: (B_t g, P_t g)
        gw = g @ deltas[layer].mT  # of the masked scores' product
        gd[layer] = gd[layer] - (scores[layer] * c).mT @ g
        gc = gc - gw * scores[layer]
        g_scores = gw * -c
        if layer == 0:
            g_qk, gr0 = g_scores, gr
            break
        gu = gr @ flat[layer] + g_scores @ acts[layer]
        ga[layer] = ga[layer] + g_scores.mT @ us[layer]
        rows[layer] = [gr, us[layer]]
        g = gu * xsilu[layer - 1]
    # the clip
    g_th = (gc * coef).sum(-2) + (gh * ends).sum(-1)
    g_coef = gc * th[..., None, :]
    g_ends = gh * th[..., None]
    g_theta = g_th * rs
    g_sq, g_n = _step_scale_grads(g_th * theta, sq, deltas[-1].pow(2).sum(-1), max_norm, normalized)
    g_k_sq = g_sq * deltas[0].pow(2).sum(-1)
    gd[0] = gd[0] + (2 * g_sq * k_sq)[..., None] * deltas[0]
    if g_n is not None:
        gd[n1] = gd[n1] + (2 * g_n)[..., None] * deltas[n1]
    for layer in range(1, depth):
        a, d = acts[layer], deltas[layer]
        ga[layer] = ga[layer] + (2 * g_sq * d.pow(2).sum(-1))[..., None] * a
        gd[layer] = gd[layer] + (2 * g_sq * a.pow(2).sum(-1))[..., None] * d
    # the key pass: the deltas' backprop through M_l, then the forward pass
    gp = [0] * depth
    for layer in range(1, depth):
        p, ds = pre[layer - 1], dsilu[layer - 1]
        gdm = gd[layer - 1] * ds
        gd[layer] = gd[layer] + gdm @ state[layer][:, :, 0].mT
        rows[layer] += [_pad_half(deltas[layer]), gdm]
        s = torch.sigmoid(p)  # silu''(p) = s (1 - s) (2 + p (1 - 2 s))
        gp[layer - 1] = gd[layer - 1] * dms[layer] * (s * (1 - s) * (2 + p * (1 - 2 * s)))
    gp[n1] = gp[n1] + gd[n1]
    g_v = -gd[n1]
    for layer in range(n1, 0, -1):
        rows[layer] += [_pad_half(gp[layer]), acts[layer]]
        ga[layer] = ga[layer] + gp[layer] @ state[layer][:, :, 0]
        gp[layer - 1] = gp[layer - 1] + ga[layer] * dsilu[layer - 1]
    gz = torch.cat((_pad_half(gp[0]), gr0), -2)  # [2b, 2 out]
    g_kq = gz @ flat[0]
    g_kq[..., :b, :] += ga[0]
    rows[0] = [gz, kq]
    for i, terms in enumerate(rows):  # every matmul term of the state's gradient at once
        x, y = (torch.cat(terms[j::2], -2).flatten(0, 1) for j in (0, 1))
        gs = carried[i]
        if functional:
            carried[i] = torch.baddbmm(gs.flatten(0, 1).flatten(1, 2), x.mT, y).view_as(gs)
        else:
            gs.flatten(0, 1).flatten(1, 2).baddbmm_(x.mT, y)
    return carried, [g_kq, g_v, g_qk, g_k_sq, g_theta, g_coef, g_rates, g_ends, g_mix]


class _Scan(torch.autograd.Function):
    """The loop over chunks with a hand-written backward (the state's gradient carried by hand,
    chunks in reverse order); one graph node for the whole scan.

    Inputs are per-chunk stacks (chunk axis 2, as :func:`_chunk_forward` takes them one chunk
    at a time) and the initial state's layers; outputs the read-out ``[B, H, n, b, D]`` and the
    final state's layers. The forward keeps every chunk's start state and the few per-token
    intermediates the backward needs (nothing when no input needs a gradient). Not twice
    differentiable.
    """

    @staticmethod
    def forward(
        ctx,
        compiled: bool,
        max_norm: float,
        normalized: bool,
        horizon: int,
        clipped: list | None,
        *args: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        fwd = _compiled("forward") if compiled else _chunk_forward
        per_chunk, layers = args[:9], list(args[9:])
        keep = any(ctx.needs_input_grad)
        states, ys, saved = [layers], [], []
        for chunk in zip(*(t.unbind(2) for t in per_chunk)):
            y, new, inner, n_clip = fwd(states[-1], *chunk, max_norm, normalized)
            ys.append(y)
            if keep:
                saved.extend(inner)
            if clipped is not None and n_clip is not None:  # steps the clip scaled down
                clipped.append(n_clip)
            states.append(new)
        if keep:
            kq, _, _, k_sq, theta, coef, rates, ends, mix = per_chunk
            ctx.compiled, ctx.rule, ctx.horizon = compiled, (max_norm, normalized), horizon
            ctx.sizes = (len(layers), len(saved) // len(ys))
            prior = [t for s in states[:-1] for t in s]
            ctx.save_for_backward(kq, k_sq, theta, coef, rates, ends, mix, *prior, *saved)
        return (torch.stack(ys, dim=2), *states[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: torch.Tensor, *g_layers: torch.Tensor) -> tuple[torch.Tensor | None]:
        bwd = _compiled("backward") if ctx.compiled else _chunk_backward
        depth, per = ctx.sizes
        kq, *inputs = (saved := ctx.saved_tensors)[:7]  # unpacked once (activation checkpointing)
        rest = saved[7:]
        n = kq.shape[2]
        chunks = list(zip(*(t.unbind(2) for t in (kq, *inputs))))
        grads: list[list[torch.Tensor]] = [[] for _ in range(9)]
        g_state = [g.clone(memory_format=torch.contiguous_format) for g in g_layers]
        with torch.autocast(gy.device.type, enabled=False):
            for c, g_y in zip(reversed(range(n)), reversed(gy.unbind(2))):
                state = list(rest[c * depth : (c + 1) * depth])
                inner = list(rest[n * depth + c * per : n * depth + (c + 1) * per])
                g_state, g_inputs = bwd(state, *chunks[c], inner, g_y, g_state, *ctx.rule)
                for acc, g in zip(grads, g_inputs):
                    acc.append(g)
                if ctx.horizon and c % ctx.horizon == 0 and c:  # a block start: cut here
                    for g in g_state:
                        g.zero_()
        first = rest[:depth]
        g_init = [
            g.sum(0, keepdim=True) if s.shape[0] != g.shape[0] else g
            for g, s in zip(g_state, first)
        ]
        g_inputs = (torch.stack(acc[::-1], dim=2) for acc in grads)
        return (None, None, None, None, None, *g_inputs, *g_init)


_COMPILED: dict[str, object] = {}


def _compiled(part: str):
    """:func:`_chunk_forward` or :func:`_chunk_backward` under ``torch.compile`` (built once per
    process, shapes fixed)."""
    if part not in _COMPILED:
        fn = _chunk_forward if part == "forward" else _chunk_backward
        _COMPILED[part] = torch.compile(fn, dynamic=False)
    return _COMPILED[part]


@torch.compiler.disable
def memory_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor,
    alpha: torch.Tensor,
    weights: list[torch.Tensor],
    chunk_size: int,
    state: MemoryState | None = None,
    compiled: bool = False,
    clip_tally: list[torch.Tensor] | None = None,
    max_norm: float = MAX_GRAD_NORM,
    normalized: bool = False,
    backprop_chunks: int = 0,
) -> tuple[torch.Tensor, MemoryState]:
    """Run the Titans memory over a sequence and read it out; chunk-parallel (see module doc).

    Args:
        q, k, v: [B, H, S, D] (q, k already l2-normalised).
        theta, eta, alpha: [B, H, S] in (0, 1): step size, momentum, forgetting.
        weights: initial memory MLP weights per head, ``[H, out_l, in_l]`` (first in = last out
            = D); used when ``state`` is None (the start of a sequence).
        chunk_size: tokens per chunk ``b``; gradients inside a chunk use the chunk-start weights.
        state: the memory to continue from (e.g. the previous MAC segment's final state).
        compiled: run each chunk through the compiled :func:`_chunk_forward` and
            :func:`_chunk_backward`.
        clip_tally: where given, ``[t]`` with ``t`` = (tokens x heads whose step the
            per-token clip scaled down, tokens x heads) so far, float64; this call's counts are
            added (``[]``: started).
        max_norm: the per-token clip's Frobenius norm (0: no clip).
        normalized: each token's step normalised by the memory's curvature along its error
            (NLMS, :func:`_step_scales`) instead of the plain gradient step.
        backprop_chunks: where positive, the backward treats the state entering every
            ``backprop_chunks``-th chunk of this call as a constant (truncated backpropagation
            through the memory: the forward is unchanged, gradients flow back through at most
            that many chunks); 0: through the whole call.

    Returns:
        ``y`` [B, H, S, D] with ``y_t = M_t(q_t)`` (in q's dtype) and the state after the last
        token (fp32, or fp64 for fp64 inputs).

    Never traced by an outer ``torch.compile`` (the chunk loop would be unrolled); with
    ``compiled`` the loop body is one compiled graph reused for every chunk (one for the
    forward, one for the backward). Differentiable once (a hand-written backward, see
    :class:`_Scan`); double backward is not supported.
    """
    out_dtype = q.dtype
    dtype = _state_dtype(q.dtype)
    bsz, heads, seq, _ = q.shape
    b = max(1, min(chunk_size, seq))
    pad = (-seq) % b
    with torch.autocast(q.device.type, enabled=False):
        q, k, v, theta, eta, alpha = (t.to(dtype) for t in (q, k, v, theta, eta, alpha))
        if state is None:
            state = MemoryState.initial(weights, dtype)
        if pad:  # padded tokens: no gradient step, no forgetting, momentum kept: state exact
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            theta, alpha = F.pad(theta, (0, pad)), F.pad(alpha, (0, pad))
            eta = F.pad(eta, (0, pad), value=1.0)
        n = (seq + pad) // b
        shape = (bsz, heads, n, b)
        coef, keep, mom, s_keep, s_coef = _chunk_coefficients(
            torch.log(eta.clamp_min(1e-30)).reshape(shape),
            torch.log1p(-alpha.clamp_max(1 - 1e-7)).reshape(shape),
        )
        # everything that does not depend on the memory, for all chunks at once
        qc, kc, vc = (t.reshape(bsz, heads, n, b, -1) for t in (q, k, v))
        kq = torch.cat((kc, qc), dim=3)
        qk = qc @ kc.mT
        k_sq = kc.pow(2).sum(-1)
        theta = theta.reshape(shape)
        rates = torch.stack((keep, mom), dim=-1)[..., None]
        ends = torch.stack((coef[..., -1, :], s_coef), dim=-1)
        mix = torch.stack((keep[..., -1], mom[..., -1], s_keep), dim=-1)
        clipped = None if clip_tally is None else []
        args = (kq, vc, qk, k_sq, theta, coef, rates, ends, mix, *state.layers)
        out = _Scan.apply(compiled, max_norm, normalized, backprop_chunks, clipped, *args)
        y = out[0].reshape(bsz, heads, n * b, -1)[:, :, :seq]
        if clipped is not None:
            n_clip = sum(clipped) if clipped else q.new_zeros(())
            counts = torch.stack((n_clip.double(), q.new_tensor(bsz * heads * seq).double()))
            clip_tally[:] = [clip_tally[0] + counts if clip_tally else counts]
    return y.to(out_dtype), MemoryState(list(out[1:]))
