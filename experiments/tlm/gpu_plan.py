"""GPU scales on a machine without a GPU: the launch plan, its cost and the planned widths."""

from __future__ import annotations

from experiments.tlm import driver, grid


def planned_widths(settings: driver.Settings, runs: list[grid.Run]) -> dict[str, list[int]]:
    """Per-layer d_ff of every planned variant, from its preset (for tables of runs not run)."""
    from tapered_megatron.config import load_config

    out = {}
    for v in {r.variant for r in runs}:
        cfg = load_config(
            settings.scale.presets[v.arch], [*settings.scale.overrides, *v.overrides()]
        )
        out[v.key] = list(cfg.taper_plan.widths)
    return dict(sorted(out.items()))


def _gpus(launcher: list[str]) -> int:
    for flag in ("--num_gpus", "--nproc_per_node", "-np", "-n"):
        if flag in launcher[:-1]:
            return int(launcher[launcher.index(flag) + 1])
    return 8


def launch_plan(settings: driver.Settings, runs: list[grid.Run], device: str = "h100") -> str:
    """The commands of every run and their cost in GPU-hours (planner step-time estimate)."""
    from tapered_megatron.config import ConfigError, load_config
    from tapered_megatron.planning import cost as costlib
    from tapered_megatron.planning import planner

    gpus = _gpus(settings.launcher)
    dev = costlib.get_device(device, gpus_per_node=min(gpus, 8))
    cap = 0.9 * dev.mem_bytes
    lines = [f"{len(runs)} runs on {gpus} x {dev.name} each (planner estimate, best layout):"]
    per_arch: dict[str, float] = {}
    total = 0.0
    for a in sorted({r.variant.arch for r in runs}, key=grid.ARCHS.index):
        cfg = load_config(settings.scale.presets[a])
        try:
            ranked, _ = planner.plan(cfg, gpus, dev, cap)
        except ConfigError as e:  # a layout the planner tried is not a valid config
            lines.append(f"  {a} ({cfg.name}): the planner failed ({e})")
            continue
        if not ranked:
            lines.append(f"  {a}: nothing fits on {gpus} GPUs; use more GPUs")
            continue
        best = ranked[0]
        hours = best.step_s * cfg.train.iters * gpus / 3600
        per_arch[a] = hours
        n = sum(r.variant.arch == a for r in runs)
        total += n * hours
        lines.append(
            f"  {a} ({cfg.name}): {best.label}, {best.step_s:.2f} s/step x {cfg.train.iters} "
            f"steps = {hours:,.0f} GPU-hours per run x {n} runs"
        )
    lines.append(f"total: {total:,.0f} GPU-hours ({total / gpus:,.0f} h wall on {gpus} GPUs)")
    lines.append("commands (run from the repo root; the driver runs them in this order):")
    lines += ["  " + " ".join(settings.command(r)) for r in runs]
    return "\n".join(lines)
