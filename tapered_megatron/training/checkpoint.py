"""Checkpoints: DeepSpeed's save/load plus our client state, written so ``latest`` never lies.

The directory layout (names, tags, completeness) is :mod:`tapered_megatron.checkpoint_layout`.

Consumed samples and the iteration travel in DeepSpeed's client state. ``--train.resume auto``
picks the checkpoint named by ``latest`` if it is complete, else the newest complete one; a
directory that lacks ``complete`` (a crash mid-save) is never loaded, and one whose files do not
load as plain data or parse is passed over for the next older one. Every file is read with
:mod:`tapered_megatron.safe_load` (DeepSpeed's are verified that way before its engine loads
them). Only the newest ``train.keep_last`` complete checkpoints are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from tapered_megatron import parallel, received, safe_load
from tapered_megatron.checkpoint_layout import (
    COMPLETE,
    CONFIG,
    LATEST,
    LAYOUT,
    LOCK,
    TAPER_PLAN,
    complete_tags,
    digests,
    entries_problem,
    is_complete,
    is_tag,
    iteration_of,
    latest_problem,
    latest_tag,
    lock_holder,
    lock_save_dir,
    manifest,
    manifest_problem,
    resume_candidates,
    saved_bytes,
    saved_layout,
    tag_entries,
    tag_files,
    tag_of,
    tags,
)
from tapered_megatron.config import Config, ConfigError
from tapered_megatron.config_fields import first_line
from tapered_megatron.parallel.random import set_rng_state
from tapered_megatron.training.faults import crash_point

# Bytes per parameter in a DeepSpeed checkpoint: the module's weights plus Adam's fp32 moments
# (and, with fp16/bf16 weights, the fp32 master copy).
_FP32_CKPT_BYTES = 4 + 8
_HALF_CKPT_BYTES = 2 + 12
# ... plus, with train.universal_checkpoint, the layout-free copy: fp32 weight + two moments.
_UNIVERSAL_CKPT_BYTES = 12


def layout_record(cfg: Config, layout: Any) -> dict[str, Any]:
    """The parallel layout (:class:`~tapered_megatron.training.launch.Layout`) a checkpoint is
    saved or resumed under (``layout.json``). A virtual-stage schedule adds ``schedule`` and
    ``virtual_stages`` (its DeepSpeed files hold a rank's chunks, not a 1F1B stage)."""
    out = {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "zero_stage": layout.zero_stage,
        "pipeline_unit": cfg.parallel.pipeline_unit if layout.pp > 1 else "none",
    }
    if layout.pp > 1 and cfg.parallel.schedule != "1f1b":
        out.update(schedule=cfg.parallel.schedule, virtual_stages=cfg.parallel.virtual_stages)
    return out


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
    return tr.micro_batch_size * layout["dp"] if layout and "dp" in layout else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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
    return f"rank {_rank()}: {why}" if _world() > 1 else why


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
        if _world() > 1:
            causes = [None] * _world()
            dist.all_gather_object(causes, self.cause)
        cause = next((c for c in causes if c), None)
        if cause is None:
            return
        line = [_save_failed(cfg, engine, tag_dir, cause) if _rank() == 0 else None]
        if _world() > 1:
            dist.broadcast_object_list(line, src=0)
        raise SaveFailed(line[0])


def save(
    engine: Any,
    cfg: Config,
    iteration: int,
    consumed_samples: int,
    extra: dict[str, Any] | None = None,
    also: Callable[[Path, dict[str, Any], Callable[[Any, Path], None]], None] | None = None,
    layout: dict[str, Any] | None = None,
    lineage: Lineage | None = None,
) -> Path:
    """Save a checkpoint on every rank, then mark it complete, point ``latest`` at it and
    :func:`prune` (``lineage``: what the run resumed from and saved, the new tag added).

    ``also(tag_dir, client_state, torch_save)`` writes more files into the checkpoint, each with
    ``torch_save(obj, path)``, before it is marked complete (the trainer's layout-free copy,
    :mod:`tapered_megatron.training.reshard`); ``layout`` (:func:`layout_record`) is written as
    ``layout.json``. A write that fails on any rank (a full disk) ends the save on every rank
    together with the same :class:`SaveFailed`, nothing of it left and ``latest`` unchanged.
    Collective: every rank must call it. Returns the checkpoint directory.
    """
    save_dir = Path(cfg.train.save_dir)
    tag = tag_of(iteration)
    tag_dir = save_dir / tag
    if _rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():  # a stale, possibly partial directory of an earlier run
            shutil.rmtree(tag_dir)
    _barrier()
    client = {"iteration": iteration, "consumed_samples": consumed_samples, **(extra or {})}
    writes = _Writes()
    try:
        with writes.deepspeed(engine):
            engine.save_checkpoint(str(save_dir), tag=tag, client_state=client, save_latest=False)
        crash_point("rank_files")
        writes(lambda: tag_dir.mkdir(parents=True, exist_ok=True))
        writes.torch_save(parallel.get_rng_state(), tag_dir / f"rng_rank{_rank():05d}.pt")
        if also is not None:
            also(tag_dir, client, writes.torch_save)
        if _rank() == 0:
            writes((tag_dir / CONFIG).write_text, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            writes(
                (tag_dir / TAPER_PLAN).write_text, json.dumps(cfg.taper_plan.to_dict(), indent=1)
            )
            if layout is not None:
                writes((tag_dir / LAYOUT).write_text, json.dumps(layout) + "\n")
        writes.settle(cfg, engine, tag_dir)
        files = _digests(tag_dir)
        if _rank() == 0:
            crash_point("complete")
            marker = {"iteration": iteration, "consumed_samples": consumed_samples, "files": files}
            writes(_write_atomic, tag_dir / COMPLETE, json.dumps(marker) + "\n")
            crash_point("latest")
            writes(_write_atomic, save_dir / LATEST, tag)
        writes.settle(cfg, engine, tag_dir)
        if lineage is not None:
            lineage.saved.append(tag)
        if _rank() == 0:
            prune(save_dir, cfg.train.keep_last, lineage)
    except (OSError, RuntimeError) as e:  # a write outside ``writes``: this rank alone stops
        cause = _cause(e)
        if cause is None:
            raise
        raise SaveFailed(_save_failed(cfg, engine, tag_dir, cause)) from None
    return tag_dir


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _digests(tag_dir: Path) -> dict[str, list[Any]]:
    """The manifest of a fully written tag: every rank hashes its share of the files (every
    ``world``-th of the sorted list; the save directory is shared, as ``complete`` and
    ``latest`` already need) and rank 0 gets them all (collective)."""
    mine = digests(tag_dir, tag_files(tag_dir)[_rank() :: _world()])
    if _world() == 1:
        return mine
    parts: list[Any] = [None] * _world()
    dist.all_gather_object(parts, mine)
    return {n: d for part in parts for n, d in sorted(part.items())}


def hash_problem(tag_dir: Path) -> str | None:
    """:func:`~tapered_megatron.checkpoint_layout.manifest_problem` with the hashing shared by
    the ranks (collective: every rank gets the same answer)."""
    files = manifest(tag_dir) or {}
    why = manifest_problem(tag_dir, sorted(files)[_rank() :: _world()])
    if _world() == 1:
        return why
    found: list[Any] = [None] * _world()
    dist.all_gather_object(found, why)
    return next((w for w in found if w), None)


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


def checkpoint_problem(tag_dir: Path) -> str | None:
    """What makes a complete checkpoint unusable (one line), or None: a ``.pt`` file that does
    not load as plain data (:func:`tapered_megatron.safe_load.verify_tag`: truncated, overwritten,
    or a pickle naming code), a file whose size differs from the manifest, or a ``layout.json`` /
    ``taper_plan.json`` / ``config.yaml`` that does not parse.

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
_LAYOUT_NAMES = {"pipeline_unit", "schedule", "virtual_stages"}  # the other keys it may have


def _is_record(name: str, data: Any) -> bool:
    """Whether ``data``, parsed from the tag's file ``name``, has the shape we write."""
    if not isinstance(data, dict):
        return False
    if name == LAYOUT:
        counts = all(type(data.get(k)) is int and data[k] >= lo for k, lo in _LAYOUT_KEYS.items())
        virtual = "virtual_stages" not in data or (
            type(data["virtual_stages"]) is int and data["virtual_stages"] >= 1
        )
        return counts and virtual and set(data) <= {*_LAYOUT_KEYS, *_LAYOUT_NAMES}
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

    ``auto``: the first usable checkpoint of :func:`~tapered_megatron.checkpoint_layout.
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
    Rank 0 takes the directory's lock (:func:`~tapered_megatron.checkpoint_layout.
    lock_save_dir`, released when the process ends, even by ``kill -9``), checks again that no
    other run's checkpoints are there (:func:`owner_problem`) and, with ``train.start_over``,
    moves them aside (:func:`move_aside`). Every rank raises the same :class:`SaveDirTaken`
    when the directory is another job's or run's."""
    held, why, note = _claim(cfg) if _rank() == 0 else (None, None, None)
    said = [why, note]
    if _world() > 1:
        dist.broadcast_object_list(said, src=0)
    try:
        if said[0] is not None:
            raise SaveDirTaken(said[0])
        if said[1] is not None and _rank() == 0:
            print(said[1], flush=True)
        yield
    finally:
        if held is not None:
            held.close()


def load(engine: Any, load_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer, scheduler and this rank's RNG states; return the client state."""
    path, client = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load {load_dir / tag}")
    rng_file = load_dir / tag / f"rng_rank{_rank():05d}.pt"
    if rng_file.exists():
        set_rng_state(safe_load.load(rng_file))
    else:
        print(
            f"rank {_rank()}: {rng_file} is missing: random streams start fresh (dropout masks "
            "differ from the uninterrupted run's)",
            flush=True,
        )
    return client or {}
