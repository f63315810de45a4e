"""The checkpoint directory layout: names, tags, completeness and the save directory's lock,
read by training, pre-flight and export (no torch, no process group).

Layout of ``train.save_dir``::

    global_step100/            DeepSpeed's files (model / optimizer / scheduler per rank)
        rng_rank00000.pt ...   RNG states of every rank (python, numpy, torch, accelerator)
        config.yaml            the resolved configuration of the run
        taper_plan.json        the taper plan (widths per layer)
        layout.json            the parallel layout it was saved under (TP, PP, DP, ZeRO, unit)
        universal/             layout-free copy (train.universal_checkpoint; universal.py)
        complete               written by rank 0 after every rank finished writing
    latest                     "global_step100", replaced atomically after ``complete``
    job.lock                   held (``flock``) by the one job writing here (:func:`lock_save_dir`)

A tag without ``complete`` (a save cut short) is never loaded or exported. ``complete`` also
holds the checkpoint's manifest: the size and sha256 of every other file of the tag
(:mod:`tapered_megatron.checkpoint.manifest` writes and checks it).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import socket
from pathlib import Path
from typing import IO, Any

COMPLETE = "complete"
LATEST = "latest"
LAYOUT = "layout.json"
CONFIG = "config.yaml"
TAPER_PLAN = "taper_plan.json"
UNIVERSAL, UNIVERSAL_META = "universal", "meta.pt"
LOCK = "job.lock"
_TAG = re.compile(r"^global_step(\d+)$")


def tag_of(iteration: int) -> str:
    """DeepSpeed's tag for the checkpoint taken after ``iteration`` optimizer steps."""
    return f"global_step{iteration}"


def is_tag(name: str) -> bool:
    """Whether ``name`` is a ``global_stepN`` tag."""
    return _TAG.match(name) is not None


def iteration_of(tag: str) -> int:
    """The iteration of a ``global_stepN`` tag."""
    m = _TAG.match(tag)
    if m is None:
        raise ValueError(f"{tag!r} is not a global_stepN checkpoint tag")
    return int(m.group(1))


def is_complete(tag_dir: Path) -> bool:
    """Whether a ``global_stepN`` directory was fully written."""
    return (tag_dir / COMPLETE).exists()


def tags(save_dir: Path) -> list[tuple[int, str, bool]]:
    """``(iteration, tag, complete)`` of every ``global_stepN`` directory, oldest first."""
    if not save_dir.is_dir():
        return []
    found = [d for d in save_dir.iterdir() if is_tag(d.name) and d.is_dir()]
    return sorted((iteration_of(d.name), d.name, is_complete(d)) for d in found)


def complete_tags(save_dir: Path) -> list[tuple[int, str]]:
    """``(iteration, tag)`` of the complete checkpoints in ``save_dir``, oldest first."""
    return [(it, tag) for it, tag, done in tags(save_dir) if done]


def partial_tags(save_dir: Path, newer_than: int) -> list[str]:
    """Tags in ``save_dir`` after iteration ``newer_than`` that lack ``complete``, oldest first."""
    return [tag for it, tag, done in tags(save_dir) if it > newer_than and not done]


def latest_tag(save_dir: Path) -> str | None:
    """The tag ``latest`` names, if that file exists."""
    f = save_dir / LATEST
    if not f.is_file():
        return None
    with open(f, errors="replace") as text:
        return text.read(256).strip()  # a tag name; a longer file names no tag of ours


def latest_problem(save_dir: Path) -> str | None:
    """Why ``latest`` of ``save_dir`` is not followed (one line), or None when it names a
    complete ``global_stepN`` of this directory or does not exist."""
    tag = latest_tag(save_dir)
    if tag is None or (is_tag(tag) and is_complete(save_dir / tag)):
        return None
    if not is_tag(tag):
        return f"{save_dir / LATEST} names {tag!r}, not a plain global_stepN tag of this directory"
    return f"{save_dir / LATEST} names {tag}, which is not a complete checkpoint here"


