"""Shared by the pipeline tests: a stage's gradients under their single-process names, and the
single-process reference they are compared with."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class KeepGrads(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it was stepped with (``kept``: param -> grad)."""

    def step(self, closure: Any = None) -> Any:
        self.kept = {
            p: p.grad.detach().clone()
            for g in self.param_groups
            for p in g["params"]
            if p.grad is not None
        }
        return super().step(closure)


def canonical_names(module: torch.nn.Module, cfg: Any) -> dict[torch.nn.Parameter, str]:
    """A pipeline stage's parameters -> their names in the single model (``layers.3.mlp...``)."""
    from tapered_megatron.models import canonical_parameters

    return {p: name for name, p in canonical_parameters(module, cfg)}


def stage_grads(module: torch.nn.Module, cfg: Any, opt: KeepGrads) -> dict[str, np.ndarray]:
    """The gradients ``opt`` kept, by single-model name (numpy: they leave the worker process
    by value, not as shared-memory handles that die with it)."""
    names = canonical_names(module, cfg)
    return {names[p]: g.numpy() for p, g in opt.kept.items()}


def full_tensor(t: torch.Tensor, p: torch.nn.Parameter) -> np.ndarray:
    """The full tensor of ``t`` (``p``'s data or gradient), gathered over the TP group when ``p``
    is split (collective over that group)."""
    import torch.distributed as dist

    from tapered_megatron.parallel import get_tensor_model_parallel_group, unshard

    layout = getattr(p, "tp_layout", None)
    group = get_tensor_model_parallel_group() if layout is not None else None
    if group is None or dist.get_world_size(group) == 1:
        return t.detach().float().numpy().copy()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return unshard(parts, layout).float().numpy()


def reference(cfg: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 0.0):
    """One process: mean loss over the micro-batches, the gradients of that mean, and the
    parameters after one SGD step of ``lr`` (all by name)."""
    from tapered_megatron.models import build_model

    model = build_model(cfg)
    loss = sum(model(x, y) for x, y in batches) / len(batches)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    after = {n: (p - lr * p.grad).detach() for n, p in model.named_parameters()}
    return loss.item(), grads, after


def reference_steps(
    cfg: Any, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], lr: float, clip: float
):
    """One process, several SGD steps of ``lr`` with DeepSpeed's clipping to ``clip`` (the
    gradient times ``clip / (norm + 1e-6)`` when the global norm exceeds it): per step the mean
    loss over its micro-batches, the clipped gradients and the parameters after it (by name)."""
    from tapered_megatron.models import build_model

    model = build_model(cfg)
    out = []
    for batches in steps:
        model.zero_grad()
        loss = sum(model(x, y) for x, y in batches) / len(batches)
        loss.backward()
        raw = {
            n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in model.named_parameters()
        }  # a parameter the loss does not reach has no gradient
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in raw.values())).item()
        coef = min(1.0, clip / (norm + 1e-6))
        grads = {n: g * coef for n, g in raw.items()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= lr * grads[n]
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"loss": loss.item(), "norm": norm, "grads": grads, "params": params})
    return out
