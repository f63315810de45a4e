"""Titans' sliding-window attention: the blocked form equals the dense-mask form it replaced
(outputs and gradients, fp32), and every SDPA call it makes is one a fused kernel takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tapered_megatron.models.titans import window_attention


def dense_mask_reference(q, k, v, window, persistent):
    """The previous implementation: a dense [S, S] boolean window mask (or ``is_causal`` when
    the window covers the sequence), and from four windows per sequence queries by blocks with
    a per-block mask expanded over the batch."""
    bsz, seq, heads, dim = q.shape

    def attend(q, k, v, mask):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if persistent is not None:
            p = persistent.to(k.dtype).unsqueeze(0).expand(k.shape[0], -1, -1, -1, -1)
            k, v = torch.cat((p[:, :, 0], k), dim=2), torch.cat((p[:, :, 1], v), dim=2)
            ones = torch.ones(mask.shape[0], persistent.shape[2], dtype=torch.bool)
            mask = torch.cat((ones, mask), dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)

    if window >= seq and persistent is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return o.transpose(1, 2)
    if seq < 4 * window:
        i = torch.arange(seq)
        return attend(q, k, v, (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window))
    n = -(-seq // window)
    pad = n * window - seq
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    shape = (bsz, n, window, heads, dim)
    q, k, v = (t.reshape(shape) for t in (q, k, v))
    keys, values = (torch.cat((F.pad(t[:, :-1], (0, 0, 0, 0, 0, 0, 1, 0)), t), 2) for t in (k, v))
    i = torch.arange(window)
    j = torch.arange(2 * window)
    mask = ((j > i[:, None]) & (j <= i[:, None] + window)).expand(n, window, 2 * window).clone()
    mask[0, :, :window] = False
    if persistent is not None:
        p = persistent.to(k.dtype).permute(1, 2, 0, 3)
        p = p[:, None, None].expand(-1, bsz, n, -1, -1, -1)
        keys, values = torch.cat((p[0], keys), 2), torch.cat((p[1], values), 2)
        mask = torch.cat((torch.ones(n, window, persistent.shape[2], dtype=torch.bool), mask), 2)
    ctx = keys.shape[2]
    mask = mask.unsqueeze(1).expand(bsz, n, 1, window, ctx).reshape(bsz * n, 1, window, ctx)
    o = F.scaled_dot_product_attention(
        q.view(bsz * n, window, heads, dim).transpose(1, 2),
        keys.view(bsz * n, ctx, heads, dim).transpose(1, 2),
        values.view(bsz * n, ctx, heads, dim).transpose(1, 2),
        attn_mask=mask,
    )
    return o.transpose(1, 2).reshape(bsz, n * window, heads, dim)[:, :seq]


# (batch, seq, window, persistent tokens): seq a multiple of the window or not, 1-3 windows
# (the old dense-mask form) and more (its blocked form), window >= seq, window 1
SHAPES = [
    (2, 32, 8, 0),
    (2, 29, 5, 0),
    (3, 24, 8, 0),
    (2, 20, 8, 0),
    (2, 12, 16, 0),
    (1, 16, 16, 0),
    (2, 9, 1, 0),
    (2, 29, 5, 2),
    (2, 24, 8, 3),
    (2, 10, 16, 2),
]


def _inputs(bsz: int, seq: int, persistent: int, heads: int = 3, dim: int = 8):
    g = torch.Generator().manual_seed(seq * 31 + persistent)
    qkv = [torch.randn(bsz, seq, heads, dim, generator=g) for _ in "qkv"]
    p = torch.randn(heads, 2, persistent, dim, generator=g) if persistent else None
    return qkv, p


@pytest.mark.parametrize("bsz, seq, window, persistent", SHAPES)
def test_equals_dense_mask_form_fp32(bsz, seq, window, persistent):
    """Outputs and the gradients of q, k, v and the persistent pairs equal the dense-mask
    form's within 1e-6 in fp32."""
    qkv, p = _inputs(bsz, seq, persistent)
    leaves = [t.requires_grad_() for t in qkv + ([p] if p is not None else [])]
    got = window_attention(*qkv, window, p)
    ref = dense_mask_reference(*qkv, window, p)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bsz, seq, window, persistent", SHAPES)
def test_every_call_takes_a_fused_kernel(bsz, seq, window, persistent, monkeypatch):
    """Each SDPA call is mask-free causal (flash) or carries one [w, N + 2w] band mask shared
    by every block, sequence and head (no [S, S] mask, nothing expanded over the batch), and
    forward and backward run with the math backend excluded."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    qkv, p = _inputs(bsz, seq, persistent)
    qkv = [t.requires_grad_() for t in qkv]
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if torch.cuda.is_available():  # the GPU's flash and efficient kernels, in bf16
        qkv = [t.cuda().bfloat16() for t in qkv]
        p = None if p is None else p.cuda().bfloat16()
    with sdpa_kernel(fused):
        window_attention(*qkv, window, p).sum().backward()
    w = min(window, seq)
    expected = [((w, persistent + w), False) if persistent else (None, True)]
    if seq > w:
        expected.append(((w, persistent + 2 * w), False))
    assert calls == expected
