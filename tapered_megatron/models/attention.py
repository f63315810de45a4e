"""Causal softmax attention (``transformer``) and gated attention (``gated_attention``).

Both use one fused column-parallel projection whose full weight is laid out head-major: for each
head ``[q (head_dim) | gate (g) | k (head_dim) | v (head_dim)]`` (g = 0 without a gate), so a TP
rank holds whole heads and the same full weight splits correctly at any TP size. With
grouped-query attention (``model.kv_heads`` below ``model.heads``) the projection is two: ``q``
(``[q | gate]`` per query head, split over TP) and ``kv`` (``[k | v]`` per key/value head, split
over TP when the TP size divides ``kv_heads``, else replicated, each rank computing the head its
query heads read); both enter the TP region once. RoPE is applied
to q and k; attention is ``F.scaled_dot_product_attention(..., is_causal=True)`` (flash / fused
kernels where the backend has them); the output projection is row-parallel. Under sequence
parallelism the fused projection all-gathers the sequence shards and the output projection
reduce-scatters them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tapered_megatron.models.base import Counts, TokenMixer, sequence_parallel
from tapered_megatron.models.layers import RotaryEmbedding
from tapered_megatron.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_input,
    get_tensor_model_parallel_world_size,
)

if TYPE_CHECKING:
    from tapered_megatron.config import Config


class Attention(TokenMixer):
    """Llama-style causal self-attention with RoPE, no biases (Transformer++); grouped-query
    attention when ``model.kv_heads`` is below ``model.heads`` (query head ``i`` reads key/value
    head ``i // (heads / kv_heads)``)."""

    takes_sequence_shards = True

    def __init__(self, cfg: Config, layer: int) -> None:
        super().__init__(cfg, layer)
        m = cfg.model
        tp = get_tensor_model_parallel_world_size()
        self.sequence_parallel = sp = sequence_parallel(cfg)
        self.heads = m.heads // tp  # local query heads
        self.kv_heads = max(m.kv_heads // tp, 1)  # local key/value heads (replicated below tp)
        self.grouped = m.kv_heads != m.heads
        self.head_dim = hd = m.head_dim
        self.gate_dim = g = self.gate_channels(cfg)
        if self.grouped:  # [q | gate] per query head, [k | v] per key/value head
            self.q = ColumnParallelLinear(
                m.d_model, m.heads * (hd + g), std=m.init_std, out_blocks=(m.heads, hd + g),
                shared_input=True,
            )  # fmt: skip
            self.kv = ColumnParallelLinear(
                m.d_model, m.kv_heads * 2 * hd, std=m.init_std, out_blocks=(m.kv_heads, 2 * hd),
                replicate=True, shared_input=True,
            )  # fmt: skip
        else:  # one fused head-major [q | gate | k | v] projection
            self.qkv = ColumnParallelLinear(
                m.d_model, m.heads * (3 * hd + g), std=m.init_std,
                out_blocks=(m.heads, 3 * hd + g), sequence_parallel=sp,
            )  # fmt: skip
        self.out = RowParallelLinear(
            m.heads * m.head_dim,
            m.d_model,
            std=m.init_std / math.sqrt(2 * m.layers),
            sequence_parallel=sp,
        )
        self.rope = RotaryEmbedding(m.head_dim, m.seq_len, m.rope_theta)

    @staticmethod
    def gate_channels(cfg: Config) -> int:
        """Gate values per head (0: no gate)."""
        return 0

    def project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q, gate ``[b, s, heads, .]`` and k, v ``[b, s, kv_heads, head_dim]`` of
        ``x`` (before RoPE; under sequence parallelism of the whole sequence, gathered)."""
        hd = self.head_dim
        if not self.grouped:
            y = self.qkv(x)
            b, s = y.shape[:2]  # the whole sequence (x may be this rank's part of it)
            return y.view(b, s, self.heads, -1).split((hd, self.gate_dim, hd, hd), dim=-1)
        x = column_input(x, self.sequence_parallel)
        b, s, _ = x.shape
        q, g = self.q(x).view(b, s, self.heads, -1).split((hd, self.gate_dim), dim=-1)
        k, v = self.kv(x).view(b, s, self.kv_heads, 2 * hd).split((hd, hd), dim=-1)
        return q, g, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, g, k, v = self.project(x)
        b, s = q.shape[:2]  # the whole sequence (x may be this rank's part of it)
        o = self.recomputed(self.core, q, g, k, v)
        return self.out(o.reshape(b, s, self.heads * self.head_dim))

    def core(
        self, q: torch.Tensor, g: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The attention core: :meth:`project`'s outputs -> the (gated) attention output
        ``[b, s, heads, head_dim]`` (RoPE, SDPA, the gate); what selective recompute runs again
        in backward."""
        q, k = self.rope(q), self.rope(k)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.grouped,
        ).transpose(1, 2)
        return self.gate(o, g)

    def gate(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Hook applied to the attention output ``[b, s, heads, head_dim]`` (identity here)."""
        return o

    @classmethod
    def counts(cls, cfg: Config, layer: int, dtype_bytes: int = 2) -> Counts:
        m = cfg.model
        d, h, g = m.d_model, m.heads, cls.gate_channels(cfg)
        kv = 2 * m.kv_heads * m.head_dim  # key and value channels
        kv_params = d * kv
        params = d * h * (m.head_dim + g) + kv_params + d * d
        # scores q.k and the weighted sum of v over the mean causal context (s + 1) / 2, for
        # every query head (grouped-query attention shares k and v, not these products)
        attn_flops = 2 * 2 * d * (m.seq_len + 1) / 2
        # kept: the projections' input (d); the fused projection's output ([q | gate], k, v:
        # v is a view of it), q and k after RoPE, the attention output (also the
        # out-projection's input) and its log-sum-exp (h, fp32); a gate adds sigmoid(g) (h g)
        # and the gated output (the out-projection's input). RoPE's tables are per sequence
        # (the cost model's rope_table_bytes).
        inner = h * m.head_dim
        elems = d + (inner + h * g + kv) + (inner + kv // 2) + inner
        if g:
            elems += h * g + inner
        # selective recompute runs the core (RoPE, scores, weighted sum, gate) again in
        # backward: it frees q and k after RoPE, the log-sum-exp, sigmoid(g) and the ungated
        # output (the projection's output and the core's output stay)
        core = inner + kv // 2 + (h * g + inner if g else 0)
        b, lse = dtype_bytes, 4.0 * h
        return Counts(
            params,
            2.0 * params + attn_flops,
            float(elems * b + lse),
            kv_params=kv_params,
            core_bytes=float(core * b + lse),
            core_flops=attn_flops,
        )


class GatedAttention(Attention):
    """Gated attention (Qiu et al. 2025, "G1" as in Qwen3-Next): ``o_h * sigmoid(X W_g,h)``.

    The gate multiplies each head's attention output after scaled-dot-product attention and
    before the output projection; ``X`` is the same normalised block input that feeds Q/K/V, so
    the gate is query-dependent and head-specific. Choices the papers leave open, fixed here:

    * granularity: ``model.gate = elementwise`` (default, one gate per head dimension, the paper's
      best) or ``headwise`` (one scalar per head, broadcast over its head_dim);
    * activation sigmoid (not SiLU), combined multiplicatively (not additively);
    * the gate projection is part of the widened query projection (per head ``[q | gate]``, the
      Qwen3-Next habit), no bias (the spec's no-bias rule), initialised like q: normal(0,
      init_std), so gates start near 0.5 and no special gate-bias init is used;
    * no QK-norm (Qwen3-Next adds one; the spec does not), no attention-sink tokens;
    * the gate is computed in the activation dtype and TP-split with its heads;
    * RoPE, causal masking and the output projection are unchanged from ``transformer``.
    """

    @staticmethod
    def gate_channels(cfg: Config) -> int:
        return cfg.model.head_dim if cfg.model.gate == "elementwise" else 1

    def gate(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return o * torch.sigmoid(g)
