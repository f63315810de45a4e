"""Sliding-window causal softmax attention of the Titans mixer (MAG, MAL) and the masked
attention of MAC's segments, with learned persistent key/value pairs prepended::

    o_t = softmax(q_t [P_k | K_{(t-w, t]}]^T / sqrt(D)) [P_v | V_{(t-w, t]}]

Queries go in blocks of the window, so the scores cover ``2 S w`` pairs (not ``S^2``) under one
``O(w^2)`` band mask, and SDPA's fused kernels run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
