"""The global gradient norm of a DeepSpeed engine's optimizer step, in every layout: what
the trainer logs and what a pipeline schedule clips by."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter

from tapered_megatron import parallel


def computes_grad_norm(engine: Any) -> bool:
    """Whether DeepSpeed computes the global gradient norm inside ``step()``: every ZeRO stage
    and 16-bit optimizer does, except fp32 ZeRO-0 (which clips without keeping the norm)."""
    fp32 = not (engine.fp16_enabled() or engine.bfloat16_enabled())
    return not (fp32 and engine.zero_optimization_stage() == 0)


def grad_norm(engine: Any, group: Any = None) -> float | None:
    """The global 2-norm of the current optimizer step's gradients, for every ZeRO stage.

    Where :func:`computes_grad_norm`, DeepSpeed's own value (read it after ``step()``).
    Otherwise (fp32 ZeRO-0) it is computed from the parameters' gradients, so read it after the
    last backward and before ``step()`` clears them: replicated parameters counted once per TP
    group, the sum over ``group`` (default: the TP group; a pipeline of several stages passes
    the group of its stages and TP ranks). ``None`` when there is nothing to read.
    """
    if computes_grad_norm(engine):
        gn = engine.get_global_grad_norm()
        return None if gn is None else float(gn)
    grads = [p for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].grad.device)
    tp_rank = parallel.get_tensor_model_parallel_rank()
    for p in grads:
        if tp_rank == 0 or is_model_parallel_parameter(p):
            sq += p.grad.detach().double().pow(2).sum()
    if group is None and parallel.get_tensor_model_parallel_world_size() > 1:
        group = parallel.get_tensor_model_parallel_group()
    if group is not None:
        dist.all_reduce(sq, group=group)
    return math.sqrt(sq.item())
