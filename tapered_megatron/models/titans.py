"""Titans: a neural long-term memory that learns inside the sequence (tlm-spec.md section 5.3).

Behrouz, Zhong, Mirrokni, "Titans: Learning to Memorize at Test Time" (arXiv 2501.00663).

Per head, a memory MLP ``M`` (depth ``L >= 2``, hidden ``memory_expansion * head_dim``) is trained
on the fly with the associative loss ``loss_t = ||M_{t-1}(k_t) - v_t||^2``::

    S_t = eta_t S_{t-1} - theta_t grad loss_t          (surprise with momentum)
    M_t = (1 - alpha_t) M_{t-1} + S_t                  (forgetting)
    y_t = M_t(q_t)                                     (read-out)

Chunk-parallel form (:func:`memory_scan`). Inside a chunk of ``b`` tokens the gradients are taken
w.r.t. the chunk-start weights ``M_0`` (the paper's mini-batch approximation; exact when b = 1),
written as an explicit backward pass through the memory MLP, so every per-token gradient is an
outer product ``delta_i a_i^T`` per layer. Unrolling the two linear recurrences inside the chunk
gives, for every token ``t`` of the chunk::

    M_t = B_t M_0 + P_t S_0 - sum_{i<=t} c_{t,i} delta_i a_i^T
    B_t = prod_{j<=t}(1-alpha_j),  E_t = prod_{j<=t} eta_j,  P_t = sum_{s<=t} (B_t/B_s) E_s
    c_{t,i} = theta_i sum_{s=i..t} (B_t/B_s)(E_s/E_i)

(``theta_i`` includes the per-token gradient clip below; all ratios are formed as differences
of cumulative log-gates, masked before ``exp``, so nothing is divided by a vanishing product).
The read-out ``M_t(q_t)`` never materialises ``M_t``: layer by
layer, ``M_t x_t = B_t M_0 x_t + P_t S_0 x_t - sum_i c_{t,i} delta_i (a_i . x_t)``, i.e. two
weight matmuls plus a causally masked ``b x b`` "attention" over the chunk's gradient factors
(the dual form of TTT). At the chunk end ``M`` and ``S`` are materialised (``delta^T diag(c) a``)
and carried to the next chunk; the loop over chunks is the scan. No Python loop over tokens.

Choices the paper leaves open, and ours:

* Read-out uses ``M_t`` (updates from tokens ``<= t``, the current token included), per token
  even inside a chunk (not the chunk-start weights): causal by construction and identical to the
  token-by-token rule when the chunk size is 1. Across chunk boundaries only finished chunks
  enter ``M_0``/``S_0``.
* Gradients inside a chunk are w.r.t. the chunk-start weights ``M_0``; momentum ``S`` and decay
  are exact per token (not per chunk). ``S`` starts at zero for every sequence; ``M`` starts at
  learned per-head weights (meta-learned by the outer loop, through the memory updates).
* ``theta_t, eta_t, alpha_t`` are per head and per token: ``sigmoid(x W + b)`` with a per-head
  bias (the only biases in the model) initialised to ``theta ~= 0.12, eta ~= 0.88,
  alpha ~= 0.018`` so that a fresh memory neither explodes nor forgets everything.
* Memory MLP: ``W_L silu(... silu(W_1 k))``, no biases, no residual, no inner norm; SiLU (whose
  derivative the explicit backward uses). Init: normal with std ``1/sqrt(fan_in)`` per head.
* The loss is the plain sum of squares (gradient ``2 (M(k) - v)``); ``theta`` absorbs the scale.
* Each token's memory gradient is clipped to Frobenius norm ``MAX_GRAD_NORM = 1`` (over all
  memory layers; ``||delta a^T|| = ||delta|| ||a||`` makes this free in the chunked form; the
  ``max_grad_norm`` option of titans-pytorch). Without it the stale chunk gradients plus momentum
  let the memory diverge within a sequence once the outer loop grows the memory weights (we saw
  fp32 overflow after a dozen training steps); with it the memory grows at most linearly.
* q, k, v: own projections (not shared with attention), then a causal depthwise convolution of
  width ``conv_size``, then SiLU; q and k are l2-normalised per head. v is not normalised.
* MAG (default): ``o = W_o [RMSNorm_h(attn) * sigmoid(RMSNorm_h(mem))]`` with per-head RMS norms
  carrying learnable vector gains ("normalise with learnable vector-valued weights, then a
  non-linearity"); the attention branch is sliding-window causal softmax attention (window
  ``window``, RoPE, its own q/k/v). No persistent memory tokens.
* MAL: the memory layer first (``W_m RMSNorm_h(mem)``), then sliding-window attention over its
  output. LMM (memory only): ``o = W_o RMSNorm_h(mem)``.
* Tensor parallelism: memory heads are split across TP ranks exactly like attention heads; every
  memory computation is local to its head, so the memory adds no communication.
* The memory MLP is state, not the tapered site: the block's separate SwiGLU MLP tapers. The
  MAG mixer has about 1.8x the parameters of plain attention (its own memory q/k/v).
* titans-pytorch (the reference implementation on PyPI) takes all surprise gradients of one
  forward call w.r.t. the call's starting weights and reads out with chunk-granular weights;
  ours takes them at each chunk start and reads out per token, so chunk size 1 is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.config import at_least
from tapered_megatron.models.base import Architecture, Counts, TokenMixer, register_architecture
from tapered_megatron.models.layers import RotaryEmbedding, silu_grad
from tapered_megatron.models.mlp import SwiGLU
from tapered_megatron.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_world_size,
)
from tapered_megatron.parallel.layers import row_layout

MAX_GRAD_NORM = 1.0  # per-token clip of the memory gradient (Frobenius, all layers)
GATE_BIAS_INIT = {"theta": -2.0, "eta": 2.0, "alpha": -4.0}


@dataclass(frozen=True)
class TitansOptions:
    """``model.titans``: the neural long-term memory (tlm-spec.md section 5.3)."""

    variant: Literal["mag", "mal", "lmm"] = "mag"
    memory_depth: int = at_least(2, 2)  # layers of the per-head memory MLP
    memory_expansion: int = at_least(1, 2)  # memory MLP hidden width, as a multiple of head_dim
    chunk_size: int = at_least(1, 16)  # tokens per chunk of the chunk-parallel update
    conv_size: int = at_least(1, 4)  # short causal depthwise convolution on q, k, v
    window: int = at_least(1, 64)  # sliding-window size of the attention branch (MAG / MAL)


# --------------------------------------------------------------------------------------------
# the memory rule


def _mlp_forward_backward(
    weights: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward ``k`` through the memory MLP and back-propagate ``||M(k) - v||^2`` explicitly.

    Returns per layer ``l`` the layer inputs ``a_l`` ([..., n, in_l]) and output-side errors
    ``delta_l`` ([..., n, out_l]); token ``i``'s gradient of layer ``l`` is ``delta_l[i] a_l[i]^T``.
    """
    acts, pre = [k], []
    x = k
    for i, w in enumerate(weights):
        z = x @ w.transpose(-1, -2)
        if i < len(weights) - 1:
            pre.append(z)
            x = F.silu(z)
            acts.append(x)
        else:
            x = z
    delta = 2.0 * (x - v)
    deltas = [delta]
    for i in range(len(weights) - 1, 0, -1):
        delta = (delta @ weights[i]) * silu_grad(pre[i - 1])
        deltas.append(delta)
    deltas.reverse()
    return acts, deltas


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


