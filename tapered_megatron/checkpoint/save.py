"""Saving a checkpoint: DeepSpeed's save plus our client state and files, written so ``latest``
never lies, then pruning.

The directory layout (names, tags, completeness) is :mod:`tapered_megatron.checkpoint.layout`;
resuming is :mod:`tapered_megatron.checkpoint.resume`. Consumed samples and the iteration travel
in DeepSpeed's client state. A directory that lacks ``complete`` (a crash mid-save) is never
loaded; ``latest`` moves only after ``complete``. Only the newest ``train.keep_last`` usable
checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from tapered_megatron import parallel
from tapered_megatron.checkpoint.collective import barrier, rank, world_size
from tapered_megatron.checkpoint.layout import (
    COMPLETE,
    CONFIG,
    LATEST,
    LAYOUT,
    TAPER_PLAN,
    ParallelLayout,
    complete_tags,
    iteration_of,
    latest_tag,
    tag_of,
    tags,
)
from tapered_megatron.checkpoint.manifest import (
    digests,
    manifest_problem,
    saved_bytes,
    tag_files,
)
from tapered_megatron.config import Config
from tapered_megatron.training.faults import crash_point

# Bytes per parameter in a DeepSpeed checkpoint: the module's weights plus Adam's fp32 moments
# (and, with fp16/bf16 weights, the fp32 master copy).
_FP32_CKPT_BYTES = 4 + 8
_HALF_CKPT_BYTES = 2 + 12
# ... plus, with train.universal_checkpoint, the layout-free copy: fp32 weight + two moments.
_UNIVERSAL_CKPT_BYTES = 12


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a failing file system); the message
    names the directory, the free and the needed bytes, and what ``latest`` still names."""


def _write_failure(error: Exception) -> bool:
    """Whether ``error`` is a failed file write: an ``OSError``, or a ``RuntimeError`` raised
    inside ``torch.save`` (its C++ writer reports a full disk without errno, in words that vary:
    a stream error, an unexpected position)."""
    if isinstance(error, OSError):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename) == Path(torch.serialization.__file__)


def checkpoint_bytes(cfg: Config, half: bool) -> int:
    """The size of the next checkpoint in ``train.save_dir``: that of the newest complete one
    there (its manifest's files, every rank's), else the model's parameters x (weight +
    optimizer state) bytes (``half``: fp16/bf16 weights beside fp32 masters), plus the universal
    copy when ``train.universal_checkpoint`` is on."""
    from tapered_megatron.models import count_model

    saved = saved_bytes(Path(cfg.train.save_dir))
    if saved is not None:
        return saved
    per_param = _HALF_CKPT_BYTES if half else _FP32_CKPT_BYTES
    if cfg.train.universal_checkpoint:
        per_param += _UNIVERSAL_CKPT_BYTES
    return int(count_model(cfg).params_total) * per_param


