"""Resuming: which checkpoint ``train.resume`` points at, and loading it through DeepSpeed with
this rank's RNG states.

``--train.resume auto`` picks the checkpoint named by ``latest`` if it is complete, else the
newest complete one; a candidate whose files do not load as plain data
(:mod:`tapered_megatron.checkpoint.safe_load`: DeepSpeed's are verified that way before its
engine loads them), whose sizes (and, from the trainer, hashes) differ from its manifest, or
whose records do not parse is passed over for the next older one."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from tapered_megatron.checkpoint import received, safe_load
from tapered_megatron.checkpoint.collective import rank, world_size
from tapered_megatron.checkpoint.layout import (
    CONFIG,
    LAYOUT,
    RECORD_KEYS,
    TAPER_PLAN,
    is_complete,
    is_tag,
    latest_problem,
    resume_candidates,
    saved_layout,
)
from tapered_megatron.checkpoint.manifest import (
    entries_problem,
    manifest,
    manifest_problem,
    tag_entries,
)
from tapered_megatron.config import Config, ConfigError
from tapered_megatron.config_fields import first_line
from tapered_megatron.parallel.random import set_rng_state


def saved_global_batch(tag_dir: Path, plugins: tuple[str, ...] = ()) -> int | None:
    """The global batch (samples per optimizer step) a checkpoint was trained with: its
    ``train.global_batch_size``, or micro batch x its DP size where that was 0; ``None`` when
    its files do not say (pre-flight reports unreadable checkpoints). ``plugins``: the run's own
    ``model.plugins`` (the saved ones are never imported)."""
    from tapered_megatron.config import load_saved_config

    try:
        tr = load_saved_config(tag_dir / "config.yaml", plugins).train
    except (OSError, yaml.YAMLError, ConfigError):
        return None
    if tr.global_batch_size:
        return tr.global_batch_size
    layout = saved_layout(tag_dir)
    return tr.micro_batch_size * layout.dp if layout else None


def hash_problem(tag_dir: Path) -> str | None:
    """:func:`~tapered_megatron.checkpoint.manifest.manifest_problem` with the hashing shared by
    the ranks (collective: every rank gets the same answer)."""
    files = manifest(tag_dir) or {}
    why = manifest_problem(tag_dir, sorted(files)[rank() :: world_size()])
    if world_size() == 1:
        return why
    found: list[Any] = [None] * world_size()
    dist.all_gather_object(found, why)
    return next((w for w in found if w), None)


def checkpoint_problem(tag_dir: Path) -> str | None:
    """What makes a complete checkpoint unusable (one line), or None: a ``.pt`` file that does
    not load as plain data (:func:`tapered_megatron.checkpoint.safe_load.verify_tag`: truncated,
    overwritten, or a pickle naming code), a file whose size differs from the manifest, or a
    ``layout.json`` / ``taper_plan.json`` / ``config.yaml`` that does not parse.

    One process asks up to three times (the global-batch check and pre-flight before the process
    group, the trainer after it); the answer is kept per tag and file sizes and mtimes, so each
    tag's files are read once unless they change."""
    try:
        names = [n for found in tag_entries(tag_dir) for n in found]
        stamp = tuple((n, *_stat(tag_dir / n)) for n in names)
    except OSError:  # a file went away while listing: check without the memory
        return _checked_problem.__wrapped__(str(tag_dir), ())
    return _checked_problem(str(tag_dir), stamp)


def _stat(path: Path) -> tuple[int, int]:
    st = path.lstat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _checked_problem(tag: str, _stamp: tuple) -> str | None:
    """:func:`checkpoint_problem` of the tag directory ``tag`` (``_stamp``: its files' names,
    sizes and mtimes, the key that makes a changed tag be checked again)."""
    tag_dir = Path(tag)
    why = entries_problem(tag_dir)  # before any file is read: all inside the tag
    if why is not None:
        return why
    try:
        safe_load.verify_tag(tag_dir)
    except safe_load.UnsafeFileError as e:
        return str(e)
    why = manifest_problem(tag_dir, hashes=False)  # sizes only: cheap on every rank
    if why is not None:
        return why
    for name, parse, what in _SAVED_RECORDS:
        f = tag_dir / name
        try:
            if f.exists() and not _is_record(name, parse(f)):
                return f"{f}: not {what}"
        except (OSError, received.ReceivedFileError) as e:
            return f"{f}: unreadable ({first_line(e)})"
    return None