def _clip_scale(acts: list[torch.Tensor], deltas: list[torch.Tensor]) -> torch.Tensor:
    """Per-token factor ``min(1, MAX_GRAD_NORM / ||grad_i||)``; ``||d a^T|| = ||d|| ||a||``."""
    sq = sum(a.pow(2).sum(-1) * d.pow(2).sum(-1) for a, d in zip(acts, deltas))
    return MAX_GRAD_NORM / torch.sqrt(sq.clamp_min(MAX_GRAD_NORM**2))


def memory_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta: torch.Tensor,
    alpha: torch.Tensor,
    weights: list[torch.Tensor],
    chunk_size: int,
) -> torch.Tensor:
    """Run the Titans memory over a sequence and read it out; chunk-parallel (see module doc).

    Args:
        q, k, v: [B, H, S, D] (q, k already l2-normalised).
        theta, eta, alpha: [B, H, S] in (0, 1): step size, momentum, forgetting.
        weights: initial memory MLP weights per head, ``[H, out_l, in_l]`` (first in = last out
            = D).
        chunk_size: tokens per chunk ``b``; gradients inside a chunk use the chunk-start weights.

    Returns:
        ``y`` [B, H, S, D] with ``y_t = M_t(q_t)``.
    """
    bsz, heads, seq, _ = q.shape
    b = max(1, min(chunk_size, seq))
    pad = (-seq) % b
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        theta, alpha = F.pad(theta, (0, pad)), F.pad(alpha, (0, pad))
        eta = F.pad(eta, (0, pad), value=1.0)
    n = (seq + pad) // b
    shape = (bsz, heads, n, b)
    # gate products in fp32 whatever the activation dtype (cumulative log sums), then cast back
    coef, keep, mom, s_keep, s_coef = (
        t.to(q.dtype)
        for t in _chunk_coefficients(
            torch.log(eta.float().clamp_min(1e-30)).reshape(shape),
            torch.log1p(-alpha.float().clamp_max(1 - 1e-7)).reshape(shape),
        )
    )
    theta = theta.reshape(shape)
    qc, kc, vc = (t.reshape(bsz, heads, n, b, -1) for t in (q, k, v))
    w = [x.unsqueeze(0) for x in weights]  # [1, H, out, in]
    s: list[torch.Tensor] | None = None  # momentum; zero at the start of the sequence
    outs = []
    for c in range(n):
        acts, deltas = _mlp_forward_backward(w, kc[:, :, c], vc[:, :, c])
        th = theta[:, :, c] * _clip_scale(acts, deltas)  # [B, H, b]
        cf = coef[:, :, c] * th[..., None, :]
        kp, mm = keep[:, :, c, :, None], mom[:, :, c, :, None]
        x = qc[:, :, c]
        for layer, (wl, a, d) in enumerate(zip(w, acts, deltas)):
            z = kp * (x @ wl.transpose(-1, -2)) - ((x @ a.transpose(-1, -2)) * cf) @ d
            if s is not None:
                z = z + mm * (x @ s[layer].transpose(-1, -2))
            x = F.silu(z) if layer < len(w) - 1 else z
        outs.append(x)
        if c == n - 1:
            break
        last, sk = cf[..., -1, :, None], s_keep[:, :, c, None, None]
        sc = (s_coef[:, :, c] * th)[..., None]
        kb, pb = keep[:, :, c, -1, None, None], mom[:, :, c, -1, None, None]
        new_w, new_s = [], []
        for layer, (wl, a, d) in enumerate(zip(w, acts, deltas)):
            upd_s = -(d.transpose(-1, -2) @ (sc * a))
            new_w.append(kb * wl - d.transpose(-1, -2) @ (last * a))
            new_s.append(upd_s)
            if s is not None:
                new_w[-1] = new_w[-1] + pb * s[layer]
                new_s[-1] = new_s[-1] + sk * s[layer]
        w, s = new_w, new_s
    y = torch.stack(outs, dim=2).reshape(bsz, heads, n * b, -1)
    return y[:, :, :seq]