def resume_candidates(save_dir: Path) -> list[str]:
    """The complete tags to resume from, best first: the one ``latest`` names (when it is a
    complete ``global_stepN`` of ``save_dir``; anything else is not followed), then every older
    complete tag, newest first (without a usable ``latest``: all complete tags, newest first)."""
    done = [tag for _, tag in reversed(complete_tags(save_dir))]
    latest = latest_tag(save_dir)
    if latest_problem(save_dir) is None and latest is not None:
        return done[done.index(latest) :]
    return done


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How a run's world is split and how its global batch is made of micro-batches.

    The split (TP x PP x DP, ZeRO stage, pipeline unit, pipeline schedule) is what a checkpoint
    records in ``layout.json`` (:meth:`to_record`, :meth:`from_record`); the batch shape
    (``world_size``, micro / global batch, accumulation) is not, and is 0 in a layout read back
    from a record. ``pipeline_unit`` is ``none`` and ``schedule`` ``1f1b`` without pipeline
    parallelism."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0  # the ds_config's zero_optimization.stage
    pipeline_unit: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    world_size: int = 0
    micro_batch_size: int = 0
    global_batch_size: int = 0
    grad_accum: int = 0

    def to_record(self) -> dict[str, Any]:
        """The split as written into ``layout.json``; a virtual-stage schedule adds
        ``schedule`` and ``virtual_stages`` (its DeepSpeed files hold a rank's chunks, not a
        1F1B stage)."""
        out: dict[str, Any] = {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "zero_stage": self.zero_stage,
            "pipeline_unit": self.pipeline_unit,
        }
        if self.schedule != "1f1b":
            out.update(schedule=self.schedule, virtual_stages=self.virtual_stages)
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ParallelLayout:
        """The layout a ``layout.json`` record describes (keys it lacks take their defaults)."""
        return cls(**{k: record[k] for k in RECORD_KEYS if k in record})

    def describe(self, counts: tuple[str, ...] = ("tp", "pp", "dp", "zero_stage")) -> str:
        """``TP2 PP1 DP1 ZeRO-1 unit none`` (only the ``counts`` named), with ``schedule
        interleaved v2`` for a virtual-stage schedule."""
        names = {"tp": "TP{}", "pp": "PP{}", "dp": "DP{}", "zero_stage": "ZeRO-{}"}
        words = [names[k].format(getattr(self, k)) for k in counts]
        words.append(f"unit {self.pipeline_unit}")
        if self.schedule != "1f1b":
            words.append(f"schedule {self.schedule} v{self.virtual_stages}")
        return " ".join(words)


RECORD_KEYS = (  # the keys a layout.json may hold
    "tp",
    "pp",
    "dp",
    "zero_stage",
    "pipeline_unit",
    "schedule",
    "virtual_stages",
)


def saved_layout(tag_dir: Path) -> ParallelLayout | None:
    """The layout a checkpoint was saved under; ``None`` for one written before ``layout.json``."""
    from tapered_megatron.checkpoint.received import load_json

    f = tag_dir / LAYOUT
    return ParallelLayout.from_record(load_json(f)) if f.exists() else None


def has_universal(tag_dir: Path) -> bool:
    """Whether a checkpoint holds the layout-free copy (``train.universal_checkpoint``)."""
    return (tag_dir / UNIVERSAL / UNIVERSAL_META).exists()


def lock_save_dir(save_dir: Path) -> IO[str] | None:
    """Take ``save_dir``'s lock for this process (created as needed): an exclusive ``flock``
    on ``save_dir / LOCK``, held while the returned file stays open and released by the kernel
    when the process ends, however it ends (``kill -9`` included). None when another process
    holds it (:func:`lock_holder` says which)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    f = open(save_dir / LOCK, "a+")  # noqa: SIM115 - open for as long as the lock is held
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def lock_holder(save_dir: Path) -> str:
    """Who holds ``save_dir``'s lock, as its holder wrote it (``pid N on HOST``)."""
    try:
        return (save_dir / LOCK).read_text()[:200].strip() or "another process"
    except OSError:
        return "another process"
