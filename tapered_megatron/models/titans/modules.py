"""The Titans token mixer as modules: :class:`NeuralMemory` (the memory branch: q/k/v, the short
convolution, the gates and the memory rule of :mod:`.scan`) and :class:`TitansMixer` (the
variants); the ``model.titans`` options and the record are
:mod:`tapered_megatron.architectures.titans`.

Per head and token the gates are ``theta, eta, alpha = sigmoid(x W + b)`` (step size, momentum,
forgetting; initial forgetting half-lives log-spaced over heads, :func:`alpha_half_lives`);
q, k, v are the memory's own projections, a causal depthwise convolution and SiLU, q and k
l2-normalised. With ``mem = M_t(q_t)`` and ``attn`` the sliding-window attention of
:mod:`.attention` (RoPE, ``persistent_tokens`` learned key/value pairs in front)::

    MAG (default)  o = W_o [RMSNorm_h(attn(x)) * sigmoid(RMSNorm_h(mem(x)))]
    MAL            o = W_o attn(W_m RMSNorm_h(mem(x)))
    LMM            o = W_o RMSNorm_h(mem(x))
    MAC            per segment s of ``window`` tokens, with the memory M*_{s-1} at its start:
                   h = M*_{s-1}(q(x)),  a = attn over [persistent | W_h RMS_h(h) | segment],
                   y = x + W_y a  (the memory learns from y),
                   o = W_o [RMSNorm_h(a) * sigmoid(RMSNorm_h(M_t(q(y_t))))]

Memory heads are split over TP ranks like attention heads and every memory computation is
local to its head. The memory MLP is state, not the tapered site: the block's SwiGLU tapers.
Design, choices and measurements: docs/memory_architectures.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.architectures.titans import GATE_INIT
from tapered_megatron.models.base import Counts, Recomputed, TokenMixer
from tapered_megatron.models.layers import RotaryEmbedding
from tapered_megatron.models.titans.attention import _attend, window_attention
from tapered_megatron.models.titans.ops import _head_rms_norm, conv_silu_normalize, gated_head_norms
from tapered_megatron.models.titans.scan import MemoryState, _state_dtype, memory_scan, mlp_read
from tapered_megatron.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_input,
    copy_to_tp_region,
    get_tensor_model_parallel_world_size,
)
from tapered_megatron.parallel.layers import mark_split, row_layout

GATE_SPREAD_WIDTH = 512  # the gates' init std is held at its value for this width above it


def _per_head(shape: tuple[int, ...], std: float | None = None, fn=None) -> nn.Parameter:
    """A parameter whose first axis is heads (or head-major channels), split over TP ranks."""
    tp = get_tensor_model_parallel_world_size()
    layout = row_layout(shape)
    p = mark_split(nn.Parameter(torch.empty(layout.local_shape(tp))), layout)
    p.init_std = std
    if fn is not None:
        p.init_fn = fn
    return p


def _normal_fan_in(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)


def _uniform_fan_in(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def alpha_half_lives(heads: int, window: int, spread: tuple[float, float]) -> list[float]:
    """Initial forgetting half-lives per head, in tokens: log-spaced from ``spread[0]`` to
    ``spread[1]`` windows (``titans.forget_half_lives``; one head: their geometric mean)."""
    lo, hi = (f * window for f in spread)
    if heads == 1:
        return [math.sqrt(lo * hi)]
    return [lo * (hi / lo) ** (h / (heads - 1)) for h in range(heads)]


def gate_std(init_std: float, d_model: int) -> float:
    """Init std of the gates' weights: ``init_std`` up to ``GATE_SPREAD_WIDTH``, lowered above it
    so that the gate logits' spread over tokens at init, ``std * sqrt(d_model)`` on the
    RMS-normalised input, stays at its value for that width (0.45 at the default ``init_std``
    0.02), so a wide model's fresh memory does not overshoot on repeated input (why 512:
    docs/memory_architectures.md). Models up to d_model 512 are unchanged.
    """
    return init_std * math.sqrt(min(d_model, GATE_SPREAD_WIDTH) / d_model)


def gate_bias_init(
    heads: int, window: int, spread: tuple[float, float], caps: tuple[float, float] = (1.0, 1.0)
) -> torch.Tensor:
    """Full gate bias ``[theta (heads) | eta (heads) | alpha (heads)]`` (logits); ``spread``:
    the forgetting half-lives' range in windows (:func:`alpha_half_lives`); ``caps``: theta's
    and eta's largest values (``theta = caps[0] * sigmoid``), their logits chosen so that they
    start at ``GATE_INIT``."""
    theta, eta = GATE_INIT["theta"] / caps[0], GATE_INIT["eta"] / caps[1]
    halves = alpha_half_lives(heads, window, spread)
    alpha = torch.tensor([1.0 - 2.0 ** (-1.0 / t) for t in halves])
    return torch.cat(
        (
            torch.full((heads,), math.log(theta) - math.log1p(-theta)),
            torch.full((heads,), math.log(eta) - math.log1p(-eta)),
            torch.log(alpha) - torch.log1p(-alpha),
        )
    )


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


class NeuralMemory(Recomputed, nn.Module):
    """The memory branch: q/k/v projections, conv, gates and the memory rule; heads split by TP.

    ``forward(x [B, S, d]) -> [B, S, H_local, head_dim]`` (the raw read-out ``M_t(q_t)``);
    :meth:`segment` continues from a given state (MAC), :meth:`queries` gives read-only queries.
    Selective recompute runs the memory scan again in backward (its per-chunk states and
    intermediates are not kept).
    ``in_context = False`` switches the memory rule off: every token reads the memory it starts
    from (the learned weights ``M_0``), no update, no forgetting (the memory probe,
    :func:`tapered_megatron.models.base.in_context_memory`).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        dm = _dims(cfg)
        t = cfg.model.titans
        std = cfg.model.init_std
        self.dims, self.chunk_size, self.max_norm = dm, t.chunk_size, t.memory_clip
        self.normalized_step, self.backprop_chunks = t.normalized_step, t.backprop_chunks
        self.compiled = cfg.train.compile
        self.selective_recompute = cfg.train.recompute == "selective"
        inner = dm.heads * dm.head_dim
        tp = get_tensor_model_parallel_world_size()
        self.local_heads = dm.heads // tp
        self.qkv = ColumnParallelLinear(
            dm.d, 3 * inner, std=std, out_blocks=(3, inner), split_dim=1
        )
        self.conv = _per_head((3 * inner, t.conv_size), fn=_uniform_fan_in)
        mark_split(self.conv, row_layout((3 * inner, t.conv_size), (3, inner), 1))
        self.gates = ColumnParallelLinear(
            dm.d, 3 * dm.heads, std=gate_std(std, dm.d), out_blocks=(3, dm.heads), split_dim=1
        )
        heads, window, spread = dm.heads, t.window, t.forget_half_lives
        self.caps = (t.max_step, t.max_momentum)
        self.gate_bias = _per_head(
            (3 * heads,), fn=lambda s, g: gate_bias_init(heads, window, spread, self.caps)
        )
        mark_split(self.gate_bias, row_layout((3 * dm.heads,), (3, dm.heads), 1))
        self.memory = nn.ParameterList(
            _per_head((dm.heads, o, i), fn=_normal_fan_in) for o, i in dm.mem_layers
        )
        self.in_context = True
        # training forwards' per-token clip activity: [(clipped, counted)] (diagnostics())
        self.clip_tally: list[torch.Tensor] = []

    def gate_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """theta, eta (at most ``max_step``, ``max_momentum``), alpha, each [B, H_local, S]."""
        g = torch.sigmoid(self.gates(x) + self.gate_bias)  # [B, S, 3 H_local]
        theta, eta, alpha = g.view(*g.shape[:2], 3, self.local_heads).permute(2, 0, 3, 1).unbind(0)
        return theta * self.caps[0], eta * self.caps[1], alpha

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
        if not self.in_context:
            state = self.initial_state(x.dtype) if state is None else state
            return mlp_read(state.weights, q).transpose(1, 2), state, tail
        theta, eta, alpha = self.gate_values(x)
        tally, runs = (self.clip_tally if self.training else None), []

        def scan(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            runs.append(None)  # a recomputation in backward tallies nothing (the first run did)
            start = MemoryState(list(args[6:])) if len(args) > 6 else None
            y, end = memory_scan(
                *args[:6], list(self.memory), self.chunk_size, start, self.compiled,
                tally if len(runs) == 1 else None, self.max_norm, self.normalized_step,
                self.backprop_chunks,
            )  # fmt: skip
            return (y, *end.layers)

        start = [] if state is None else state.layers
        y, *layers = self.recomputed(scan, q, k, v, theta, eta, alpha, *start)
        return y.transpose(1, 2), MemoryState(layers), tail

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """``memory_clip``: (tokens x heads whose memory gradient the per-token clip scaled
        down, tokens x heads) over the training forwards since the last call, which resets it
        (:func:`tapered_megatron.models.base.take_diagnostics`)."""
        out = {"memory_clip": self.clip_tally[0]} if self.clip_tally else {}
        self.clip_tally.clear()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.segment(x, None, None)[0]


class TitansMixer(TokenMixer):
    """Titans token mixer (MAG default; MAL, MAC and LMM by ``cfg.model.titans.variant``).

    ``forward(x [B, S, d]) -> [B, S, d]`` where ``x`` is the block's normalised input.
    """

    # the scan's backward (scan.py) walks the chunks, holding one chunk's state gradients
    backward_share = 0.42

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(cfg, layer)
        m, t = cfg.model, cfg.model.titans
        dm = _dims(cfg)
        std = m.init_std
        out_std = std / math.sqrt(2 * m.layers)
        self.variant, self.window, self.eps = t.variant, t.window, m.norm_eps
        tp = get_tensor_model_parallel_world_size()
        self.local_heads, self.head_dim = m.heads // tp, dm.head_dim
        self.grouped = m.kv_heads != m.heads
        inner = m.heads * dm.head_dim
        self.memory = NeuralMemory(cfg)
        self.mem_norm = _per_head((inner,))
        nn.init.ones_(self.mem_norm)
        self.persistent = None
        if t.variant != "lmm" and self.grouped:  # [q] and [k | v] of the kv_heads heads
            self.attn_q = ColumnParallelLinear(dm.d, inner, std=std, shared_input=True)
            self.attn_kv = ColumnParallelLinear(
                dm.d, 2 * m.kv_heads * dm.head_dim, std=std,
                out_blocks=(2, m.kv_heads, dm.head_dim), split_dim=1, replicate=True,
                shared_input=True,
            )  # fmt: skip
        elif t.variant != "lmm":
            self.attn_qkv = ColumnParallelLinear(
                dm.d, 3 * inner, std=std, out_blocks=(3, inner), split_dim=1
            )
        if t.variant != "lmm":
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
        # kept per token, per head where split by heads: the projections' input x (d); the
        # conv's padded input, output and silu of q k v (9 inner) and q's and k's l2 norms (2);
        # the gate projection (3) and the log-rates (2); the chunk coefficients (the decay and
        # momentum-decay rows of the b x b products, 2 b, and their cumulative exps, 2); the
        # scan's inputs (keys and queries 2 head_dim, |k|^2, theta, the coefficient row b, the
        # rates 2 and the chunk-end weights 2), the chunk-start [M; S] (2P per b tokens) and each
        # chunk's intermediates (_chunk_forward's ``saved``: the first layer's key and query
        # products 4 out_0, per later layer its activation, silu derivative, dM, read-out silu
        # and derivative (5 in_l), the pre-activations between, the deltas, the read-outs
        # through [M_0; S_0] (2 out_l), the b score rows per layer, three clip scalars)
        outs, ins = [o for o, _ in dm.mem_layers], [i for _, i in dm.mem_layers]
        chunk = 4 * outs[0] + 5 * sum(ins[1:]) + sum(outs[1:-1]) + sum(outs) + 2 * sum(outs[1:])
        scan = 2 * dm.head_dim + 2 + b + 4 + 2 * mem_p / b + chunk + dm.depth * b + 3
        # (the log-rates, coefficients and scan in fp32 whatever the activation dtype)
        scan_bytes = max(4, dtype_bytes) * h * (2 + 2 * b + 2 + scan)
        elems = d + 9 * inner + h * (2 + 3) + inner  # + W_o's input
        if t.variant == "lmm":
            elems += inner + h  # the read-out, its rms
        kv_params = 0  # key/value projections of the attention
        # selective recompute runs the scan again in backward: its inputs stay, everything it
        # keeps inside (log-rates, coefficients, the scan's tensors) goes
        core, core_flops = 0.0, 2.0 * mem_macs
        if t.variant != "lmm":
            n_p = t.persistent_tokens
            if t.variant == "mac":  # persistent + memory tokens and the segment, causal in both
                seg = [min(t.window, s - i) for i in range(0, s, t.window)]
                ctx = n_p + sum(2 * c * (c + 1) / 2 for c in seg) / s
            else:
                ctx = n_p + sum(min(i + 1, t.window) for i in range(s)) / s
            kv_params = 2 * d * m.kv_heads * dm.head_dim
            params += d * inner + kv_params + 2 * n_p * inner
            flops += 2.0 * (d * inner + kv_params) + 2 * 2 * inner * ctx
            # the q k v projection's output and q, k after RoPE (k, v repeated to every query
            # head); beyond the first window the blocks' queries and their keys and values over
            # two windows (mac: its own segments, counted below); the attention output and its
            # log-sum-exp
            blocks = max(0, s - t.window) / s if t.variant != "mac" else 0
            elems += 6 * inner + 5 * inner * blocks + h
            # selective recompute keeps the projections' output and the core's output, frees
            # q and k after RoPE, the blocks' tensors, the attention's output and log-sum-exp
            core, core_flops = 3 * inner + 5 * inner * blocks + h, 2 * 2 * inner * ctx
        if t.variant in ("mag", "mac"):
            params += inner
            elems += 3 * inner + 2 * h  # the gated norms' inputs and sigmoid, two rms
        if t.variant == "mal":
            params += inner * d
            flops += 2.0 * inner * d
            elems += d
        if t.variant == "mac":
            # W_h, W_y; per token: retrieval q projection + conv + memory read, W_h, the K/V
            # projections of the memory tokens, W_y
            params += 2 * inner * d
            retrieve = d * inner + inner * t.conv_size + h * mem_p
            flops += 2.0 * (retrieve + inner * d + kv_params + inner * d)
            elems += 2 * inner + h * hidden + 3 * d + 2 * inner  # query, read, tokens, k/v, y
        params += inner * d  # output projection
        flops += 2.0 * inner * d
        act = elems * dtype_bytes + scan_bytes
        return Counts(
            int(params), float(flops), float(act), kv_params=kv_params,
            core_bytes=core * dtype_bytes + scan_bytes, core_flops=core_flops,
        )  # fmt: skip

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q, k, v ``[B, S, H, D]`` (k and v repeated to every query head)."""
        bsz, seq, _ = x.shape
        if not self.grouped:
            qkv = self.attn_qkv(x).view(bsz, seq, 3, self.local_heads, self.head_dim)
            return qkv.unbind(2)
        x = column_input(x)
        q = self.attn_q(x).view(bsz, seq, self.local_heads, self.head_dim)
        return (q, *self._repeat_kv(self.attn_kv(x)))

    def _repeat_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[B, S, H, D]`` from this rank's ``[k | v]`` projection output (each key/value
        head repeated for the query heads of its group)."""
        bsz, seq, _ = kv.shape
        k, v = kv.view(bsz, seq, 2, -1, self.head_dim).unbind(2)
        group = self.local_heads // k.shape[2]
        return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """Sliding-window attention of ``x`` (MAG, MAL), persistent tokens in front (the core
        selective recompute runs again: RoPE and the windowed attention)."""

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return window_attention(self.rope(q), self.rope(k), v, self.window, self.persistent)

        return self.recomputed(core, *self._qkv(x))

    def _mac(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory as context, segment by segment (module doc); returns the attention output and
        the memory read-out, both [B, S, H, D]."""
        bsz, seq, _ = x.shape
        n = self.local_heads * self.head_dim
        queries = self.memory.queries(x)
        aq, ak, av = self._qkv(x)
        state, tail = None, None
        attn, read = [], []
        for start in range(0, seq, self.window):
            end = min(start + self.window, seq)
            c = end - start
            if state is None:
                state = self.memory.initial_state(x.dtype)
            hm = mlp_read(state.weights, queries[:, :, start:end]).transpose(1, 2)
            tokens = self.mem_tokens(_head_rms_norm(hm, None, self.eps).reshape(bsz, c, n))
            mk, mv = self._memory_kv(tokens)
            a = self.recomputed(
                self._segment_attention,
                aq[:, start:end],
                ak[:, start:end],
                av[:, start:end],
                mk,
                mv,
            )
            y = x[:, start:end] + self.attn_proj(a.reshape(bsz, c, n))  # residual form
            r, state, tail = self.memory.segment(y, state, tail)
            attn.append(a)
            read.append(r)
        return torch.cat(attn, dim=1), torch.cat(read, dim=1)

    def _memory_kv(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[B, c, H, D]`` of MAC's memory tokens: the attention's own k/v projection."""
        bsz, c, _ = tokens.shape
        if self.grouped:
            return self._repeat_kv(self.attn_kv(column_input(tokens)))
        n = self.local_heads * self.head_dim
        kv = F.linear(copy_to_tp_region(tokens), self.attn_qkv.weight[n:])  # its k and v rows
        return kv.view(bsz, c, 2, self.local_heads, self.head_dim).unbind(2)

    def _segment_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mk: torch.Tensor, mv: torch.Tensor
    ) -> torch.Tensor:
        """MAC's attention core of one segment: its queries over the memory tokens' keys and
        values ``mk``, ``mv`` and its own (causal in both), persistent tokens in front."""
        c = q.shape[1]
        tril = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        return _attend(
            self.rope(q),
            torch.cat((self.rope(mk), self.rope(k)), dim=1),
            torch.cat((mv, v), dim=1),
            torch.cat((tril, tril), dim=1),
            self.persistent,
        )

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
