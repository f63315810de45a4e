"""The checkpoint part of pre-flight, run before any process group starts (from
:func:`tapered_megatron.training.preflight.check_inputs`): ``train.save_dir`` writable with room
for the next checkpoint and holding no other run's checkpoints, and ``train.resume`` naming a
complete checkpoint of this run's model and taper that loads under this run's parallel layout.
Each check raises a one-line :class:`~tapered_megatron.config.ConfigError`; nothing is written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from tapered_megatron.checkpoint import layout as layout_files
from tapered_megatron.checkpoint.layout import ParallelLayout
from tapered_megatron.config import Config, ConfigError, load_saved_config

# Sections whose values fix the parameter shapes: a checkpoint of another shape cannot load.
_SHAPE_SECTIONS = ("model", "taper")


# Keys of those sections a resumed run may change (training-time only: no weight depends on them).
_FREE_ON_RESUME = ("model.dropout",)


def check_owner(cfg: Config) -> None:
    """``train.save_dir`` holds no other run's checkpoints, unless the run continues them
    (``--resume auto``) or moves them aside (``train.start_over``)."""
    from tapered_megatron.checkpoint.save_dir import owner_problem

    why = owner_problem(cfg)
    if why is not None:
        raise ConfigError(why)


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def half_precision(ds_config: dict[str, Any]) -> bool:
    """Whether the DeepSpeed config trains in fp16 or bf16."""
    return any(ds_config.get(h, {}).get("enabled") is True for h in ("fp16", "bf16"))


def check_save_dir(cfg: Config, ds_config: dict[str, Any]) -> None:
    """``train.save_dir`` is (or can be made) a writable directory with room for a checkpoint."""
    from tapered_megatron.checkpoint.save import checkpoint_bytes, size_text

    save = Path(cfg.train.save_dir)
    base = _existing_ancestor(save)
    if not base.is_dir():
        raise ConfigError(
            f"train.save_dir: {base} exists and is not a directory, so {save} cannot be created; "
            "pass another --train.save_dir"
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(
            f"train.save_dir: {base} is not writable; pass a writable --train.save_dir "
            "or fix its permissions"
        )
    need = checkpoint_bytes(cfg, half_precision(ds_config))
    free = shutil.disk_usage(base).free
    if free < need:
        raise ConfigError(
            f"train.save_dir: {size_text(free)} free on {base}, the next checkpoint needs about "
            f"{size_text(need)}; free disk space or pass a --train.save_dir on a larger disk"
        )


def _differences(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k), b.get(k), f"{prefix}.{k}")
        return out
    return [] if a == b else [f"{prefix} {b!r} in the checkpoint, {a!r} here"]


def check_resume(cfg: Config, layout: ParallelLayout | None = None) -> None:
    """``train.resume`` names a complete checkpoint whose model and taper match ``cfg``
    (``model.dropout`` may change); one saved under another parallel layout than ``layout``
    holds the layout-free copy."""
    from tapered_megatron.checkpoint import resume

    if not cfg.train.resume:
        return
    if cfg.train.resume != "auto" and not Path(cfg.train.resume).exists():
        raise ConfigError(
            f"train.resume: {cfg.train.resume} does not exist; pass a save directory or a "
            "global_stepN directory, or --resume auto"
        )
    try:
        where = resume.find_resume(cfg)
    except FileNotFoundError as e:
        raise ConfigError(
            f"{e}; pass a directory holding a complete checkpoint, or --resume auto"
        ) from None
    if where is None:
        return
    saved_file = where[0] / where[1] / "config.yaml"
    try:
        saved = load_saved_config(saved_file, cfg.model.plugins).to_dict()
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise ConfigError(
            f"train.resume: cannot read {saved_file} ({e}); resume from another checkpoint"
        ) from None
    here = cfg.to_dict()
    diff = [
        d
        for s in _SHAPE_SECTIONS
        for d in _differences(here.get(s), (saved or {}).get(s), s)
        if d.split(" ", 1)[0] not in _FREE_ON_RESUME
    ]
    if diff:
        raise ConfigError(
            f"train.resume: {where[0] / where[1]} was saved with another model ("
            + "; ".join(diff[:4])
            + (f"; {len(diff) - 4} more" if len(diff) > 4 else "")
            + f"); use the checkpoint's settings (see {saved_file}) or another --train.save_dir"
        )
    if layout is not None:
        _check_layout_change(where[0] / where[1], saved, layout)


def _check_layout_change(tag_dir: Path, saved_cfg: dict[str, Any], now: ParallelLayout) -> None:
    """A checkpoint without ``universal/`` loads only under the layout it was saved under (its
    ``layout.json``; for one written before that file, the TP / PP / unit of its config)."""
    if layout_files.has_universal(tag_dir):
        return
    then = layout_files.saved_layout(tag_dir)
    counts: tuple[str, ...] = ("tp", "pp", "dp", "zero_stage")
    if then is None:  # its config says only TP, PP and unit: DP and ZeRO stage are not compared
        par = (saved_cfg or {}).get("parallel", {})
        tp, pp = par.get("tp", 1), par.get("pp", 1)
        unit = par.get("pipeline_unit", "none") if pp > 1 else "none"
        then = ParallelLayout(tp, pp, now.dp, now.zero_stage, unit)
        counts = ("tp", "pp")
    if then.to_record() != now.to_record():
        raise ConfigError(
            f"train.resume: {tag_dir} was saved under {then.describe(counts)} "
            "without a universal/ copy (train.universal_checkpoint false, or an older "
            f"checkpoint), so it cannot resume under {now.describe()}; launch "
            "with the saved layout"
        )
