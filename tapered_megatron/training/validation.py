"""Validation loss over a fixed set of batches, identical for every parallel layout.

Every evaluation reads the same first ``eval.iters`` global batches of the validation split (the
same samples for any DP/TP/PP layout and before/after a resume), so successive values are
comparable and a resumed run logs what the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


@torch.no_grad()
def validation_loss(
    engine: Any,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    iters: int,
    grad_accum: int,
    dp_group: Any = None,
    after_micro_batch: Callable[[], None] | None = None,
) -> float:
    """Mean token loss over ``iters`` global batches of ``(inputs, labels)`` micro-batches.

    A pipeline engine (``engine.eval_batch``) runs ``grad_accum`` micro-batches per call and
    returns the loss already averaged over data-parallel ranks; a plain engine is run here
    micro-batch by micro-batch with the model's own loss ``engine(inputs, labels)`` and averaged
    over ``dp_group``; ``after_micro_batch()`` is called after each of its micro-batches.
    Collective over all ranks of the run.
    """
    was_training = engine.module.training
    engine.eval()
    total = torch.zeros((), dtype=torch.float64)
    if hasattr(engine, "eval_batch"):
        for _ in range(iters):
            loss = engine.eval_batch(batches, num_micro_batches=grad_accum)
            total += float(loss)
        mean = total.item() / iters
    else:
        for _ in range(iters * grad_accum):
            x, y = next(batches)
            total += float(engine(x, y))
            if after_micro_batch is not None:
                after_micro_batch()
        t = total.to(next(engine.module.parameters()).device) / (iters * grad_accum)
        if dist.is_initialized():
            dist.all_reduce(t, group=dp_group)
            t /= dist.get_world_size(group=dp_group)
        mean = t.item()
    if was_training:
        engine.train()
    return mean
