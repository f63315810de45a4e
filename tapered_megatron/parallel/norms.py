"""The global gradient norm of a DeepSpeed engine's optimizer step, in every layout: what
the trainer logs and what a pipeline clips by.

DeepSpeed's fp32 ZeRO-0 clipping (``runtime/utils.clip_grad_norm_``) counts a parameter that is
not a TP shard only where ``mpu.get_model_parallel_rank() == 0``; a pipeline's ``mpu`` (its
``PipelineParallelGrid``) numbers that rank over pipe x model, so every stage but the first
drops its replicated parameters (norm gains, biases) from the norm, and DeepSpeed keeps no norm
there either. A pipeline at fp32 ZeRO-0 therefore computes the norm itself and clips with
DeepSpeed's rule (:func:`own_clip`, :func:`clip_grads`; DeepSpeed's 1F1B engine through
:func:`clip_in_step`). Every other layout keeps DeepSpeed's own norm, which is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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


def own_clip(ds_config: dict[str, Any]) -> float | None:
    """The clipping threshold a pipeline applies itself under ``ds_config`` (0: none, the norm
    still computed), or None where DeepSpeed's own norm and clipping are exact: fp32 ZeRO-0
    (see the module docstring). Pass DeepSpeed the config with ``gradient_clipping`` 0 then.
    ``ds_config`` must be resolved (``bf16.enabled`` true or false, not "auto")."""
    enabled = [ds_config.get(k, {}).get("enabled", False) for k in ("bf16", "fp16")]
    if not all(isinstance(e, bool) for e in enabled):
        raise ValueError(
            f"bf16/fp16 'enabled' must be true or false, got {enabled}; resolve the DeepSpeed "
            "config first (training/launch.py does)"
        )
    if any(enabled) or int(ds_config.get("zero_optimization", {}).get("stage", 0)) != 0:
        return None
    return float(ds_config.get("gradient_clipping", 0.0))


def clip_grads(params: Iterable[torch.nn.Parameter], norm: float, clip: float) -> None:
    """DeepSpeed's clipping rule: scale the gradients by ``clip / (norm + 1e-6)`` when that is
    below 1 (``clip`` 0: no clipping; a non-finite norm: left as they are)."""
    coef = clip / (norm + 1e-6) if clip > 0 else 1.0
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)


def clip_in_step(engine: Any, clip: float, group: Any) -> None:
    """Before every step of ``engine``'s fp32 optimizer: the global gradient norm over ``group``
    (the pipeline grid's model-parallel group: every stage and TP rank of this replica), the
    gradients clipped to ``clip`` by it, and the norm kept where DeepSpeed's engine reads it
    after the step (``engine.get_global_grad_norm()``). Install it last, around whatever else
    wraps the step (``optim.skip_nonfinite_steps``), so that every rank computes the norm
    (a collective), a skipped step included."""
    opt = engine.optimizer
    step = opt.step

    def clipped_step(*args: Any, **kwargs: Any) -> Any:
        norm = grad_norm(engine, group)
        if norm is not None:
            clip_grads(engine.module.parameters(), norm, clip)
        opt._global_grad_norm = norm  # DeepSpeed's engine copies it after step()
        return step(*args, **kwargs)

    opt.step = clipped_step
