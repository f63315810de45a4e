"""The fused autograd nodes around the Titans memory, each the same numbers as the plain ops with
a hand-written backward (fewer passes, no graph of small ops): the q/k/v short causal
convolution with SiLU and per-head l2 normalisation (:func:`conv_silu_normalize`), and MAG's and
MAC's gated per-head RMS norms (:func:`gated_head_norms`)::

    qkv = silu(conv_K(x)),  q, k <- q / ||q||, k / ||k||   (per head)
    o   = RMSNorm_h(attn) g_a * sigmoid(RMSNorm_h(mem) g_m)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORMALIZE_EPS = 1e-12  # l2 normalisation of q and k: x / max(||x||, eps), as F.normalize


class _ConvSiluNorm(torch.autograd.Function):
    """Causal depthwise convolution, SiLU, then per-head l2 normalisation of the leading
    channels, with a hand-written backward (see :func:`conv_silu_normalize`)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        prefix: torch.Tensor | None,
        head_dim: int,
        normalized: int,
    ) -> torch.Tensor:
        width, seq = weight.shape[1], x.shape[1]
        w = weight.to(x.dtype)
        xp = F.pad(x, (0, 0, width - 1, 0)) if prefix is None else torch.cat((prefix, x), 1)
        z = xp[:, :seq] * w[:, 0]
        for j in range(1, width):
            z.addcmul_(xp[:, j : j + seq], w[:, j])
        y = F.silu(z)
        yn = y[..., :normalized].unflatten(-1, (-1, head_dim))
        norm = torch.linalg.vector_norm(yn, dim=-1, keepdim=True)
        yn.div_(norm.clamp_min(NORMALIZE_EPS))
        ctx.save_for_backward(xp, w, z, y, norm)
        ctx.head_dim, ctx.normalized, ctx.prefix = head_dim, normalized, prefix is not None
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xp, w, z, y, norm = ctx.saved_tensors
        width, seq, n = w.shape[1], z.shape[1], ctx.normalized
        # l2 normalisation: g <- (g - y (g . y)) / ||a||  (g / eps where the norm is clamped)
        gz = grad.clone(memory_format=torch.contiguous_format)
        gn = gz[..., :n].unflatten(-1, (-1, ctx.head_dim))
        yn = y[..., :n].unflatten(-1, (-1, ctx.head_dim))
        dot = torch.linalg.vecdot(gn, yn, dim=-1).unsqueeze(-1)
        dot = torch.where(norm >= NORMALIZE_EPS, dot, 0.0)
        gn.addcmul_(yn, dot, value=-1).div_(norm.clamp_min(NORMALIZE_EPS))
        torch.ops.aten.silu_backward.grad_input(gz, z, grad_input=gz)
        # convolution: every tap's input and weight gradient; one scratch buffer for all taps
        # (a fresh product per tap would allocate in every tap)
        gxp = torch.zeros_like(xp)
        gw = torch.empty_like(w)
        scratch = torch.empty_like(gz)
        for j in range(width):
            gxp[:, j : j + seq].addcmul_(gz, w[:, j])
            gw[:, j] = torch.mul(gz, xp[:, j : j + seq], out=scratch).sum((0, 1))
        prefix = gxp[:, : width - 1] if ctx.prefix else None
        return gxp[:, width - 1 :], gw.to(ctx.weight_dtype), prefix, None, None


def conv_silu_normalize(
    x: torch.Tensor,
    weight: torch.Tensor,
    prefix: torch.Tensor | None,
    head_dim: int,
    normalized: int,
) -> torch.Tensor:
    """``silu(conv(x))`` with its first ``normalized`` channels l2-normalised per head.

    The convolution is causal and depthwise: x [B, S, C], weight [C, K] (tap K-1 is the current
    token); ``prefix`` [B, K-1, C] are the inputs just before ``x`` (zeros when None). Written as
    K shifted multiply-adds in x's own layout (for a few taps cheaper than ``conv1d``'s depthwise
    kernels and transposes). The normalisation is ``F.normalize``'s (``a / max(||a||, 1e-12)``
    over each group of ``head_dim`` channels). One autograd node with its own backward, in place
    of autograd's graph of the same ops (a zero-filled slice gradient and a fresh product per
    tap, the normalisation's norm, clamp and division).
    """
    return _ConvSiluNorm.apply(x, weight, prefix, head_dim, normalized)


def _head_rms_norm(x: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm over each head's channels; x [B, S, H, D], gain [H * D] (None: no gain)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if gain is None else x * gain.view(x.shape[-2], x.shape[-1])


class _GatedNorms(torch.autograd.Function):
    """``RMS_h(a) ga * sigmoid(RMS_h(m) gm)`` with a hand-written backward (see
    :func:`gated_head_norms`)."""

    @staticmethod
    def forward(
        ctx, a: torch.Tensor, m: torch.Tensor, ga: torch.Tensor, gm: torch.Tensor, eps: float
    ) -> torch.Tensor:
        shape = a.shape[-2:]
        a_rsqrt = torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)
        m_rsqrt = torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + eps)
        a_hat, m_hat = a * a_rsqrt, m * m_rsqrt
        gate = torch.sigmoid(m_hat * gm.view(shape))
        ctx.save_for_backward(a_hat, m_hat, a_rsqrt, m_rsqrt, gate, ga, gm)
        return a_hat * ga.view(shape) * gate

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a_hat, m_hat, a_rsqrt, m_rsqrt, gate, ga, gm = ctx.saved_tensors
        shape = a_hat.shape[-2:]
        ga_, gm_ = ga.view(shape), gm.view(shape)
        g_a = grad * gate  # w.r.t. RMS_h(a) ga
        g_m = torch.ops.aten.sigmoid_backward(grad * (a_hat * ga_), gate)  # w.r.t. RMS_h(m) gm
        g_ga = (g_a * a_hat).sum((0, 1)).flatten()
        g_gm = (g_m * m_hat).sum((0, 1)).flatten()
        outs = []
        for g, x_hat, rsqrt, gain in ((g_a, a_hat, a_rsqrt, ga_), (g_m, m_hat, m_rsqrt, gm_)):
            # RMS norm: dx = (g - x_hat mean(g x_hat)) / rms(x), g taken w.r.t. x_hat
            g = g.mul_(gain)
            x_hat = x_hat.to(g.dtype)  # bf16 under autocast; g follows the fp32 gains
            dot = torch.linalg.vecdot(g, x_hat, dim=-1).unsqueeze(-1) / x_hat.shape[-1]
            outs.append(g.addcmul_(x_hat, dot, value=-1).mul_(rsqrt))
        return (
            outs[0].to(a_hat.dtype),
            outs[1].to(m_hat.dtype),
            g_ga.to(ga.dtype),
            g_gm.to(gm.dtype),
            None,
        )


def gated_head_norms(
    attn: torch.Tensor,
    mem: torch.Tensor,
    attn_gain: torch.Tensor,
    mem_gain: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """MAG's and MAC's output before ``W_o``: ``RMSNorm_h(attn) * sigmoid(RMSNorm_h(mem))`` with
    gains ``[H * D]``; attn, mem [B, S, H, D]. The same numbers as :func:`_head_rms_norm` twice,
    a sigmoid and a product, as one autograd node with a hand-written backward."""
    return _GatedNorms.apply(attn, mem, attn_gain, mem_gain, eps)
