"""Fault-injection hooks for tests: switched on only by environment variables, inert otherwise.

* ``$TAPERED_MEGATRON_INJECT_NAN`` ("3", "3,5", "4-9"): the trainer gives those iterations a NaN
  loss on rank 0 (:func:`injected_nan_iterations`; under a pipeline the first micro-batch's loss
  on the first replica's last stage, :func:`nan_first_loss`).
* ``$TAPERED_MEGATRON_CRASH_IN_SAVE`` = a point name: the save kills rank 0 at that point
  (:func:`crash_point`), as a machine failure mid-save would.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

from tapered_megatron.checkpoint.collective import rank


def injected_nan_iterations() -> frozenset[int]:
    """Iterations named in ``$TAPERED_MEGATRON_INJECT_NAN`` ("3", "3,5", "4-9"): test hook."""
    out: set[int] = set()
    for part in os.environ.get("TAPERED_MEGATRON_INJECT_NAN", "").replace(" ", "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@contextlib.contextmanager
def nan_first_loss(owner: Any, name: str, active: bool) -> Iterator[None]:
    """While the block runs and ``active``, the first loss that ``owner.<name>`` computes is NaN
    (a pipeline calls its loss function on the last stage, once per micro-batch): test hook."""
    fn = getattr(owner, name)
    if not active or fn is None:
        yield
        return
    own = name in vars(owner)  # DeepSpeed's loss_fn is the module's; a method is the class's
    fired = False

    def first_nan(*args: Any) -> Any:
        nonlocal fired
        loss = fn(*args)
        if not fired:
            fired = True
            return loss * float("nan")
        return loss

    setattr(owner, name, first_nan)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)


def crash_point(name: str) -> None:
    """Rank 0 kills itself (SIGKILL) at save point ``name`` ("rank_files": DeepSpeed's files
    written, RNG files not; "complete": before the ``complete`` marker; "latest": before
    ``latest`` moves) when ``$TAPERED_MEGATRON_CRASH_IN_SAVE`` names it."""
    if os.environ.get("TAPERED_MEGATRON_CRASH_IN_SAVE") == name and rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
