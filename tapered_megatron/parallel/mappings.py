"""Autograd-aware communication across the tensor-parallel group (Megatron's four mappings).

=====================  ==========================  ==========================
function               forward                     backward
=====================  ==========================  ==========================
copy_to_tp_region      identity                    all-reduce (sum)
reduce_from_tp_region  all-reduce (sum)            identity
scatter_to_tp_region   keep this rank's last-dim   all-gather along last dim
gather_from_tp_region  all-gather along last dim   keep this rank's slice
=====================  ==========================  ==========================

All four are identities when the TP size is 1, so single-process models pay nothing.
"""

from __future__ import annotations

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


def _split_last(x: torch.Tensor) -> torch.Tensor:
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    return x.chunk(tp, dim=-1)[get_tensor_model_parallel_rank()].contiguous()


def _gather_last(x: torch.Tensor) -> torch.Tensor:
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x, group=get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _reduce(g)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last(x)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g)


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
