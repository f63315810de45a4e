"""Fault-injection hooks for tests: switched on only by environment variables, inert otherwise.

* ``$TAPERED_MEGATRON_INJECT_NAN`` ("3", "3,5", "4-9"): the trainer gives those iterations a NaN
  loss on rank 0 (:func:`injected_nan_iterations`; under a virtual-stage pipeline schedule on the
  rank of the last chunk; not under DeepSpeed's 1F1B pipeline engine).
* ``$TAPERED_MEGATRON_CRASH_IN_SAVE`` = a point name: the save kills rank 0 at that point
  (:func:`crash_point`), as a machine failure mid-save would.
"""

from __future__ import annotations

import os
import signal

from tapered_megatron.checkpoint.collective import rank


def injected_nan_iterations() -> frozenset[int]:
    """Iterations named in ``$TAPERED_MEGATRON_INJECT_NAN`` ("3", "3,5", "4-9"): test hook."""
    out: set[int] = set()
    for part in os.environ.get("TAPERED_MEGATRON_INJECT_NAN", "").replace(" ", "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def crash_point(name: str) -> None:
    """Rank 0 kills itself (SIGKILL) at save point ``name`` ("rank_files": DeepSpeed's files
    written, RNG files not; "complete": before the ``complete`` marker; "latest": before
    ``latest`` moves) when ``$TAPERED_MEGATRON_CRASH_IN_SAVE`` names it."""
    if os.environ.get("TAPERED_MEGATRON_CRASH_IN_SAVE") == name and rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
