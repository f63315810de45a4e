"""Building blocks shared by the architectures: RMSNorm, rotary position embedding, SiLU's
derivative (for the hand-written backward passes of the memory modules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.parallel import copy_to_tp_region


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm with a hand-written backward: about half the kernels of autograd's decomposition
    of ``F.rms_norm`` in eager mode, which pays at small widths on CPU. Row sums of products are
    single-pass dot products (``vecdot``), with no temporary of the input's size."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32
        ms = torch.linalg.vecdot(xf, xf).unsqueeze(-1).div_(xf.shape[-1])
        rstd = ms.add_(eps).rsqrt_()
        xhat = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors
        grad_w = (grad * xhat).sum(dim=tuple(range(grad.dim() - 1)))
        gxhat = (grad * weight).to(rstd.dtype)
        xh = xhat.to(rstd.dtype)
        mean = torch.linalg.vecdot(gxhat, xh).unsqueeze(-1).div_(-xh.shape[-1])
        grad_x = torch.addcmul(gxhat, xh, mean).mul_(rstd)
        return grad_x.to(grad.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """``x / rms(x) * g`` over the last dimension (gain ``g`` starts at one, no bias).

    ``sequence_parallel``: ``x`` is this rank's part of the sequence, so the gain's gradient is
    summed over the TP group. The flag is the module's (loaders such as ``from_pretrained`` may
    replace the parameter object); the gain also carries it as Megatron's parameter attribute.
    """

    def __init__(self, dim: int, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tp_region(self.weight) if self.sequence_parallel else self.weight
        if torch.compiler.is_compiling():
            return F.rms_norm(x, w.shape, w, self.eps)
        return _RMSNormFn.apply(x, w, self.eps)


def silu_parts(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(z)`` and its derivative ``silu'(z) = s + silu(z) (1 - s)`` (``s = sigmoid(z)``)."""
    s = torch.sigmoid(z)
    a = z * s
    return a, torch.addcmul(s, a, 1 - s)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[seq_len, head_dim / 2]`` (fp32) of rotary embedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, adjacent pairs ``(2i, 2i+1)`` rotated (Meta Llama convention).

    Eager: one complex multiplication (fewer kernels than the "rotate half" form that Hugging
    Face uses; converting HF weights permutes the q/k rows as HF's own converter does). Under
    ``torch.compile`` the same rotation in real arithmetic, which inductor fuses.
    Computed in fp32 and cast back. Tables are non-persistent fp32 buffers sized for ``seq_len``
    and regrown on demand for longer inputs.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        cos, sin = rope_tables(head_dim, seq_len, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[b, s, heads, head_dim]`` by position along ``s``."""
        s = x.shape[1]
        if s > self.cos.shape[0]:
            cos, sin = rope_tables(self.head_dim, s, self.theta)
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        cos, sin = self.cos[:s, None, :].float(), self.sin[:s, None, :].float()
        xf = x.float()
        if torch.compiler.is_compiling():  # inductor fuses the real form (it has no complex ops)
            x0, x1 = xf.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
            return out.type_as(x)
        if xf.storage_offset() % 2 or any(st % 2 for st in xf.stride()[:-1]):
            xf = xf.contiguous()  # complex views need even strides
        xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
        return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2).type_as(x)
