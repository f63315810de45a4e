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
(the dual form of TTT). At the chunk end ``M`` and ``S`` are materialised (one matmul per layer,
``[c_b delta | (E_b/E) delta]^T a``) and carried to the next chunk; the loop over chunks is the
scan, one call of :func:`_chunk_forward` per chunk. No Python loop over tokens.

Choices the paper leaves open, and ours:

* Read-out uses ``M_t`` (updates from tokens ``<= t``, the current token included), per token
  even inside a chunk (not the chunk-start weights): causal by construction and identical to the
  token-by-token rule when the chunk size is 1. Across chunk boundaries only finished chunks
  enter ``M_0``/``S_0``.
* Gradients inside a chunk are w.r.t. the chunk-start weights ``M_0``; momentum ``S`` and decay
  are exact per token (not per chunk). ``S`` starts at zero for every sequence; ``M`` starts at
  learned per-head weights (meta-learned by the outer loop, through the memory updates).
* Precision: the memory state (``M``, ``S``), the gate products and every product of the scan
  run in fp32 whatever the activation dtype (autocast is switched off inside the scan; fp64
  inputs stay fp64); only the read-out is cast back. Over thousands of tokens a bf16 state would
  accumulate rounding in every decay and update; the projections around the memory still run in
  the activation dtype. (tests: bf16 autocast vs fp64 at sequence 4096 within 1 %.)
