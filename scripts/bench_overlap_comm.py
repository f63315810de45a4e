"""ZeRO-2 with and without overlapped gradient reduction (``overlap_comm``): step time and
losses of the same two-rank run.

    python scripts/bench_overlap_comm.py [--rounds 3] [--iters 8] [overrides]

``pretrain/main.py`` is launched through the DeepSpeed launcher on two ranks with the shipped
``ds_configs/zero2.json`` (``overlap_comm: true``) and with a copy that sets it false, alternating
round by round; the default run is the quickstart with two micro-batches per step (ZeRO-2
reduces each). Prints one JSON line: the median step time of each (steady steps of every
round), their ratio and the largest relative loss difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_common import ROOT, emit, stamp
from bench_train import launch_main


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8, help="iterations per launched run")
    a, overrides = ap.parse_known_args(argv)
    overrides = overrides or ["--train.micro_batch_size", "4", "--train.global_batch_size", "16"]
    shipped = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    step: dict[str, list[float]] = {"overlap": [], "plain": []}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overlap in (("overlap", True), ("plain", False)):
            ds = json.loads(json.dumps(shipped))
            ds["zero_optimization"]["overlap_comm"] = overlap
            (Path(tmp) / f"{name}.json").write_text(json.dumps(ds))
        for r in range(a.rounds):
            names = ("overlap", "plain") if r % 2 == 0 else ("plain", "overlap")
            for name in names:
                run = launch_main(
                    2, a.config, str(Path(tmp) / f"{name}.json"), overrides, a.iters,
                    Path(tmp) / f"{name}{r}",
                )  # fmt: skip
                step[name].append(run["step_s"])
                losses[name] = run["losses"]
    diff = max(abs(x - y) / abs(y) for x, y in zip(losses["overlap"], losses["plain"]))
    med = {k: statistics.median(v) for k, v in step.items()}
    emit(
        {
            "bench": "overlap_comm",
            "config": a.config,
            "overrides": overrides,
            "ranks": 2,
            "overlap_step_s": round(med["overlap"], 4),
            "plain_step_s": round(med["plain"], 4),
            "overlap_over_plain": round(med["overlap"] / med["plain"], 3),
            "max_rel_loss_diff": diff,
            **stamp(),
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
