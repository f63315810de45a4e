"""Ownership of ``train.save_dir``: one job at a time writes there (its lock, held for the run),
and a run never writes beside another run's checkpoints unless it continues them or moves
them aside (``train.start_over``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tapered_megatron.checkpoint.collective import rank, world_size
from tapered_megatron.checkpoint.layout import (
    LATEST,
    LOCK,
    is_tag,
    lock_holder,
    lock_save_dir,
    tags,
)
from tapered_megatron.config import Config


class SaveDirTaken(RuntimeError):
    """``train.save_dir`` belongs to another job or run; the message says which and what to
    pass instead."""


EARLIER_RUN = "earlier-run-{}"  # where --train.start_over moves a save directory's checkpoints


def owner_problem(cfg: Config) -> str | None:
    """Why this run may not write into ``train.save_dir`` (one line), or None: the directory
    holds checkpoints (a ``global_stepN`` or ``latest``) of another run, and the run neither
    continues them (``--resume auto``, or a ``train.resume`` inside the directory) nor starts
    over (``train.start_over``, which may not be combined with ``--resume auto``)."""
    tr = cfg.train
    save_dir = Path(tr.save_dir)
    if tr.start_over and tr.resume == "auto":
        return (
            "train.start_over moves aside the checkpoints --resume auto would continue; pass "
            "one of the two"
        )
    found = [tag for _, tag, _ in tags(save_dir)] + [LATEST] * (save_dir / LATEST).exists()
    if not found or tr.start_over or tr.resume == "auto":
        return None
    if tr.resume:
        src = Path(tr.resume)
        if (src.parent if is_tag(src.name) else src).resolve() == save_dir.resolve():
            return None
    listing = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (
        f"train.save_dir: {save_dir} holds another run's checkpoints ({listing}); pass --resume "
        "auto to continue that run, --train.start_over true to move them aside into "
        f"{save_dir / EARLIER_RUN.format('<UTC time>')}/ (nothing is deleted), or another "
        "--train.save_dir"
    )


def move_aside(save_dir: Path) -> Path | None:
    """Move every ``global_stepN`` and ``latest`` of ``save_dir`` into a new
    ``earlier-run-<UTC time>/`` beside them (renames: nothing is copied or deleted); returns
    that directory, None when there was nothing to move."""
    found = [save_dir / tag for _, tag, _ in tags(save_dir)]
    found += [save_dir / LATEST] * (save_dir / LATEST).exists()
    if not found:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = save_dir / EARLIER_RUN.format(stamp)
    n = 1
    while aside.exists():
        n += 1
        aside = save_dir / EARLIER_RUN.format(f"{stamp}-{n}")
    aside.mkdir()
    for f in found:
        os.replace(f, aside / f.name)
    return aside


def _claim(cfg: Config) -> tuple[Any, str | None, str | None]:
    """Rank 0's part of :func:`own_save_dir`: ``(lock file, refusal, note)``."""
    save_dir = Path(cfg.train.save_dir)
    try:
        held = lock_save_dir(save_dir)
    except OSError as e:
        return None, f"train.save_dir: cannot lock {save_dir / LOCK} ({e.strerror})", None
    if held is None:
        busy = f"{lock_holder(save_dir)} holds {save_dir / LOCK}"
        why = f"train.save_dir: {save_dir} is in use by another job ({busy}); wait for it to end"
        return None, f"{why} or pass another --train.save_dir", None
    why = owner_problem(cfg)  # again, under the lock: another job may have written meanwhile
    note = None
    if why is None and cfg.train.start_over:
        aside = move_aside(save_dir)
        if aside is not None:
            note = f"train.start_over: the earlier checkpoints of {save_dir} moved to {aside}"
    return held, why, note


@contextlib.contextmanager
def own_save_dir(cfg: Config) -> Iterator[None]:
    """Hold ``train.save_dir`` for the run inside the block (collective: every rank calls it).
    Rank 0 takes the directory's lock (:func:`~tapered_megatron.checkpoint.layout.
    lock_save_dir`, released when the process ends, even by ``kill -9``), checks again that no
    other run's checkpoints are there (:func:`owner_problem`) and, with ``train.start_over``,
    moves them aside (:func:`move_aside`). Every rank raises the same :class:`SaveDirTaken`
    when the directory is another job's or run's."""
    held, why, note = _claim(cfg) if rank() == 0 else (None, None, None)
    said = [why, note]
    if world_size() > 1:
        dist.broadcast_object_list(said, src=0)
    try:
        if said[0] is not None:
            raise SaveDirTaken(said[0])
        if said[1] is not None and rank() == 0:
            print(said[1], flush=True)
        yield
    finally:
        if held is not None:
            held.close()