_SAVED_RECORDS = (
    (
        LAYOUT,
        received.load_json,
        "a layout record (tp, pp, dp, zero_stage, pipeline_unit[, schedule, virtual_stages])",
    ),
    (TAPER_PLAN, received.load_json, "a taper plan (a mapping with its widths)"),
    (CONFIG, received.load_yaml, "a complete configuration (a mapping, without 'base')"),
)


_LAYOUT_KEYS = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}  # each key's least value


def _is_record(name: str, data: Any) -> bool:
    """Whether ``data``, parsed from the tag's file ``name``, has the shape we write."""
    if not isinstance(data, dict):
        return False
    if name == LAYOUT:
        counts = all(type(data.get(k)) is int and data[k] >= lo for k, lo in _LAYOUT_KEYS.items())
        virtual = "virtual_stages" not in data or (
            type(data["virtual_stages"]) is int and data["virtual_stages"] >= 1
        )
        return counts and virtual and set(data) <= set(RECORD_KEYS)
    if name == TAPER_PLAN:
        widths = data.get("widths")
        return isinstance(widths, list) and all(type(w) is int and w > 0 for w in widths)
    return "base" not in data


def _quiet(line: str) -> None:
    """The default ``note`` of :func:`find_resume`: say nothing."""


def find_resume(
    cfg: Config, note: Callable[[str], None] = _quiet, known: dict[str, str] | None = None
) -> tuple[Path, str] | None:
    """Where ``train.resume`` points: ``(load_dir, tag)`` or ``None`` for a fresh start.

    ``auto``: the first usable checkpoint of :func:`~tapered_megatron.checkpoint.layout.
    resume_candidates` in ``train.save_dir`` (``latest`` if it names a complete tag there, then
    older complete ones), else ``None``. A path may name a save directory (the same choice) or one
    ``global_stepN`` directory. A candidate with a :func:`checkpoint_problem` is passed over with
    a one-line ``note`` naming the problem, as is a ``latest`` that is not followed; when every
    complete checkpoint has one, :class:`ConfigError`. ``known`` maps tags to problems found
    already (the trainer's shared sha256 check, :func:`hash_problem`).
    """
    known = known or {}
    how = cfg.train.resume
    if not how:
        return None
    if how != "auto" and is_tag(Path(how).name):
        p = Path(how)
        if not is_complete(p):
            raise FileNotFoundError(f"train.resume: {p} is not a complete checkpoint")
        why = known.get(p.name) or checkpoint_problem(p)
        if why is not None:
            raise ConfigError(f"train.resume: {why}; resume from another checkpoint")
        return p.parent, p.name
    save_dir = Path(cfg.train.save_dir if how == "auto" else how)
    candidates = resume_candidates(save_dir)
    if how != "auto" and not candidates:
        raise FileNotFoundError(f"train.resume: no complete checkpoint under {save_dir}")
    why_latest = latest_problem(save_dir)
    if why_latest is not None:
        note(f"{why_latest}; ignored")
    problems = []
    for tag in candidates:
        why = known.get(tag) or checkpoint_problem(save_dir / tag)
        if why is None:
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                note(f"{problems[0]}{more}; resuming from the older {save_dir / tag}")
            return save_dir, tag
        problems.append(why)
    if problems:
        raise ConfigError(
            f"train.resume: no usable checkpoint in {save_dir} (newest: {problems[0]}); "
            "restore its files or start a new --train.save_dir"
        )
    return None


def load(engine: Any, load_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer, scheduler and this rank's RNG states; return the client state."""
    path, client = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load {load_dir / tag}")
    rng_file = load_dir / tag / f"rng_rank{rank():05d}.pt"
    if rng_file.exists():
        set_rng_state(safe_load.load(rng_file))
    else:
        print(
            f"rank {rank()}: {rng_file} is missing: random streams start fresh (dropout masks "
            "differ from the uninterrupted run's)",
            flush=True,
        )
    return client or {}
