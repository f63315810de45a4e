"""Cross-entropy over vocabulary-parallel logits (Megatron's ``vocab_parallel_cross_entropy``).

Each TP rank holds the logits of its contiguous vocabulary slice; the max, the target logit and
the softmax denominator are all-reduced over the TP group, so the full logits are never
materialised. Backward is ``softmax - one_hot(target)`` on the local slice. Computed in fp32.
:func:`vocab_parallel_linear_cross_entropy_mean` also fuses the LM head in, token chunk by token
chunk, so not even the local logits exist beyond one chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tapered_megatron.autocast import autocast_off, autocast_operands
from tapered_megatron.parallel.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp) -> None:
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=get_tensor_model_parallel_group())


def _ce_stats(logits: torch.Tensor, target: torch.Tensor):
    """Per-token loss from fp32 local logits, which it overwrites with ``exp(logits - max)``.

    Returns ``(loss, exp, sum_exp, local_target, outside)``: what :func:`_ce_grad_` needs, with
    the max, the target logit and the row sums all-reduced over the TP group.
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
    loss = sum_exp.log().add_(logits_max.squeeze(-1)).sub_(predicted)
    return loss, exp, sum_exp, local_target, outside


def _ce_grad_(exp, sum_exp, local_target, outside, grad_loss: torch.Tensor) -> torch.Tensor:
    """``grad_loss * (softmax - one_hot(target))``, made in place in the ``exp`` buffer."""
    grad_loss = grad_loss.float()
    grad = exp.mul_((grad_loss / sum_exp).unsqueeze(-1))
    hit = grad_loss if outside is None else grad_loss.masked_fill(outside, 0.0)
    return grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss and its gradient over the local vocabulary slice, all in fp32.

    Forward keeps ``exp(logits - max)`` (unnormalised) and its row sums; backward turns them into
    ``grad_loss * (softmax - one_hot(target))`` in one pass over that buffer (so one backward
    pass per forward).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx.dtype = logits.dtype
        loss, *ctx.ce_saved = _ce_stats(logits.to(torch.float32, copy=True), target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        saved = getattr(ctx, "ce_saved", None)
        if saved is None:
            raise RuntimeError("vocab-parallel cross-entropy: one backward pass per forward")
        ctx.ce_saved = None
        return _ce_grad_(*saved, grad_loss).to(ctx.dtype), None


#: Bytes of fp32 logits one chunk of the fused LM-head loss materialises.
CHUNK_BYTES = 16 * 2**20


class _LinearCEMean(torch.autograd.Function):
    """``sum_t w_t * CE(h_t W^T, target_t)`` with both gradients made during the forward pass.

    Tokens are taken in chunks whose fp32 logits fit in :data:`CHUNK_BYTES`: each chunk's
    logits are computed, reduced to its loss, turned into ``w_t * (softmax - one_hot)`` in the
    same buffer and multiplied into ``grad_h`` and ``grad_W`` while still in cache. Nothing of
    logits size outlives the chunk; backward only scales the two saved gradients.
    """

    @staticmethod
    def forward(ctx, h, weight, target, token_weight, chunk_tokens, need_grad):
        n, vocab_local = h.shape[0], weight.shape[0]
        chunk = max(1, min(n, chunk_tokens))
        buf = torch.empty(chunk, vocab_local, dtype=torch.float32, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        fp32 = weight.dtype == torch.float32 and h.dtype == torch.float32  # products into buffers
        grad_h = grad_w = None
        if need_grad:
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            h_c = h[s : s + chunk]
            logits = buf[: h_c.shape[0]]
            if fp32:
                torch.mm(h_c, weight.t(), out=logits)
            else:
                logits.copy_(torch.mm(h_c, weight.t()))
            w_c = token_weight[s : s + chunk]
            per_token, *stats = _ce_stats(logits, target[s : s + chunk])
            loss += torch.dot(per_token, w_c)
            if need_grad:
                g = _ce_grad_(*stats, w_c)
                if fp32:
                    torch.mm(g, weight, out=grad_h[s : s + chunk])
                    grad_w.addmm_(g.t(), h_c)
                else:
                    g = g.to(weight.dtype)
                    grad_h[s : s + chunk] = torch.mm(g, weight)
                    grad_w += torch.mm(g.t(), h_c)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        grad_loss = grad_loss.float()  # fp16's loss scale (65536) is not an fp16 number
        return (
            (grad_h * grad_loss).to(grad_h.dtype),
            (grad_w * grad_loss).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )


@torch.compiler.disable  # a loop of extern kernels: nothing for inductor to fuse
def vocab_parallel_linear_cross_entropy_mean(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Mean (or ``loss_mask``-weighted mean) of ``vocab_parallel_cross_entropy(F.linear(h,
    weight), target)``, fused and chunked: no logits-sized tensor is kept for backward.

    ``h`` ``[..., d]`` is already in the TP region (after ``copy_to_tp_region``), ``weight`` is
    this rank's vocabulary rows ``[vocab/tp, d]``, ``target`` and ``loss_mask`` are ``[...]``.
    ``chunk_tokens`` defaults to the most tokens whose fp32 logits fit in :data:`CHUNK_BYTES`.
    Gradients are made in the forward pass when either input requires them and grad mode is
    on (not under ``torch.no_grad``, e.g. in validation), so the memory of the loss is two
    gradient-sized tensors instead of the logits.
    """
    h2 = h.reshape(-1, h.shape[-1])
    target = target.reshape(-1)
    if loss_mask is None:
        token_weight = torch.full(target.shape, 1.0 / target.numel(), device=h.device)
    else:
        mask = loss_mask.reshape(-1).to(device=h.device, dtype=torch.float32)
        token_weight = mask / mask.sum().clamp(min=1.0)
    if chunk_tokens is None:
        chunk_tokens = CHUNK_BYTES // (4 * weight.shape[0])
    h2, weight = autocast_operands(h2, weight)
    # forward runs with grad mode off: decide here (no gradients made under no_grad / eval)
    need_grad = torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad)
    with autocast_off(h.device):
        return _LinearCEMean.apply(h2, weight, target, token_weight, chunk_tokens, need_grad)


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