# --------------------------------------------------------------------------------------------
# the mixer


def _per_head(shape: tuple[int, ...], std: float | None = None, fn=None) -> nn.Parameter:
    """A parameter whose first axis is heads (or head-major channels), split over TP ranks."""
    tp = get_tensor_model_parallel_world_size()
    layout = row_layout(shape)
    p = nn.Parameter(torch.empty(layout.local_shape(tp)))
    p.tp_layout = layout
    p.init_std = std
    if fn is not None:
        p.init_fn = fn
    return p


def _normal_fan_in(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)


def _uniform_fan_in(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def _gate_bias_init(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    bias = torch.tensor([GATE_BIAS_INIT[g] for g in ("theta", "eta", "alpha")])
    return bias.repeat_interleave(shape[0] // 3)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise 1-D convolution; x [B, S, C], weight [C, K] (tap K-1 is the current)."""
    c, width = weight.shape
    y = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), groups=c)
    return y.transpose(1, 2)


def _head_rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over each head's channels; x [B, S, H, D], gain [H * D]."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * gain.view(x.shape[-2], x.shape[-1])


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int
) -> torch.Tensor:
    """Causal softmax attention where token t sees tokens (t - window, t]; [B, H, S, D]."""
    seq = q.shape[-2]
    i = torch.arange(seq, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass(frozen=True)
class _Dims:
    d: int
    heads: int
    head_dim: int
    hidden: int
    depth: int

    @property
    def mem_layers(self) -> list[tuple[int, int]]:
        """(out, in) of each memory MLP layer."""
        dims = [self.head_dim] + [self.hidden] * (self.depth - 1) + [self.head_dim]
        return list(zip(dims[1:], dims[:-1]))


def _dims(cfg) -> _Dims:
    m = cfg.model
    t = m.titans
    return _Dims(m.d_model, m.heads, m.head_dim, t.memory_expansion * m.head_dim, t.memory_depth)


class NeuralMemory(nn.Module):
    """The memory branch: q/k/v projections, conv, gates and the memory rule; heads split by TP.

    ``forward(x [B, S, d]) -> [B, S, H_local, head_dim]`` (the raw read-out ``M_t(q_t)``).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        dm = _dims(cfg)
        t = cfg.model.titans
        std = cfg.model.init_std
        self.dims, self.chunk_size = dm, t.chunk_size
        inner = dm.heads * dm.head_dim
        tp = get_tensor_model_parallel_world_size()
        self.local_heads = dm.heads // tp
        self.qkv = ColumnParallelLinear(
            dm.d, 3 * inner, std=std, out_blocks=(3, inner), split_dim=1
        )
        self.conv = _per_head((3 * inner, t.conv_size), fn=_uniform_fan_in)
        self.conv.tp_layout = row_layout((3 * inner, t.conv_size), (3, inner), 1)
        self.gates = ColumnParallelLinear(
            dm.d, 3 * dm.heads, std=std, out_blocks=(3, dm.heads), split_dim=1
        )
        bias = torch.tensor([GATE_BIAS_INIT[g] for g in ("theta", "eta", "alpha")])
        self.gate_bias = _per_head(
            (3 * dm.heads,), fn=lambda s, g: bias.repeat_interleave(s[0] // 3)
        )
        self.gate_bias.tp_layout = row_layout((3 * dm.heads,), (3, dm.heads), 1)
        self.memory = nn.ParameterList(
            _per_head((dm.heads, o, i), fn=_normal_fan_in) for o, i in dm.mem_layers
        )

    def gate_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """theta, eta, alpha, each [B, H_local, S]."""
        g = torch.sigmoid(self.gates(x) + self.gate_bias)  # [B, S, 3 H_local]
        g = g.view(*g.shape[:2], 3, self.local_heads).permute(2, 0, 3, 1)
        return g[0], g[1], g[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        h, d = self.local_heads, self.dims.head_dim
        qkv = F.silu(causal_depthwise_conv(self.qkv(x), self.conv))
        q, k, v = qkv.view(bsz, seq, 3, h, d).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        theta, eta, alpha = self.gate_values(x)
        y = memory_scan(q, k, v, theta, eta, alpha, list(self.memory), self.chunk_size)
        return y.transpose(1, 2)


class TitansMixer(TokenMixer):
    """Titans token mixer (MAG default; MAL and LMM by ``cfg.model.titans.variant``).

    ``forward(x [B, S, d]) -> [B, S, d]`` where ``x`` is the block's normalised input.
    """

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg, layer)
        m, t = cfg.model, cfg.model.titans
        dm = _dims(cfg)
        std = m.init_std
        out_std = std / math.sqrt(2 * m.layers)
        self.variant, self.window, self.eps = t.variant, t.window, m.norm_eps
        tp = get_tensor_model_parallel_world_size()
        self.local_heads, self.head_dim = m.heads // tp, dm.head_dim
        inner = m.heads * dm.head_dim
        self.memory = NeuralMemory(cfg)
        self.mem_norm = _per_head((inner,))
        nn.init.ones_(self.mem_norm)
        if t.variant in ("mag", "mal"):
            self.attn_qkv = ColumnParallelLinear(
                dm.d, 3 * inner, std=std, out_blocks=(3, inner), split_dim=1
            )
            self.rope = RotaryEmbedding(dm.head_dim, m.seq_len, m.rope_theta)
        if t.variant == "mag":
            self.attn_norm = _per_head((inner,))
            nn.init.ones_(self.attn_norm)
        if t.variant == "mal":
            self.mem_out = RowParallelLinear(inner, dm.d, std=out_std)
        self.out = RowParallelLinear(inner, dm.d, std=out_std)

    @classmethod
    def counts(cls, cfg, layer: int, dtype_bytes: int = 2) -> Counts:
        """Full-model params, forward FLOPs/token and activation bytes/token (see base)."""
        m, t = cfg.model, cfg.model.titans
        dm = _dims(cfg)
        d, h, inner, s = dm.d, dm.heads, dm.heads * dm.head_dim, m.seq_len
        b = max(1, min(t.chunk_size, s))
        mem_p = sum(o * i for o, i in dm.mem_layers)  # memory MLP weights per head
        mem_io = sum(o + i for o, i in dm.mem_layers)
        hidden = dm.hidden * (dm.depth - 1)
        # memory branch: projections, conv, gates, initial memory weights, norm gain
        mats = 3 * d * inner + 3 * d * h
        params = mats + 3 * inner * t.conv_size + 3 * h + h * mem_p + inner
        # per head and token: key forward (P) and explicit backward (P - first layer), read-out
        # through M_0 and S_0 (2P), the b x b dual form (b (in + out) per layer, b^2 for the
        # coefficients) and the chunk-end materialisation of M and S (2P)
        first = dm.mem_layers[0][0] * dm.mem_layers[0][1]
        mem_macs = h * (mem_p + (mem_p - first) + 2 * mem_p + b * mem_io + b * b + 2 * mem_p)
        flops = 2.0 * (mats + 3 * inner * t.conv_size + mem_macs)
        # kept: x (d), qkv before/after conv and silu (9 inner), gates (6h), per head the key
        # pass (hidden pre/post activations, deltas, read-out pre/post: ~3 hidden + 3 head_dim),
        # the b x b score rows per layer, and M, S at each chunk boundary (2P per b tokens)
        mem_elems = h * (3 * hidden + 3 * dm.head_dim + b * dm.depth + b + 2 * mem_p / b)
        elems = d + 9 * inner + 6 * h + mem_elems + 2 * inner
        if t.variant in ("mag", "mal"):
            ctx = sum(min(i + 1, t.window) for i in range(s)) / s
            params += 3 * d * inner
            flops += 2.0 * 3 * d * inner + 2 * 2 * inner * ctx
            elems += 5 * inner + h  # q k v after RoPE, attention output, log-sum-exp
        if t.variant == "mag":
            params += inner
            elems += 2 * inner  # normalised attention output, sigmoid gate
        if t.variant == "mal":
            params += inner * d
            flops += 2.0 * inner * d
            elems += d
        params += inner * d  # output projection
        flops += 2.0 * inner * d
        return Counts(int(params), float(flops), float(elems * dtype_bytes))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = self.attn_qkv(x).view(bsz, seq, 3, self.local_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (self.rope(q), self.rope(k), v))
        return sliding_window_attention(q, k, v, self.window).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        mem = _head_rms_norm(self.memory(x), self.mem_norm, self.eps)
        if self.variant == "mag":
            attn = _head_rms_norm(self._attention(x), self.attn_norm, self.eps)
            o = attn * torch.sigmoid(mem)
        elif self.variant == "mal":
            o = self._attention(self.mem_out(mem.reshape(bsz, seq, -1)))
        else:
            o = mem
        return self.out(o.reshape(bsz, seq, -1))


register_architecture(
    Architecture(
        "titans",
        TitansMixer,
        SwiGLU,
        options=TitansOptions,
        mixer_efficiency=0.6,  # chunked memory scan: small batched matmuls and a Python loop
    )
)
