"""Cross-entropy over vocabulary-parallel logits (Megatron's ``vocab_parallel_cross_entropy``).

Each TP rank holds the logits of its contiguous vocabulary slice; the max, the target logit and
the softmax denominator are all-reduced over the TP group, so the full logits are never
materialised. Backward is ``softmax - one_hot(target)`` on the local slice. With TP 1 this is the
ordinary (fused) cross-entropy, computed in fp32.
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


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = get_tensor_model_parallel_rank() * vocab_local
        logits_max = logits.max(dim=-1).values
        _all_reduce(logits_max, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        _all_reduce(predicted, dist.ReduceOp.SUM)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM)
        loss = sum_exp.log() - predicted

        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``[...]`` from local logits ``[..., vocab/tp]`` and global ids ``[...]``."""
    if get_tensor_model_parallel_world_size() == 1:  # torch's fused kernel is faster
        flat = logits.float().reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target)
