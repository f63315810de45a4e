"""AdamW parameter groups and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tapered_megatron.config import TrainConfig
from tapered_megatron.parallel.layers import param_shape


def no_decay(name: str, param: nn.Parameter) -> bool:
    """Norm weights, gains, biases and other vectors/scalars are not weight-decayed.

    A module may also mark a parameter explicitly with ``param._no_weight_decay = True``.
    """
    return (
        getattr(param, "_no_weight_decay", False)
        or len(param_shape(param)) < 2
        or name.endswith("bias")
        or "norm" in name.lower()
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decayed matrices, undecayed norms/gains/biases (empty groups dropped)."""
    decay, keep = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (keep if no_decay(name, p) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": keep, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    """Whether the ds_config keeps the optimizer on the CPU (ZeRO ``offload_optimizer``)."""
    off = ds.get("zero_optimization", {}).get("offload_optimizer") or {}
    return off.get("device", "none") == "cpu"


def build_optimizer(
    model: nn.Module, tr: TrainConfig, ds: dict[str, Any] | None = None
) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` with the ``train.*`` hyper-parameters.

    With the optimizer offloaded to the CPU (``ds``'s ``zero_optimization.offload_optimizer``)
    it is DeepSpeed's CPU Adam in AdamW mode (a JIT-built op; same groups and hyper-parameters,
    same ``exp_avg``/``exp_avg_sq`` state names), which ZeRO-Offload expects; else torch's AdamW.
    """
    groups = param_groups(model, tr.weight_decay)
    hyper = {
        "lr": tr.lr,
        "betas": (tr.adam_beta1, tr.adam_beta2),
        "eps": tr.adam_eps,
        "weight_decay": tr.weight_decay,
    }
    if ds is not None and offloads_optimizer(ds):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper)
    return torch.optim.AdamW(groups, **hyper)


class WarmupCosine:
    """Learning-rate multiplier: linear warmup to 1, cosine decay to ``min_lr / lr``, then flat.

    Step ``i`` (0-based optimizer step) uses ``lr * self(i)``: ``(i + 1) / warmup`` during warmup,
    then ``min + (1 - min) * (1 + cos(pi * t)) / 2`` with ``t`` going 0 -> 1 from the end of
    warmup to ``decay_iters``. A plain object so LambdaLR can checkpoint it.
    """

    def __init__(self, lr: float, min_lr: float, warmup: int, decay_iters: int) -> None:
        self.min_ratio = min_lr / lr if lr > 0 else 0.0
        self.warmup = warmup
        self.decay_iters = max(decay_iters, warmup)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = self.decay_iters - self.warmup
        if span <= 0 or step >= self.decay_iters:
            return self.min_ratio
        t = (step - self.warmup) / span
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def lr_at(tr: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (for logs and tests)."""
    return tr.lr * schedule(tr)(step)


def schedule(tr: TrainConfig) -> WarmupCosine:
    """The schedule of a run's ``train.*`` keys (``lr_decay_iters`` 0 means ``iters``)."""
    return WarmupCosine(tr.lr, tr.min_lr, tr.warmup_iters, tr.lr_decay_iters or tr.iters)


def build_scheduler(optimizer: torch.optim.Optimizer, tr: TrainConfig) -> Any:
    """``LambdaLR`` with :class:`WarmupCosine`; DeepSpeed steps it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(tr))


def skip_nonfinite_steps(engine: Any) -> None:
    """Make every optimizer step of ``engine`` a no-op when a gradient is not finite on any rank.

    DeepSpeed already skips such a whole step for fp16, ZeRO 1/2 and ZeRO-3 (``overflow``: no
    update, no learning-rate step, ``engine.skipped_steps`` + 1). ZeRO-3 checks the global
    gradient norm (every sub-group, every rank) before it updates any sub-group; it then calls
    the wrapped optimizer once per sub-group, so a check there would decide per sub-group:
    ZeRO-3 is left to its own check. For the optimizers that step the whole model (or this
    rank's ZeRO partition) in one call (fp32 ZeRO-0, bf16 ZeRO-0 and ``BF16_Optimizer``), the
    wrapped torch optimizer's ``step`` checks its own gradients, agrees with every rank (one
    all-reduce, all ranks step together) and, if any value is not finite, skips the update and
    raises DeepSpeed's ``overflow`` flag so the engine skips the scheduler and counts the step.
    Gradients are cleared by DeepSpeed after the step either way.
    """
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    outer = engine.optimizer
    if isinstance(outer, DeepSpeedZeroOptimizer_Stage3):
        return
    inner = outer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    step = inner.step
    device = get_accelerator().current_device_name()

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    bad.fill_(1.0)
                    break
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        outer.overflow = bool(bad.item())  # read by DeepSpeed's engine after the step
        return None if outer.overflow else step(*args, **kwargs)

    inner.step = guarded_step


def fp32_masters(engine: Any) -> dict[int, tuple[torch.Tensor, slice | None]]:
    """Where DeepSpeed's 16-bit optimizers without ZeRO keep each model parameter's fp32 master:
    ``id(param) -> (tensor the torch optimizer steps, slice of it or None for all of it)``.

    ``FP16_UnfusedOptimizer`` (bf16/fp16 ZeRO-0 with a torch optimizer) holds one fp32 copy per
    parameter; ``FP16_Optimizer`` (with a fused Adam) one flat fp32 tensor per group, the
    parameters laid end to end. The AdamW moments are keyed by those tensors. Empty for fp32
    and ZeRO runs (ZeRO's own fragment API answers there).
    """
    zero, out = engine.optimizer, {}
    if hasattr(zero, "fp32_groups_flat"):
        for low, flat in zip(zero.fp16_groups, zero.fp32_groups_flat):
            start = 0
            for p in low:
                out[id(p)] = (flat, slice(start, start + p.numel()))
                start += p.numel()
    elif hasattr(zero, "fp32_groups") and hasattr(zero, "fp16_groups"):
        for low, high in zip(zero.fp16_groups, zero.fp32_groups):
            for p, hp in zip(low, high):
                out[id(p)] = (hp, None)
    return out


def undo_priming_step(engine: Any) -> None:
    """Take back the step DeepSpeed's 16-bit optimizers without ZeRO take when they are built.

    ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` (bf16 or fp16 at ZeRO stage 0) create the
    torch optimizer's state by stepping it once with zero gradients. For AdamW that step is
    not empty: it decays every decayed weight by ``lr x weight_decay`` at the un-warmed base
    rate and counts a step, so the first real update's bias correction uses step 2 (a 0.74x
    step). The fp32 masters are reset to the model's weights they were copied from and the
    state is dropped (AdamW makes it again at the first real step). No-op for other optimizers.
    """
    masters = fp32_masters(engine)
    if not masters:
        return
    params = {id(p): p for p in engine.module.parameters()}
    inner = engine.optimizer.optimizer
    with torch.no_grad():
        for pid, (key, part) in masters.items():
            flat = key.data.view(-1)
            (flat if part is None else flat[part]).copy_(params[pid].data.reshape(-1))
            inner.state.pop(key, None)