def size_text(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps a digit before the point, and exactly."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def _cause(error: Exception) -> str | None:
    """What a failed write says (``rank N: ...`` in a job of several ranks), or None when
    ``error`` is not a failed write (:func:`_write_failure`)."""
    if isinstance(error, SaveFailed) or not _write_failure(error):
        return None
    why = (error.strerror or str(error)) if isinstance(error, OSError) else None
    why = why or "torch.save could not write its file"
    return f"rank {rank()}: {why}" if world_size() > 1 else why


def _save_failed(cfg: Config, engine: Any, tag_dir: Path, cause: str) -> str:
    """Remove the partial ``tag_dir`` and say why it failed in one line."""
    shutil.rmtree(tag_dir, ignore_errors=True)
    save_dir = tag_dir.parent
    half = bool(engine.fp16_enabled() or engine.bfloat16_enabled())
    need = checkpoint_bytes(cfg, half)
    latest = latest_tag(save_dir) or "no checkpoint"
    return (
        f"{save_dir}: writing checkpoint {tag_dir.name} failed ({cause}); "
        f"{size_text(shutil.disk_usage(save_dir).free)} free, a checkpoint needs about "
        f"{size_text(need)}; the partial {tag_dir.name} was removed and {LATEST} still "
        f"names {latest}. Free disk space (or pass a --train.save_dir on a larger disk) and "
        "resume with --train.resume auto"
    )


class _Writes:
    """This rank's writes into a checkpoint being saved. The first one that fails
    (:func:`_write_failure`) is kept and the later ones are skipped instead of raising, so the
    rank still takes part in every collective of the save (DeepSpeed's, the universal copy's)
    and all ranks learn of the failure together (:meth:`settle`)."""

    def __init__(self) -> None:
        self.cause: str | None = None

    def __call__(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``write(*args, **kwargs)``, unless an earlier write failed; a failed write is kept."""
        if self.cause is not None:
            return
        try:
            write(*args, **kwargs)
        except (OSError, RuntimeError) as e:
            self.cause = _cause(e)
            if self.cause is None:
                raise

    def torch_save(self, obj: Any, path: Path) -> None:
        """``torch.save(obj, path)`` as one of these writes."""
        self(torch.save, obj, path)

    @contextlib.contextmanager
    def deepspeed(self, engine: Any) -> Iterator[None]:
        """DeepSpeed's checkpoint files written as these writes while the block runs."""
        files = engine.checkpoint_engine
        save = files.save
        files.save = functools.partial(self, save)
        try:
            yield
        finally:
            del files.save

    def settle(self, cfg: Config, engine: Any, tag_dir: Path) -> None:
        """Raise :class:`SaveFailed` on every rank, the partial ``tag_dir`` removed, when a
        write failed on any rank (collective: the world group; rank 0 names the first
        failure, with the directory and the bytes a checkpoint needs, for all)."""
        causes = [self.cause]
        if world_size() > 1:
            causes = [None] * world_size()
            dist.all_gather_object(causes, self.cause)
        cause = next((c for c in causes if c), None)
        if cause is None:
            return
        line = [_save_failed(cfg, engine, tag_dir, cause) if rank() == 0 else None]
        if world_size() > 1:
            dist.broadcast_object_list(line, src=0)
        raise SaveFailed(line[0])


def save(
    engine: Any,
    cfg: Config,
    iteration: int,
    consumed_samples: int,
    extra: dict[str, Any] | None = None,
    also: Callable[[Path, dict[str, Any], Callable[[Any, Path], None]], None] | None = None,
    layout: ParallelLayout | None = None,
    lineage: Lineage | None = None,
) -> Path:
    """Save a checkpoint on every rank, then mark it complete, point ``latest`` at it and
    :func:`prune` (``lineage``: what the run resumed from and saved, the new tag added).

    ``also(tag_dir, client_state, torch_save)`` writes more files into the checkpoint, each with
    ``torch_save(obj, path)``, before it is marked complete (the trainer's layout-free copy,
    :mod:`tapered_megatron.checkpoint.universal`); ``layout``
    (:meth:`~tapered_megatron.checkpoint.layout.ParallelLayout.to_record`) is written as
    ``layout.json``. A write that fails on any rank (a full disk) ends the save on every rank
    together with the same :class:`SaveFailed`, nothing of it left and ``latest`` unchanged.
    Collective: every rank must call it. Returns the checkpoint directory.
    """
    save_dir = Path(cfg.train.save_dir)
    tag = tag_of(iteration)
    tag_dir = save_dir / tag
    if rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():  # a stale, possibly partial directory of an earlier run
            shutil.rmtree(tag_dir)
    barrier()
    client = {"iteration": iteration, "consumed_samples": consumed_samples, **(extra or {})}
    writes = _Writes()
    try:
        with writes.deepspeed(engine):
            engine.save_checkpoint(str(save_dir), tag=tag, client_state=client, save_latest=False)
        crash_point("rank_files")
        writes(lambda: tag_dir.mkdir(parents=True, exist_ok=True))
        writes.torch_save(parallel.get_rng_state(), tag_dir / f"rng_rank{rank():05d}.pt")
        if also is not None:
            also(tag_dir, client, writes.torch_save)
        if rank() == 0:
            writes((tag_dir / CONFIG).write_text, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            writes(
                (tag_dir / TAPER_PLAN).write_text, json.dumps(cfg.taper_plan.to_dict(), indent=1)
            )
            if layout is not None:
                writes((tag_dir / LAYOUT).write_text, json.dumps(layout.to_record()) + "\n")
        writes.settle(cfg, engine, tag_dir)
        files = _digests(tag_dir)
        if rank() == 0:
            crash_point("complete")
            marker = {"iteration": iteration, "consumed_samples": consumed_samples, "files": files}
            writes(_write_atomic, tag_dir / COMPLETE, json.dumps(marker) + "\n")
            crash_point("latest")
            writes(_write_atomic, save_dir / LATEST, tag)
        writes.settle(cfg, engine, tag_dir)
        if lineage is not None:
            lineage.saved.append(tag)
        if rank() == 0:
            prune(save_dir, cfg.train.keep_last, lineage)
    except (OSError, RuntimeError) as e:  # a write outside ``writes``: this rank alone stops
        cause = _cause(e)
        if cause is None:
            raise
        raise SaveFailed(_save_failed(cfg, engine, tag_dir, cause)) from None
    return tag_dir


def _digests(tag_dir: Path) -> dict[str, list[Any]]:
    """The manifest of a fully written tag: every rank hashes its share of the files (every
    ``world``-th of the sorted list; the save directory is shared, as ``complete`` and
    ``latest`` already need) and rank 0 gets them all (collective)."""
    mine = digests(tag_dir, tag_files(tag_dir)[rank() :: world_size()])
    if world_size() == 1:
        return mine
    parts: list[Any] = [None] * world_size()
    dist.all_gather_object(parts, mine)
    return {n: d for part in parts for n, d in sorted(part.items())}


@dataclasses.dataclass
class Lineage:
    """The checkpoints a run stands on: the tag it resumed from (None: a fresh start) and the
    tags it saved since, oldest first (what :func:`prune` may count as usable)."""

    resumed: str | None = None
    saved: list[str] = dataclasses.field(default_factory=list)


def usable_tags(save_dir: Path, lineage: Lineage | None = None) -> list[tuple[int, str]]:
    """``(iteration, tag)`` of the checkpoints of ``save_dir`` known to be usable, oldest
    first: those the run saved, the one it resumed from, and older complete ones whose
    manifest's entries and sizes match (no file is read). A tag newer than the resumed one that
    the run did not write was passed over at resume (unusable) and is never counted. Without a
    ``lineage`` (a save outside a run) every complete tag that matches its manifest counts."""
    known = {*lineage.saved, lineage.resumed} if lineage else set()
    start = iteration_of(lineage.resumed) if lineage and lineage.resumed else -1
    found = []
    for it, tag in complete_tags(save_dir):
        d = save_dir / tag
        sound = manifest_problem(d, hashes=False) is None
        if tag in known or (sound and (lineage is None or it < start)):
            found.append((it, tag))
    return found


def prune(save_dir: Path, keep_last: int, lineage: Lineage | None = None) -> None:
    """Delete every checkpoint older than the newest ``keep_last`` usable ones
    (:func:`usable_tags`); never the tag the run resumed from nor the one ``latest`` names. An
    unusable tag newer than the oldest kept stays (a later save of that step replaces it)."""
    usable = usable_tags(save_dir, lineage)
    if len(usable) <= keep_last:
        return
    oldest_kept = usable[-keep_last][0]
    spared = {lineage.resumed if lineage else None, latest_tag(save_dir)}
    for it, tag, _ in tags(save_dir):
        if it < oldest_kept and tag not in spared:
            shutil.rmtree(save_dir / tag, ignore_errors=True)
