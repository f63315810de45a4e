"""What the benchmark scripts share: the checkout's library on the import path, the run stamp
(commit, machine, date), the library shape, an interleaved timing loop and the JSON result line.

A script imports this module before the library (``scripts/`` is on the path when a script runs):
the import puts the checkout's root first on ``sys.path``, so a benchmark measures the code it
sits beside, installed or not.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from tapered_megatron.config import Config

#: The shape of the library benchmarks (model throughput, memory architectures): d_model 256,
#: 8 layers, 4 heads, SwiGLU width 688, vocabulary 8192, sequence 256.
LIBRARY_SHAPE = [
    "--model.d_model", "256", "--model.layers", "8", "--model.heads", "4", "--model.d_ff", "688",
    "--model.vocab_size", "8192", "--model.seq_len", "256",
]  # fmt: skip


def commit() -> str:
    """The checkout's commit (short hash, ``+dirty`` when tracked files differ from it), or
    ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine(device: str = "") -> str:
    """The machine a result comes from: ``device`` (an accelerator's product name) when given,
    the CPU and its core count."""
    cpu = f"{platform.machine()} {platform.processor()}".strip()
    return ", ".join(x for x in (device, f"{cpu} {os.cpu_count()} cpus") if x)


def stamp(device: str = "") -> dict[str, str]:
    """Commit, machine and date (UTC) of a result; ``device`` as for :func:`machine`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "commit": commit(),
        "machine": machine(device),
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
    }


def model_shape(cfg: Config, batch: int) -> dict[str, int]:
    """The model shape of ``cfg`` and the batch, as the results print it."""
    m = cfg.model
    return {
        "d_model": m.d_model,
        "layers": m.layers,
        "heads": m.heads,
        "d_ff": m.d_ff,
        "vocab": m.vocab_size,
        "seq": m.seq_len,
        "batch": batch,
    }


def interleaved(
    steps: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    clocks: Mapping[str, Callable[[], float]] | None = None,
    order: Literal["fixed", "alternate", "shuffle"] = "fixed",
    repeats: int = 1,
    sync: Callable[[], None] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, list[float]]]:
    """Seconds of each timed call, per clock and variant: ``times[clock][variant]``.

    Each of ``rounds`` rounds calls every variant ``repeats`` times, the variants in their given
    order (``fixed``), reversed every other round (``alternate``) or in a fresh random order
    (``shuffle``, from ``seed``), so load from other processes hits them all alike. ``clocks``
    default to wall time; ``sync`` (e.g. the accelerator's) runs before and after each call.
    """
    clocks = clocks or {"wall": time.perf_counter}
    sync = sync or (lambda: None)
    times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in steps} for c in clocks}
    names = list(steps)
    rng = random.Random(seed)
    for r in range(rounds):
        if order == "shuffle":
            sequence = rng.sample(names, len(names))
        elif order == "alternate" and r % 2:
            sequence = names[::-1]
        else:
            sequence = names
        for name in sequence:
            for _ in range(repeats):
                sync()
                start = [clock() for clock in clocks.values()]
                steps[name]()
                sync()
                for (c, clock), t0 in zip(clocks.items(), start):
                    times[c][name].append(clock() - t0)
    return times


def status_mib(key: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ``RssFile``) in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def emit(result: Mapping[str, Any]) -> None:
    """Print one result as a JSON line (flushed)."""
    print(json.dumps(result), flush=True)
