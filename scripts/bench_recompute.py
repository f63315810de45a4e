"""Activation recomputation: measured peak memory and step time of ``train.recompute`` none /
selective / full beside the cost model's predictions, per architecture.

    python scripts/bench_recompute.py [--archs transformer titans ...] [--batch 4] [--rounds 3]

Each architecture runs in a fresh process (one rank, fp32, the library shape of
``bench_common``) with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, so freed activations
leave the resident set. The three models (one per mode, same weights) each take a warm-up step; then
per mode the activation peak of one forward + backward is ``VmHWM`` (reset before it) minus the
RSS before it, the smallest of two tries, and the step times come from rounds that alternate
the modes (median of the thread's CPU time). The prediction is the cost model's
(:func:`tapered_megatron.planning.cost.unit_costs` on the measured CPU peak, the call the
planner makes): activations ``sum(act) + max(peak)`` over the units and the summed unit times.
One JSON line per architecture.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

from bench_common import (
    LIBRARY_SHAPE,
    emit,
    interleaved,
    model_shape,
    reset_peak,
    stamp,
    status_mib,
)

MODES = ("none", "selective", "full")


def _predicted(cfg: Any, batch: int, mode: str) -> dict[str, float]:
    from tapered_megatron.planning import cost

    dev = cost.resolve_device("auto")
    shape = cost.RunShape(
        micro_batch_size=batch, seq_len=cfg.model.seq_len, precision="fp32", recompute=mode,
        pipeline=False, zero_stage=0,
    )  # fmt: skip
    units = cost.unit_costs(cfg, shape, dev, "layer")
    act = sum(u.act for u in units) + cost.units_transient(units)
    return {"act_mib": act / 2**20, "step_s": sum(u.time for u in units)}


def _worker(rank: int, world: int, arch: str, batch: int, rounds: int) -> dict[str, Any]:
    import torch

    from tapered_megatron.config import load_config
    from tapered_megatron.models import build_model

    cfgs = {
        mode: load_config(
            "quickstart", ["--model.arch", arch, *LIBRARY_SHAPE, "--train.recompute", mode]
        )
        for mode in MODES
    }
    cfg = cfgs["none"]
    ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1))
    models = {mode: build_model(c).train() for mode, c in cfgs.items()}

    def step(mode: str) -> None:
        models[mode](ids[:, :-1], ids[:, 1:]).backward()

    for mode in MODES:  # gradients allocated, kernels warm
        step(mode)
    peak = {}
    for mode in MODES:
        tries = []
        for _ in range(2):
            gc.collect()
            before = status_mib("VmRSS")
            reset_peak()
            step(mode)
            tries.append(status_mib("VmHWM") - before)
        peak[mode] = min(tries)
    times = interleaved(
        {m: (lambda m=m: step(m)) for m in MODES},
        rounds,
        clocks={"cpu": time.thread_time},
        order="alternate",
    )["cpu"]
    out = {}
    for mode in MODES:
        pred = _predicted(cfgs[mode], batch, mode)
        out[mode] = {
            "measured_act_mib": round(peak[mode], 1),
            "predicted_act_mib": round(pred["act_mib"], 1),
            "measured_step_s": round(statistics.median(times[mode]), 3),
            "predicted_step_s": round(pred["step_s"], 3),
        }
    for key in ("measured_act_mib", "predicted_act_mib", "measured_step_s", "predicted_step_s"):
        for mode in ("selective", "full"):
            out[f"{mode}_over_none_{key}"] = round(out[mode][key] / out["none"][key], 3)
    return {"arch": arch, **model_shape(cfg, batch), **out}


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring)."""
    from tapered_megatron.models import ARCHITECTURES
    from tapered_megatron.parallel.local_launch import run_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=sorted(ARCHITECTURES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per mode")
    a = ap.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**16)  # read by each worker's glibc at start
    for arch in a.archs:
        (result,) = run_workers(_worker, 1, arch, a.batch, a.rounds, timeout=3600)
        emit({"bench": "recompute", **result, **stamp()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
