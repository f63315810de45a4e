"""One rank's memory from the real code in a simulated world, beside the planner's prediction.

    python scripts/simulate_rank.py --config transformer_7b --gpus 64 --gpu-mem 80 \
        --device h100 --layout "tp2 sp pp1 dp32 zero3 mbs4 gas1 rc-none layer" --rank 0 [--json]

The layout string is the one the planner prints (``python -m tapered_megatron.plan``). The rank's
model and DeepSpeed engine are built through the trainer's code and run for a few steps on fake
tensors with a fake process group (:mod:`tapered_megatron.planning.simulate`): nothing is
allocated, so a rank of a 7B or 30B run takes minutes on a CPU. Prints per-rank parameters, model
state, peak and per-block activations, predicted (the cost model) beside simulated; ``--json``
prints one JSON object instead. Extra ``--section.key value`` arguments override the config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tapered_megatron.config import load_config_or_exit
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.planner import layout_problem, parse_layout
from tapered_megatron.planning.simulate import Simulation, simulate

MiB = 2**20


def table(s: Simulation) -> str:
    """The human-readable comparison."""
    p, m, err = s.predicted, s.simulated, s.errors()
    lines = [
        f"layout {s.layout}, rank {s.rank} (pipeline stage {s.stage})",
        f"{'':<22}{'predicted':>14}{'simulated':>14}{'error':>9}",
        f"{'parameters':<22}{p.params:>14,.0f}{m.params:>14,.0f}{err['params']:>+9.2%}",
    ]
    for key, label in (("model_state", "model state MiB"), ("peak", "peak MiB")):
        a, b = getattr(p, key) / MiB, getattr(m, key) / MiB
        lines.append(f"{label:<22}{a:>14,.1f}{b:>14,.1f}{err[key]:>+9.2%}")
    for i, (a, b) in enumerate(zip(p.block_act, m.block_act, strict=True)):
        e = b / a - 1 if a else 0.0
        lines.append(f"{f'block {i} act MiB':<22}{a / MiB:>14,.2f}{b / MiB:>14,.2f}{e:>+9.2%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring)."""
    ap = argparse.ArgumentParser(
        prog="python scripts/simulate_rank.py", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", required=True, help="preset name or YAML path")
    ap.add_argument("--gpus", type=int, required=True, help="total GPUs (the simulated world)")
    ap.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU, GiB")
    ap.add_argument("--device", default="h100", help=f"one of {', '.join(costlib.DEVICES)}")
    ap.add_argument("--layout", required=True, help="a layout as the planner prints it")
    ap.add_argument("--rank", type=int, default=0, help="the global rank to simulate")
    ap.add_argument(
        "--mem-fraction", type=float, default=0.9, help="usable share of --gpu-mem (as the planner)"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object")
    a, rest = ap.parse_known_args(argv)
    cfg = load_config_or_exit(a.config, rest)
    try:
        c = parse_layout(a.layout)
        dev = costlib.get_device(a.device, mem_bytes=a.gpu_mem * costlib.GiB)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = layout_problem(cfg, c, a.gpus, dev.gpus_per_node)
    if problem is not None:
        print(f"error: --layout {a.layout!r}: {problem}", file=sys.stderr)
        return 2
    if not 0 <= a.rank < a.gpus:
        print(f"error: --rank {a.rank} is outside 0..{a.gpus - 1}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        s = simulate(cfg, c, dev, a.rank, a.mem_fraction * a.gpu_mem * costlib.GiB)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    if a.json:
        print(json.dumps({"config": cfg.name, **s.to_dict(), "wall_s": round(wall, 1)}))
    else:
        print(table(s))
        print(f"simulated in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
