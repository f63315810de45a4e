"""Compute time of one pipeline stage, per forward and backward pass, from PyTorch's hooks.

DeepSpeed's pipeline engine runs a schedule of instructions; this clock times the stage's own
work without touching that schedule, through documented PyTorch hooks on the stage module:

* forward: between the module's forward pre- and post-hooks, plus the loss (the engine calls
  ``loss_fn`` outside the module's forward; wrap it with :meth:`StageClock.timed`);
* backward: from the gradient reaching the stage's output (a tensor hook) to the gradient
  reaching its input, or, on the first stage, whose input is token ids, to the embedding
  weight's gradient being accumulated (the last step of that stage's backward).

A runtime that calls each pass itself (the virtual-stage schedules: several chunks per rank, a
separate weight-gradient pass) times them with :meth:`StageClock.span` instead of the hooks.

Only passes with gradients enabled count (evaluation is not training compute). Typical use::

    clock = StageClock()
    module = BalancedPipelineModule.from_config(cfg, ..., loss_fn=clock.timed(lm_loss))
    clock.attach(module)
    ...
    ms = clock.take()            # forward + backward milliseconds since the last take()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class StageClock:
    """Per-pass compute time of the pipeline stage it is attached to (see the module docstring).

    Args:
        clock: the time source, in seconds (``time.perf_counter``; ``time.thread_time`` counts
            only this thread's CPU time, which a shared CPU machine disturbs less).
        synchronize: wait for the accelerator at every mark (needed for device time on GPUs).
    """

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, synchronize: bool = True
    ) -> None:
        self.clock, self.synchronize = clock, synchronize
        self.passes: list[tuple[str, float]] = []  # ("forward" | "backward", seconds), in order
        self._since_take = 0
        self._t0 = 0.0
        self._input_grad = True

    def attach(self, module: nn.Module) -> StageClock:
        """Hook into ``module`` (this rank's pipeline stage); returns the clock."""
        from tapered_megatron.models import Embedding

        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)
        for embedding in (m for m in module.modules() if isinstance(m, Embedding)):
            for p in embedding.parameters():
                p.register_post_accumulate_grad_hook(self._embedding_grad)
        return self

    def timed(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` with its time added to the forward pass it follows (a loss before any
        pass, such as the one torch's pipeline schedules compute to infer shapes, is not
        timed)."""

        def run(*args: Any) -> torch.Tensor:
            if not torch.is_grad_enabled() or not self.passes:
                return loss_fn(*args)
            t0 = self._now()
            loss = loss_fn(*args)
            kind, seconds = self.passes[-1]
            self.passes[-1] = (kind, seconds + self._now() - t0)
            return loss

        return run

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Time the work inside as one ``kind`` pass ("forward" or "backward")."""
        t0 = self._now()
        yield
        self.passes.append((kind, self._now() - t0))

    def take(self) -> float:
        """Milliseconds of the passes since the last call."""
        ms = 1000 * sum(s for _, s in self.passes[self._since_take :])
        self._since_take = len(self.passes)
        return ms

    def _now(self) -> float:
        if self.synchronize:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().synchronize()
        return self.clock()

    def _start(self, *_: Any) -> None:
        self._t0 = self._now()

    def _end(self, kind: str) -> None:
        self.passes.append((kind, self._now() - self._t0))

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return
        x = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
        self._input_grad = x.requires_grad
        if x.requires_grad:  # backward ends when the input's gradient exists
            x.register_hook(lambda _grad: self._end("backward"))
        self._start()

    def _after_forward(self, module: nn.Module, args: tuple, out: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._end("forward")
        first = out if isinstance(out, torch.Tensor) else out[0]
        first.register_hook(self._start)  # backward starts when the output's gradient arrives

    def _embedding_grad(self, param: torch.Tensor) -> None:
        if not self._input_grad:
            self._end("backward")
