"""Autograd-aware communication across the tensor-parallel group: Megatron's four mappings and
the three of sequence parallelism.

=====================  ==========================  ==========================
function               forward                     backward
=====================  ==========================  ==========================
copy_to_tp_region      identity                    all-reduce (sum)
reduce_from_tp_region  all-reduce (sum)            identity
scatter_to_tp_region   keep this rank's last-dim   all-gather along last dim
gather_from_tp_region  all-gather along last dim   keep this rank's slice
=====================  ==========================  ==========================

Under sequence parallelism the activations outside the TP regions are split along the sequence
(dimension 1 of ``[b, s, d]``) over the TP group; the mappings between the two forms:

==========================================  ==========================  ==========================
function                                    forward                     backward
==========================================  ==========================  ==========================
scatter_to_sequence_parallel_region         keep this rank's s-slice    all-gather along s
gather_from_sequence_parallel_region        all-gather along s          reduce-scatter along s
                                                                        (``grad_partial``, the
                                                                        default) or keep the slice
reduce_scatter_to_sequence_parallel_region  reduce-scatter along s      all-gather along s
==========================================  ==========================  ==========================

All are identities when the TP size is 1, so single-process models pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tapered_megatron.parallel.topology import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def _reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tensor_model_parallel_world_size() == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=get_tensor_model_parallel_group())
    return out


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    return x.chunk(tp, dim=dim)[get_tensor_model_parallel_rank()].contiguous()


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _check_seq_divisible(x: torch.Tensor) -> None:
    tp = get_tensor_model_parallel_world_size()
    if x.shape[1] % tp:
        raise ValueError(
            f"sequence parallelism splits the sequence over {tp} TP ranks, but this input has "
            f"{x.shape[1]} positions; use a sequence length divisible by parallel.tp"
        )


def _split_last(x: torch.Tensor) -> torch.Tensor:
    return _split(x, -1)


def _gather_last(x: torch.Tensor) -> torch.Tensor:
    return _gather(x, -1)


def _split_seq(x: torch.Tensor) -> torch.Tensor:
    _check_seq_divisible(x)
    return _split(x, 1)


def _gather_seq(x: torch.Tensor) -> torch.Tensor:
    return _gather(x, 1)


def _reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    _check_seq_divisible(x)
    parts = [c.contiguous() for c in x.chunk(get_tensor_model_parallel_world_size(), dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=get_tensor_model_parallel_group())
    return out


def _function(
    name: str,
    forward: Callable[[torch.Tensor], torch.Tensor],
    backward: Callable[[torch.Tensor], torch.Tensor],
) -> type[torch.autograd.Function]:
    """An autograd Function of one tensor that applies ``forward`` to it and ``backward`` to
    its gradient."""
    return type(
        name,
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda ctx, x: forward(x)),
            "backward": staticmethod(lambda ctx, g: backward(g)),
        },
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


_Copy = _function("_Copy", _identity, _reduce)
_Reduce = _function("_Reduce", _reduce, _identity)
_Scatter = _function("_Scatter", _split_last, _gather_last)
_Gather = _function("_Gather", _gather_last, _split_last)
_ScatterSeq = _function("_ScatterSeq", _split_seq, _gather_seq)
_ReduceScatterSeq = _function("_ReduceScatterSeq", _reduce_scatter_seq, _gather_seq)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grad_partial):
        ctx.grad_partial = grad_partial
        return _gather_seq(x)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter_seq(g) if ctx.grad_partial else _split_seq(g)), None


def copy_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Enter a TP region: identity forward, all-reduce of the gradient backward."""
    return x if get_tensor_model_parallel_world_size() == 1 else _Copy.apply(x)


def reduce_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return x if get_tensor_model_parallel_world_size() == 1 else _Reduce.apply(x)


def scatter_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers the gradient."""
    return x if get_tensor_model_parallel_world_size() == 1 else _Scatter.apply(x)


def gather_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather the last dimension; backward keeps this rank's slice of the gradient."""
    return x if get_tensor_model_parallel_world_size() == 1 else _Gather.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's part of the sequence of a replicated ``[b, s, ...]``; backward
    all-gathers the gradient (e.g. the output of a module that ran on the whole sequence)."""
    return x if get_tensor_model_parallel_world_size() == 1 else _ScatterSeq.apply(x)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, grad_partial: bool = True
) -> torch.Tensor:
    """All-gather the sequence shards ``[b, s/tp, ...]`` into ``[b, s, ...]`` (entering a TP
    region). Backward reduce-scatters the gradient when each rank holds a partial sum of it
    (``grad_partial``: a column-parallel region follows), else keeps this rank's slice (the
    region after it all-reduces its input gradient itself)."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    return _GatherSeq.apply(x, grad_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Leave a TP region: sum the partial results over the TP group and keep this rank's part
    of the sequence; backward all-gathers the gradient."""
    return x if get_tensor_model_parallel_world_size() == 1 else _ReduceScatterSeq.apply(x)
