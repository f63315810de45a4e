"""The saved summary of each finished run (``docs/results/runs/<run>/metrics.json``): what
RESULTS.md is computed from, so it can be regenerated and checked without the checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from experiments.tlm import driver, grid, provenance


def _window_means(recs: list[dict[str, Any]], width: int) -> list[list[float]]:
    out = []
    for i in range(0, len(recs), width):
        chunk = recs[i : i + width]
        out.append([chunk[-1]["iteration"], sum(r["loss"] for r in chunk) / len(chunk)])
    return out


def _series(recs: list[dict[str, Any]], key: str) -> list[list[float]]:
    """``[iteration, value]`` of every record that logged ``key`` (4 significant digits)."""
    return [[r["iteration"], float(f"{r[key]:.4g}")] for r in recs if r.get(key) is not None]


def run_record(settings: driver.Settings, run: grid.Run) -> dict[str, Any]:
    """The saved summary of one finished run (what RESULTS.md is computed from)."""
    from tapered_megatron.config import load_config
    from tapered_megatron.models import count_model

    d = settings.run_dir(run)
    job = driver.job_part(json.loads((d / "cmd.json").read_text())["command"])
    over = [a for a in job[1:] if a not in ("--resume", "auto")]
    preset = over[over.index("--config") + 1]
    del over[over.index("--config") : over.index("--config") + 2]
    cfg = load_config(preset, over)
    counts = count_model(cfg)
    tokens_per_iter = (cfg.train.global_batch_size or cfg.train.micro_batch_size) * (
        cfg.model.seq_len
    )
    recs = driver.read_metrics(d / "metrics.jsonl")
    curve = [
        [r["iteration"], r["iteration"] * tokens_per_iter, r["val_loss"]]
        for r in recs
        if "val_loss" in r
    ]
    done = json.loads((d / "done").read_text())
    out: dict[str, Any] = {
        "run": run.name,
        "variant": run.variant.key,
        "arch": run.variant.arch,
        "schedule": run.variant.schedule,
        "ratio": list(run.variant.ratio),
        "reverse": run.variant.reverse,
        "seed": run.seed,
        "widths": list(cfg.taper_plan.widths),
        "model": {
            "d_model": cfg.model.d_model,
            "layers": cfg.model.layers,
            "d_ff": cfg.model.d_ff,
            "vocab_size": cfg.model.vocab_size,
            "seq_len": cfg.model.seq_len,
        },
        "tokens_per_iteration": tokens_per_iter,
        "iterations": recs[-1]["iteration"],
        "eval_tokens": cfg.eval.iters * tokens_per_iter,
        "lr": cfg.train.lr,
        "params": counts.params_total,
        "train_flops_per_token": counts.train_flops_per_token,
        "val_curve": curve,
        "train_curve": _window_means(recs, 10),
        "grad_norm": _series(recs, "grad_norm"),
        "final_val_loss": curve[-1][2],
        "wall_s": round(done["wall_s"], 1),
        "size": run.variant.size,
        "corpus": run.variant.corpus,
        "provenance": provenance.read(d) or None,
    }
    clip = _series(recs, "memory_clip")  # titans: the share of memory steps the clip scaled
    if clip:
        out["memory_clip"] = clip
    align = d / "alignment.json"
    out["alignment"] = json.loads(align.read_text()) if align.exists() else None
    probe = d / "memory_probe.json"
    out["memory_probe"] = json.loads(probe.read_text())["probes"] if probe.exists() else None
    zs = d / "zeroshot" / "zeroshot.json"
    out["zeroshot"] = json.loads(zs.read_text()) if zs.exists() else None
    if out["zeroshot"] and "model" in out["zeroshot"]:
        out["zeroshot"]["model"] = repo_relative(out["zeroshot"]["model"])
    return out


def zeroshot_tasks_info() -> dict[str, dict[str, Any]]:
    """Items and chance level of each shipped local zero-shot task, from its data file.

    Multiple choice: the mean of 1 / choices over the items. Cloze (a target word): the share of
    the most frequent target (always guessing that word), the level a model that learned nothing
    about the context can reach.
    """
    from tapered_megatron.resources import resource

    tasks = resource("tasks")
    out = {}
    for data in sorted((tasks / "data").glob("*.jsonl")):
        task = data.stem
        items = [json.loads(x) for x in data.read_text().splitlines()]
        if "choices" in items[0]:
            chance = sum(1 / len(x["choices"]) for x in items) / len(items)
            counts = {len(x["choices"]) for x in items}
            rule = f"1 of {counts.pop()} choices" if len(counts) == 1 else "1 / choices"
        else:
            top = Counter(x["target"] for x in items).most_common(1)[0]
            chance = top[1] / len(items)
            rule = f"always {top[0]!r}"
        out[task] = {"items": len(items), "chance": chance, "chance_rule": rule}
    return out


def repo_relative(path: str) -> str:
    """``path`` relative to the repository when it is absolute, so committed results carry no
    path of the machine that produced them."""
    return os.path.relpath(path, driver.REPO) if os.path.isabs(path) else path


def collect(settings: driver.Settings, runs: Iterable[grid.Run], dest: Path) -> None:
    """Write ``dest/<run>/metrics.json`` for every finished run.

    Saved runs no longer in the plan are left alone; ``dest`` holds small JSON only.
    """
    for run in runs:
        if not driver.is_done(settings, run):
            continue
        rec = run_record(settings, run)
        (dest / run.name).mkdir(parents=True, exist_ok=True)
        (dest / run.name / "metrics.json").write_text(json.dumps(rec, indent=1) + "\n")


# The driver's own files kept with the records: each invocation's wall seconds, and the
# same-machine rerun check.
DRIVER_FILES = ("driver_wall.json", "rerun.json")


def keep_driver_files(out: Path, dest: Path) -> None:
    """Copy :data:`DRIVER_FILES` from the driver's ``out`` to ``dest`` (beside ``runs/``), where
    they are committed with the records; a file ``out`` lacks is left as it was."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in DRIVER_FILES:
        if (out / name).is_file():
            shutil.copyfile(out / name, dest / name)


def driver_file(out: Path, dest: Path, name: str) -> Any:
    """The content of driver file ``name``: the driver's copy in ``out``, else the one kept in
    ``dest`` with the records (None where neither exists)."""
    for f in (out / name, dest / name):
        if f.is_file():
            return json.loads(f.read_text())
    return None


def load_records(runs_dir: Path) -> list[dict[str, Any]]:
    """Every saved ``<run>/metrics.json`` under ``runs_dir``, sorted by run name."""
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*/metrics.json"))]


def sync_records(settings: driver.Settings, runs: list[grid.Run], dest: Path) -> int:
    """:func:`collect`, after removing saved records of runs outside this plan; returns how many
    of the plan's runs have a saved record (also those saved from an earlier run directory)."""
    names = {r.name for r in runs}
    if dest.exists():
        for d in dest.iterdir():
            if d.is_dir() and d.name not in names:
                shutil.rmtree(d)
    collect(settings, runs, dest)
    return sum((dest / name / "metrics.json").exists() for name in names)