* ``theta_t, eta_t, alpha_t`` are per head and per token: ``sigmoid(x W + b)`` with a per-head
  bias (the only biases in the model). At init ``theta ~= 0.047`` and ``eta ~= 0.88`` for every
  head, and the gates' weights have a std that keeps the logits' spread over tokens at most 0.45
  whatever the width (:func:`gate_std`);
  ``alpha`` is spread over heads: the initial forgetting half-lives ``T_h`` (``alpha_h = 1 -
  2^{-1/T_h}``) are log-spaced from ``window / 4`` to ``16 window`` tokens
  (:func:`alpha_half_lives`), so from step 0 some heads keep what they saw for many attention
  windows while others track the recent past. (A single init of ``alpha ~= 0.018`` for every
  head, half-life ~38 tokens, forgot everything beyond a 1024-token window before training could
  discover the long-range use; the spread is ours, in the spirit of the multi-timescale decays
  of RetNet and Mamba's ``A`` init.)
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
  Convolution, SiLU and normalisation are one autograd node with its own backward
  (:func:`conv_silu_normalize`; autograd's graph of the same ops took twice the time).
* MAG (default): ``o = W_o [RMSNorm_h(attn) * sigmoid(RMSNorm_h(mem))]`` with per-head RMS norms
  carrying learnable vector gains ("normalise with learnable vector-valued weights, then a
  non-linearity"); the attention branch is sliding-window causal softmax attention (window
  ``window``, RoPE, its own q/k/v; by blocks of the window, flash/efficient-kernel capable,
  :func:`window_attention`); the memory reads the block input ``x``. The norms, the sigmoid and
  the product are one autograd node (:func:`gated_head_norms`).
* MAL: the memory layer first (``W_m RMSNorm_h(mem)``), then sliding-window attention over its
  output. LMM (memory only): ``o = W_o RMSNorm_h(mem)``.
* MAC (memory as context, the paper's section 4.1), segments of ``window`` tokens, processed in
  order. For segment ``s``: (1) retrieve ``h_t = M*_{s-1}(q_t)`` with the memory state at the
  segment start (the memory's own query projection, conv and SiLU applied to ``x``; no update);
  (2) the retrieved vectors become memory tokens in the token space (``W_h RMS_h(h)``, a
  row-parallel map) and go through the attention's own K/V projections; (3) attention over
  ``[persistent | memory tokens | segment]`` with a causal mask on both the memory tokens and the
  segment (token ``t`` sees ``h_j`` and ``x_j`` for ``j <= t`` only, so it stays strictly causal:
  ``h_j`` depends on ``x_j``); RoPE with positions local to the segment (relative positions are
  what attention sees; the same position for ``h_j`` and ``x_j``); (4) the memory learns from
  ``y = x + W_y attn`` in this segment (keys, values, gates and its read-out queries all come
  from ``y``; the paper's ``y_t`` is the attention output, ours adds it to the input in residual
  form, as a block adds its attention sub-layer: from the attention output alone, whose
  consecutive tokens are near-identical averages, the stale chunk gradients summed over a chunk
  overshot and a fresh memory blew up, read-out norm 2300 instead of 12 within 1024 tokens at
  chunk 64, and a 0.2 % input change grew to 100 % of the output), and (5) the block output is
  ``W_o [RMSNorm_h(attn) * sigmoid(RMSNorm_h(M_t(q(y_t))))]``, the paper's ``y_t (x) M*_t(y_t)``
  in MAG's gated form. ``window`` must be a multiple of ``chunk_size`` so that segment starts are
  chunk starts. The segment loop is sequential (segment ``s`` needs the memory written by
  ``s - 1``); everything inside a segment is batched.
* Persistent memory tokens (``persistent_tokens = N``, all variants with attention): ``N``
  learned key/value pairs per head, prepended to the keys and values of every query's attention
  (always visible, outside the window and the causal mask; the paper's "learnable
  data-independent parameters" prepended to the sequence). Learned directly as per-head keys and
  values (the form of titans-pytorch), not as d-dimensional tokens projected by W_K/W_V: equally
  expressive and input-independent; their keys are not rotated by RoPE. Init normal(0,
  ``init_std``), so they start as near-uniform, near-zero-value "sinks". The memory branch of
  MAG/MAL does not see them (in the paper it does; a fixed prefix would only pre-load the memory
  with the same input-independent content in every sequence). MAC needs them: on the
  associative-recall benchmark (scripts/bench_memory_recall.py) MAC without persistent tokens
  stays at chance even after 600 steps, with 4 it learns; its segment-local attention gives a
  segment's first queries only themselves and their memory tokens to attend to (the default
  stays 0 for every variant; give MAC some, as the paper does).
* Tensor parallelism: memory heads are split across TP ranks exactly like attention heads; every
  memory computation is local to its head, so the memory adds no communication (MAC: the two
  row-parallel maps ``W_h``, ``W_y`` add one all-reduce each per segment).
* The memory MLP is state, not the tapered site: the block's separate SwiGLU MLP tapers. The
  MAG mixer has about 1.8x the parameters of plain attention (its own memory q/k/v); MAC adds
  ``W_h`` and ``W_y``.
* Speed: the scan is one autograd node (:class:`_Scan`) with a hand-written backward. Its
  forward runs one kernel sequence per chunk without autograd (:func:`_chunk_forward`: the key
  pass, the per-token clip, the read-out of every layer, the chunk-end state) and keeps every
  chunk's start state plus a few per-token intermediates; its backward walks the chunks in
  reverse (:func:`_chunk_backward`), carrying the state's gradient by hand in one buffer per
  layer that is updated in place (``[g_M; g_S] <- [B_b g_M; P_b g_M + E_b g_S]``, then every
  matmul term of the state's gradient, read-out, key pass and delta backprop, in one batched
  ``baddbmm`` per layer). Against autograd through the same chunk step (the form it replaced) it
  saves the graph bookkeeping, the zero-filled gradients of state views and the separate
  accumulation of each state use (state-sized passes dominate at head dim 64): the scan's
  forward + backward at the library shape takes 0.80x the time at chunk 16 and 0.86x at chunk
  32 (one core, CPU time). Few and large kernels: everything that does not depend on the
  memory (gate products, ``q k^T``, key norms, keys and queries stacked) is computed for all
  chunks at once before the scan; the keys' first memory layer and the queries' read-out
  through ``[M_0; S_0]`` are one matmul (the keys' product with ``S_0`` is computed and unused:
  one matmul is cheaper than two), every later layer's read-out through ``[M_0; S_0]`` is one,
  the chunk-end update of ``M`` and ``S`` one per layer (``[c_b delta | (E_b/E) delta]^T a``,
  added in place). The first chunk uses a zero momentum instead of a special case, so every
  chunk runs the same kernels. Gradients equal autograd's to fp64 round-off (tested against
  finite differences in fp64); the scan is not twice differentiable. ``train.compile``
  compiles the chunk forward and backward once each (``torch.compile``, shapes fixed) and
  keeps the loop over chunks eager, so an outer ``torch.compile`` of the model never unrolls
  the scan (which took minutes to compile). Compiled, the chunk-end state mix and the state
  gradient's update are out of place (a 2x2 mix matmul and ``baddbmm`` into new tensors):
  inductor turned the in-place updates of state views into extra copies, which made the
  compiled scan slower than eager at chunk 16 and 32 (1.22x, 1.18x its time). Now, forward +
  backward of the scan at the library shape on one CPU core (scripts/bench_titans_scan.py):
  compiled on par with eager at chunk 16, faster at 32 and 64 (docs/BENCHMARKS.md; eager
  keeps the in-place form). Larger chunks fill the matmuls better
  (the ``b x b`` dual form grows, the per-chunk state materialisation is amortised): see
  docs/BENCHMARKS.md for the chunk-size trade-off measured.
* titans-pytorch (the reference implementation on PyPI) takes all surprise gradients of one
  forward call w.r.t. the call's starting weights and reads out with chunk-granular weights;
  ours takes them at each chunk start and reads out per token, so chunk size 1 is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from tapered_megatron.config import ConfigError, at_least
from tapered_megatron.models.base import Architecture, Counts, TokenMixer, register_architecture
from tapered_megatron.models.layers import RotaryEmbedding, silu_parts
from tapered_megatron.models.mlp import SwiGLU
from tapered_megatron.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp_region,
    get_tensor_model_parallel_world_size,
)
from tapered_megatron.parallel.layers import row_layout

if TYPE_CHECKING:
    from tapered_megatron.config import Config

MAX_GRAD_NORM = 1.0  # per-token clip of the memory gradient (Frobenius, all layers)
GATE_BIAS_INIT = {"theta": -3.0, "eta": 2.0}  # alpha: per head, see alpha_half_lives
ALPHA_HALF_LIFE = (0.25, 16.0)  # initial forgetting half-lives, in windows, log-spaced over heads
GATE_SPREAD_WIDTH = 512  # the gates' init std is held at its value for this width above it


@dataclass(frozen=True)
class TitansOptions:
    """``model.titans``: the neural long-term memory (tlm-spec.md section 5.3)."""

    variant: Literal["mag", "mal", "mac", "lmm"] = "mag"
    memory_depth: int = at_least(2, 2)  # layers of the per-head memory MLP
    memory_expansion: int = at_least(1, 2)  # memory MLP hidden width, as a multiple of head_dim
    chunk_size: int = at_least(1, 16)  # tokens per chunk of the chunk-parallel update
    conv_size: int = at_least(1, 4)  # short causal depthwise convolution on q, k, v
    window: int = at_least(1, 64)  # attention window (MAG / MAL); MAC: segment length
    persistent_tokens: int = at_least(0, 0)  # learned key/value pairs before every attention


def _validate(cfg: Config) -> None:
    """Persistent tokens need an attention (not lmm); MAC segments start at chunk starts."""
    t = cfg.model.titans
    if t.variant == "lmm" and t.persistent_tokens:
        raise ConfigError(
            "model.titans.persistent_tokens: variant lmm has no attention to prepend them to; "
            "use 0 or another variant"
        )
    if t.variant == "mac" and t.window % t.chunk_size:
        raise ConfigError(
            f"model.titans.window ({t.window}) must be a multiple of model.titans.chunk_size "
            f"({t.chunk_size}) for variant mac (segments start at chunk starts)"
        )


# --------------------------------------------------------------------------------------------
# the memory rule


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
    # the per-token clip of the full gradient 2 delta a^T: theta_i min(1, 1 / ||.||), with
    # the factor 2 folded in
    sq = k_sq * deltas[0].pow(2).sum(-1)
    for a, d in zip(acts[1:], deltas[1:]):
        sq = sq + a.pow(2).sum(-1) * d.pow(2).sum(-1)
    rs = MAX_GRAD_NORM * torch.rsqrt(sq.clamp_min(MAX_GRAD_NORM**2 / 4))
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
    return x, new, saved


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
    g_sq = torch.where(sq >= MAX_GRAD_NORM**2 / 4, g_th * theta * rs.pow(3) / (-2), 0.0)
    g_k_sq = g_sq * deltas[0].pow(2).sum(-1)
    gd[0] = gd[0] + (2 * g_sq * k_sq)[..., None] * deltas[0]
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
    def forward(ctx, compiled: bool, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fwd = _compiled("forward") if compiled else _chunk_forward
        per_chunk, layers = args[:9], list(args[9:])
        keep = any(ctx.needs_input_grad)
        states, ys, saved = [layers], [], []
        for chunk in zip(*(t.unbind(2) for t in per_chunk)):
            y, new, inner = fwd(states[-1], *chunk)
            ys.append(y)
            if keep:
                saved.extend(inner)
            states.append(new)
        if keep:
            kq, _, _, k_sq, theta, coef, rates, ends, mix = per_chunk
            ctx.compiled, ctx.sizes = compiled, (len(layers), len(saved) // len(ys))
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
                g_state, g_inputs = bwd(state, *chunks[c], inner, g_y, g_state)
                for acc, g in zip(grads, g_inputs):
                    acc.append(g)
        first = rest[:depth]
        g_init = [
            g.sum(0, keepdim=True) if s.shape[0] != g.shape[0] else g
            for g, s in zip(g_state, first)
        ]
        return (None, *(torch.stack(acc[::-1], dim=2) for acc in grads), *g_init)


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
        out = _Scan.apply(compiled, kq, vc, qk, k_sq, theta, coef, rates, ends, mix, *state.layers)
        y = out[0].reshape(bsz, heads, n * b, -1)[:, :, :seq]
    return y.to(out_dtype), MemoryState(list(out[1:]))


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


def alpha_half_lives(heads: int, window: int) -> list[float]:
    """Initial forgetting half-lives per head, in tokens: log-spaced from ``ALPHA_HALF_LIFE[0]``
    to ``ALPHA_HALF_LIFE[1]`` windows (one head: their geometric mean)."""
    lo, hi = (f * window for f in ALPHA_HALF_LIFE)
    if heads == 1:
        return [math.sqrt(lo * hi)]
    return [lo * (hi / lo) ** (h / (heads - 1)) for h in range(heads)]


def gate_std(init_std: float, d_model: int) -> float:
    """Init std of the gates' weights: ``init_std`` up to ``GATE_SPREAD_WIDTH``, lowered above it
    so that the gate logits' spread over tokens at init, ``std * sqrt(d_model)`` on the
    RMS-normalised input, stays at its value for that width (0.45 at the default ``init_std``
    0.02).

    Without the cap the spread grows with the width (1.28 at d_model 4096): a two-sigma token
    then starts with a theta 8x larger and a 1 - eta 10x smaller than the biases set, and the
    fresh memory overshoots on repeated input (recall error per repeat of a key/value block at
    the 7b shape 1.00 -> 1.49 -> 0.92, at 1.3b not monotone). Capped at width 1024 the 7b error
    falls monotonically but slowly (1.00 -> 0.60); at 512 (chosen) it falls at every preset
    shape (7b 1.00 -> 0.57, 1.3b 1.02 -> 0.44, 440m 1.11 -> 0.40; tests/test_memory_in_context.py).
    Models up to d_model 512 are unchanged.
    """
    return init_std * math.sqrt(min(d_model, GATE_SPREAD_WIDTH) / d_model)


def gate_bias_init(heads: int, window: int) -> torch.Tensor:
    """Full gate bias ``[theta (heads) | eta (heads) | alpha (heads)]`` (logits)."""
    alpha = torch.tensor([1.0 - 2.0 ** (-1.0 / t) for t in alpha_half_lives(heads, window)])
    return torch.cat(
        (
            torch.full((heads,), GATE_BIAS_INIT["theta"]),
            torch.full((heads,), GATE_BIAS_INIT["eta"]),
            torch.log(alpha) - torch.log1p(-alpha),
        )
    )


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
        # (a fresh product per tap cost 3x the time in allocation)
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
    K shifted multiply-adds in x's own layout (for a few taps faster than ``conv1d``, whose
    depthwise kernels and transposes cost a third more). The normalisation is ``F.normalize``'s
    (``a / max(||a||, 1e-12)`` over each group of ``head_dim`` channels). One autograd node with
    its own backward: autograd's graph of the same ops (a zero-filled slice gradient and a fresh
    product per tap, the normalisation's norm, clamp and division) took twice the time.
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
    a sigmoid and a product, as one autograd node (0.6x autograd's time, fwd+bwd, lib shape)."""
    return _GatedNorms.apply(attn, mem, attn_gain, mem_gain, eps)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    persistent: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention, [B, S, H, D] in and out (keys [B, S_k, H, D]), boolean ``mask``
    [S, S_k] or ``None`` for causal attention (``S_k == S``); ``persistent`` [H, 2, N, D]
    key/value pairs are prepended, visible to all."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if persistent is not None:
        if mask is None:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        p = persistent.to(k.dtype).unsqueeze(0).expand(k.shape[0], -1, -1, -1, -1)
        k, v = torch.cat((p[:, :, 0], k), dim=2), torch.cat((p[:, :, 1], v), dim=2)
        ones = torch.ones(mask.shape[0], persistent.shape[2], dtype=torch.bool, device=mask.device)
        mask = torch.cat((ones, mask), dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return o.transpose(1, 2)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    persistent: torch.Tensor | None,
) -> torch.Tensor:
    """Sliding-window causal softmax attention (token t sees (t - window, t]), [B, S, H, D] in
    and out; ``persistent`` [H, 2, N, D] key/value pairs are prepended, visible to all.

    The queries go in blocks of ``w = min(window, S)`` (the last one padded; padded keys sit
    after every real query). The first block is plain causal attention (``is_causal``: the
    flash kernel). Every later block attends to the keys of the previous block and its own
    (``2 w`` keys) under one band mask ``[w, 2 w]`` shared by all blocks, sequences and heads
    (with persistent tokens ``[w, N + 2 w]``): the scores cover ``2 S w`` pairs, not ``S^2``,
    the mask is ``O(w^2)`` whatever the sequence length, and SDPA's memory-efficient kernel,
    which takes a mask, runs it (the flash kernel takes none).
    """
    bsz, seq, heads, dim = q.shape
    w = min(window, seq)
    n = -(-seq // w)
    pad = n * w - seq
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    q, k, v = (t.reshape(bsz, n, w, heads, dim) for t in (q, k, v))
    out = [_attend(q[:, 0], k[:, 0], v[:, 0], None, persistent)]
    if n > 1:
        i = torch.arange(w, device=q.device)
        j = torch.arange(2 * w, device=q.device)
        band = (j > i[:, None]) & (j <= i[:, None] + w)  # key j of [previous, own] block
        keys, values = (torch.cat((t[:, :-1], t[:, 1:]), 2).flatten(0, 1) for t in (k, v))
        o = _attend(q[:, 1:].flatten(0, 1), keys, values, band, persistent)
        out.append(o.reshape(bsz, (n - 1) * w, heads, dim))
    return torch.cat(out, 1)[:, :seq]


def window_mask(seq: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean [seq, seq]: token t sees tokens (t - window, t]."""
    i = torch.arange(seq, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


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

    ``forward(x [B, S, d]) -> [B, S, H_local, head_dim]`` (the raw read-out ``M_t(q_t)``);
    :meth:`segment` continues from a given state (MAC), :meth:`queries` gives read-only queries.
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        dm = _dims(cfg)
        t = cfg.model.titans
        std = cfg.model.init_std
        self.dims, self.chunk_size = dm, t.chunk_size
        self.compiled = cfg.train.compile
        inner = dm.heads * dm.head_dim
        tp = get_tensor_model_parallel_world_size()
        self.local_heads = dm.heads // tp
        self.qkv = ColumnParallelLinear(
            dm.d, 3 * inner, std=std, out_blocks=(3, inner), split_dim=1
        )
        self.conv = _per_head((3 * inner, t.conv_size), fn=_uniform_fan_in)
        self.conv.tp_layout = row_layout((3 * inner, t.conv_size), (3, inner), 1)
        self.gates = ColumnParallelLinear(
            dm.d, 3 * dm.heads, std=gate_std(std, dm.d), out_blocks=(3, dm.heads), split_dim=1
        )
        heads, window = dm.heads, t.window
        self.gate_bias = _per_head((3 * heads,), fn=lambda s, g: gate_bias_init(heads, window))
        self.gate_bias.tp_layout = row_layout((3 * dm.heads,), (3, dm.heads), 1)
        self.memory = nn.ParameterList(
            _per_head((dm.heads, o, i), fn=_normal_fan_in) for o, i in dm.mem_layers
        )

    def gate_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """theta, eta, alpha, each [B, H_local, S]."""
        g = torch.sigmoid(self.gates(x) + self.gate_bias)  # [B, S, 3 H_local]
        theta, eta, alpha = g.view(*g.shape[:2], 3, self.local_heads).permute(2, 0, 3, 1).unbind(0)
        return theta, eta, alpha

    def _split_heads(self, t: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        bsz, seq, _ = t.shape
        t = t.view(bsz, seq, parts, self.local_heads, self.dims.head_dim).permute(2, 0, 3, 1, 4)
        return tuple(t.unbind(0))

    def project(
        self, x: torch.Tensor, tail: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, H, S, D] of ``x`` (q, k l2-normalised per head) and the conv tail (the
        last K-1 projected inputs) for the next call; ``tail`` continues the convolution from a
        previous call."""
        pre = self.qkv(x)
        d = self.dims.head_dim
        qkv = conv_silu_normalize(pre, self.conv, tail, d, 2 * self.local_heads * d)
        q, k, v = self._split_heads(qkv, 3)
        width = self.conv.shape[1]
        hist = pre if tail is None else torch.cat((tail, pre), dim=1)
        if hist.shape[1] < width - 1:
            hist = F.pad(hist, (0, 0, width - 1 - hist.shape[1], 0))
        tail = hist[:, hist.shape[1] - (width - 1) :]
        return q, k, v, tail

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Read-only queries of ``x`` [B, H, S, D]: the memory's q projection, conv, SiLU and
        l2 normalisation."""
        n = self.local_heads * self.dims.head_dim
        pre = F.linear(copy_to_tp_region(x), self.qkv.weight[:n])
        q = conv_silu_normalize(pre, self.conv[:n], None, self.dims.head_dim, n)
        return self._split_heads(q, 1)[0]

    def initial_state(self, dtype: torch.dtype) -> MemoryState:
        """The memory at the start of a sequence (learned weights, zero momentum)."""
        return MemoryState.initial(list(self.memory), _state_dtype(dtype))

    def segment(
        self, x: torch.Tensor, state: MemoryState | None, tail: torch.Tensor | None
    ) -> tuple[torch.Tensor, MemoryState, torch.Tensor]:
        """Learn from and read out ``x`` [B, S, d], continuing from ``state`` and conv ``tail``
        (None: the start of a sequence); returns the read-out [B, S, H, D], state and tail."""
        q, k, v, tail = self.project(x, tail)
        theta, eta, alpha = self.gate_values(x)
        y, state = memory_scan(
            q, k, v, theta, eta, alpha, list(self.memory), self.chunk_size, state, self.compiled
        )
        return y.transpose(1, 2), state, tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.segment(x, None, None)[0]


class TitansMixer(TokenMixer):
    """Titans token mixer (MAG default; MAL, MAC and LMM by ``cfg.model.titans.variant``).

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
        self.persistent = None
        if t.variant != "lmm":
            self.attn_qkv = ColumnParallelLinear(
                dm.d, 3 * inner, std=std, out_blocks=(3, inner), split_dim=1
            )
            self.rope = RotaryEmbedding(dm.head_dim, m.seq_len, m.rope_theta)
            if t.persistent_tokens:
                self.persistent = _per_head((m.heads, 2, t.persistent_tokens, dm.head_dim), std=std)
        if t.variant in ("mag", "mac"):
            self.attn_norm = _per_head((inner,))
            nn.init.ones_(self.attn_norm)
        if t.variant == "mal":
            self.mem_out = RowParallelLinear(inner, dm.d, std=out_std)
        if t.variant == "mac":
            self.mem_tokens = RowParallelLinear(inner, dm.d, std=std)  # W_h
            self.attn_proj = RowParallelLinear(inner, dm.d, std=std)  # W_y
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
        if t.variant != "lmm":
            n_p = t.persistent_tokens
            if t.variant == "mac":  # persistent + memory tokens and the segment, causal in both
                seg = [min(t.window, s - i) for i in range(0, s, t.window)]
                ctx = n_p + sum(2 * c * (c + 1) / 2 for c in seg) / s
            else:
                ctx = n_p + sum(min(i + 1, t.window) for i in range(s)) / s
            params += 3 * d * inner + 2 * n_p * inner
            flops += 2.0 * 3 * d * inner + 2 * 2 * inner * ctx
            elems += 5 * inner + h  # q k v after RoPE, attention output, log-sum-exp
        if t.variant in ("mag", "mac"):
            params += inner
            elems += 2 * inner  # normalised attention output, sigmoid gate
        if t.variant == "mal":
            params += inner * d
            flops += 2.0 * inner * d
            elems += d
        if t.variant == "mac":
            # W_h, W_y; per token: retrieval q projection + conv + memory read, W_h, the K/V
            # projections of the memory tokens, W_y
            params += 2 * inner * d
            retrieve = d * inner + inner * t.conv_size + h * mem_p
            flops += 2.0 * (retrieve + inner * d + 2 * d * inner + inner * d)
            elems += 2 * inner + h * hidden + 3 * d + 2 * inner  # query, read, tokens, k/v, y
        params += inner * d  # output projection
        flops += 2.0 * inner * d
        return Counts(int(params), float(flops), float(elems * dtype_bytes))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bsz, seq, _ = x.shape
        qkv = self.attn_qkv(x).view(bsz, seq, 3, self.local_heads, self.head_dim)
        return qkv.unbind(2)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """Sliding-window attention of ``x`` (MAG, MAL), persistent tokens in front."""
        q, k, v = self._qkv(x)
        return window_attention(self.rope(q), self.rope(k), v, self.window, self.persistent)

    def _mac(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory as context, segment by segment (module doc); returns the attention output and
        the memory read-out, both [B, S, H, D]."""
        bsz, seq, _ = x.shape
        h, hd, n = self.local_heads, self.head_dim, self.local_heads * self.head_dim
        queries = self.memory.queries(x)
        aq, ak, av = self._qkv(x)
        kv_weight = self.attn_qkv.weight[n:]  # this rank's k and v rows
        state, tail = None, None
        attn, read = [], []
        for start in range(0, seq, self.window):
            end = min(start + self.window, seq)
            c = end - start
            if state is None:
                state = self.memory.initial_state(x.dtype)
            hm = mlp_read(state.weights, queries[:, :, start:end]).transpose(1, 2)
            tokens = self.mem_tokens(_head_rms_norm(hm, None, self.eps).reshape(bsz, c, n))
            mk, mv = F.linear(copy_to_tp_region(tokens), kv_weight).view(bsz, c, 2, h, hd).unbind(2)
            tril = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
            a = _attend(
                self.rope(aq[:, start:end]),
                torch.cat((self.rope(mk), self.rope(ak[:, start:end])), dim=1),
                torch.cat((mv, av[:, start:end]), dim=1),
                torch.cat((tril, tril), dim=1),
                self.persistent,
            )
            y = x[:, start:end] + self.attn_proj(a.reshape(bsz, c, n))  # residual form
            r, state, tail = self.memory.segment(y, state, tail)
            attn.append(a)
            read.append(r)
        return torch.cat(attn, dim=1), torch.cat(read, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        if self.variant == "mac":
            attn, mem = self._mac(x)
            o = gated_head_norms(attn, mem, self.attn_norm, self.mem_norm, self.eps)
            return self.out(o.reshape(bsz, seq, -1))
        mem = self.memory(x)
        if self.variant == "mag":
            o = gated_head_norms(self._attention(x), mem, self.attn_norm, self.mem_norm, self.eps)
        elif self.variant == "mal":
            mem = _head_rms_norm(mem, self.mem_norm, self.eps)
            o = self._attention(self.mem_out(mem.reshape(bsz, seq, -1)))
        else:
            o = _head_rms_norm(mem, self.mem_norm, self.eps)
        return self.out(o.reshape(bsz, seq, -1))


register_architecture(
    Architecture(
        "titans",
        TitansMixer,
        SwiGLU,
        options=TitansOptions,
        validate=_validate,
        mixer_efficiency=0.6,  # chunked memory scan: small batched matmuls and a Python loop
        compiles=True,  # the chunk step compiles on its own; the chunk loop stays eager
    )
)
