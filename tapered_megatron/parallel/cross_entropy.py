"""Cross-entropy over vocabulary-parallel logits (Megatron's ``vocab_parallel_cross_entropy``).

Each TP rank holds the logits of its contiguous vocabulary slice; the max, the target logit and
the softmax denominator are all-reduced over the TP group, so the full logits are never
materialised. Backward is ``softmax - one_hot(target)`` on the local slice. Computed in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tapered_megatron.parallel.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=get_tensor_model_parallel_group())


def _ce_forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss from fp32 local logits, which it overwrites with ``exp(logits - max)``.

    Saves that buffer and its (all-reduced) row sums on ``ctx`` for :func:`_ce_grad`.
    """
    vocab_local = logits.shape[-1]
    logits_max = logits.amax(dim=-1, keepdim=True)
    _all_reduce(logits_max, dist.ReduceOp.MAX)
    if get_tensor_model_parallel_world_size() == 1:
        local_target, outside = target, None
        predicted = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    else:
        start = get_tensor_model_parallel_rank() * vocab_local
        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
    _all_reduce(predicted, dist.ReduceOp.SUM)
    exp = logits.sub_(logits_max).exp_()
    sum_exp = exp.sum(dim=-1)
    _all_reduce(sum_exp, dist.ReduceOp.SUM)
    ctx.ce_saved = (exp, sum_exp, local_target, outside)
    return sum_exp.log().add_(logits_max.squeeze(-1)).sub_(predicted)


def _ce_grad(ctx, grad_loss: torch.Tensor) -> torch.Tensor:
    """``grad_loss * (softmax - one_hot(target))`` in the saved buffer (in place: one backward)."""
    saved = getattr(ctx, "ce_saved", None)
    if saved is None:
        raise RuntimeError("vocab-parallel cross-entropy supports one backward pass per forward")
    exp, sum_exp, local_target, outside = saved
    ctx.ce_saved = None
    grad_loss = grad_loss.float()
    grad = exp.mul_((grad_loss / sum_exp).unsqueeze(-1))
    hit = grad_loss if outside is None else grad_loss.masked_fill(outside, 0.0)
    return grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss and its gradient over the local vocabulary slice, all in fp32.

    Forward keeps ``exp(logits - max)`` (unnormalised) and its row sums; backward turns them into
    ``grad_loss * (softmax - one_hot(target))`` in one pass over that buffer.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx.dtype = logits.dtype
        return _ce_forward(ctx, logits.to(torch.float32, copy=True), target)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        return _ce_grad(ctx, grad_loss).to(ctx.dtype), None


class _LinearCE(torch.autograd.Function):
    """``_VocabParallelCE(h W^T, target)`` without a separate logits tensor: the projection's
    output buffer becomes the saved ``exp`` buffer, and backward's ``grad_logits`` is made in
    it before the two matmuls of the projection's backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight)
        if logits.dtype != torch.float32:
            logits = logits.float()
        ctx.save_for_backward(h, weight)
        return _ce_forward(ctx, logits, target)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight = ctx.saved_tensors
        grad = _ce_grad(ctx, grad_loss).to(weight.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_h = g2.mm(weight).view(h.shape)
        grad_w = g2.t().mm(h.reshape(-1, h.shape[-1]))
        return grad_h, grad_w, None


def vocab_parallel_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(h, weight), target)``, fused (eager).

    ``h`` ``[..., d]`` is already in the TP region (after ``copy_to_tp_region``), ``weight`` is
    this rank's vocabulary rows ``[vocab/tp, d]``. Saves one logits-sized tensor and one pass
    over it; under ``torch.compile`` the unfused form (inductor fuses it).
    """
    if torch.compiler.is_compiling():
        return vocab_parallel_cross_entropy(F.linear(h, weight), target)
    return _LinearCE.apply(h, weight, target)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``[...]`` from local logits ``[..., vocab/tp]`` and global ids ``[...]``.

    Eager: :class:`_VocabParallelCE` at any TP size (at TP 1 about half the passes over the
    logits of ``F.cross_entropy``'s log-softmax + NLL, forward and backward). Under
    ``torch.compile`` with TP 1: ``F.cross_entropy``, which inductor fuses.
    """
    if get_tensor_model_parallel_world_size() == 1 and torch.compiler.is_compiling():
        flat = logits.float().reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target)
