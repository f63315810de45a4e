"""The checkpoint directory layout: names, tags and completeness, read by training, pre-flight
and export (no torch, no process group).

Layout of ``train.save_dir``::

    global_step100/            DeepSpeed's files (model / optimizer / scheduler per rank)
        rng_rank00000.pt ...   RNG states of every rank (python, numpy, torch, accelerator)
        config.yaml            the resolved configuration of the run
        taper_plan.json        the taper plan (widths per layer)
        layout.json            the parallel layout it was saved under (TP, PP, DP, ZeRO, unit)
        universal/             layout-free copy (train.universal_checkpoint; training/reshard.py)
        complete               written by rank 0 after every rank finished writing
    latest                     "global_step100", replaced atomically after ``complete``
    job.lock                   held (``flock``) by the one job writing here (:func:`lock_save_dir`)

A tag without ``complete`` (a save cut short) is never loaded or exported. ``complete`` also
holds the checkpoint's manifest: the size and sha256 of every other file of the tag
(:func:`manifest_problem` checks them), several files hashed at once (``HASH_THREADS``). An export
directory records the same manifest in ``manifest.json`` (:data:`EXPORT_MANIFEST`,
:func:`write_manifest`).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import os
import re
import socket
from pathlib import Path, PurePosixPath
from typing import IO, Any

COMPLETE = "complete"
LATEST = "latest"
LAYOUT = "layout.json"
CONFIG = "config.yaml"
TAPER_PLAN = "taper_plan.json"
HASH_THREADS = 8  # files hashed at once per process (at most its cores)
UNIVERSAL, UNIVERSAL_META = "universal", "meta.pt"
EXPORT_MANIFEST = "manifest.json"
LOCK = "job.lock"
_TAG = re.compile(r"^global_step(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_FILE_BYTES = 1 << 50  # a manifest entry above 1 PiB is absurd: the checkpoint is unusable
MAX_RECORD_BYTES = 256 << 20  # a manifest file larger than this is not read


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


def saved_layout(tag_dir: Path) -> dict[str, Any] | None:
    """The layout a checkpoint was saved under; ``None`` for one written before ``layout.json``."""
    from tapered_megatron.received import load_json

    f = tag_dir / LAYOUT
    return load_json(f) if f.exists() else None


def describe_layout(rec: dict[str, Any]) -> str:
    """``TP2 PP1 DP1 ZeRO-1 unit none`` (keys a record lacks are left out), with ``schedule
    interleaved v2`` for a virtual-stage schedule."""
    names = (("tp", "TP{}"), ("pp", "PP{}"), ("dp", "DP{}"), ("zero_stage", "ZeRO-{}"))
    words = [fmt.format(rec[k]) for k, fmt in names if k in rec]
    words.append(f"unit {rec.get('pipeline_unit', 'none')}")
    if "schedule" in rec:
        words.append(f"schedule {rec['schedule']} v{rec.get('virtual_stages', 1)}")
    return " ".join(words)


def has_universal(tag_dir: Path) -> bool:
    """Whether a checkpoint holds the layout-free copy (``train.universal_checkpoint``)."""
    return (tag_dir / UNIVERSAL / UNIVERSAL_META).exists()


def tag_entries(tag_dir: Path) -> tuple[list[str], list[str]]:
    """``(plain files, other entries)`` under a tag (or export), as sorted paths relative to
    it; other entries are symbolic links (never followed) and anything not a file or directory."""
    files, other = [], []
    for root, dirs, names in os.walk(tag_dir):  # a link to a directory is listed, not entered
        for name in dirs + names:
            f = Path(root) / name
            rel = f.relative_to(tag_dir).as_posix()
            if f.is_symlink() or not (f.is_dir() or f.is_file()):
                other.append(rel)
            elif f.is_file():
                files.append(rel)
    return sorted(files), sorted(other)


def tag_files(tag_dir: Path, record: str = COMPLETE) -> list[str]:
    """Every plain file of a tag (or export) but the manifest's own ``record``, as sorted paths
    relative to it (the manifest's keys)."""
    return [name for name in tag_entries(tag_dir)[0] if name != record]


def file_digest(path: Path, chunk: int = 8 << 20) -> list[Any]:
    """``[size, sha256 hex]`` of one file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return [size, h.hexdigest()]


def _digest_all(tag_dir: Path, names: list[str]) -> list[list[Any]]:
    """:func:`file_digest` of each of ``names``, several files at once (hashlib releases the
    GIL, so each thread hashes on its own core; one file is one sequential stream)."""
    threads = max(1, min(HASH_THREADS, len(os.sched_getaffinity(0)), len(names)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda n: file_digest(tag_dir / n), names))


def digests(tag_dir: Path, names: list[str] | None = None) -> dict[str, list[Any]]:
    """``{name: [size, sha256]}`` of ``names`` (default: every file of the tag but ``complete``),
    the manifest ``complete`` records."""
    names = tag_files(tag_dir) if names is None else names
    return dict(zip(names, _digest_all(tag_dir, names)))


def write_manifest(folder: Path, record: str = EXPORT_MANIFEST) -> None:
    """Record the manifest of every other file of ``folder`` in ``folder / record`` (an export's
    ``manifest.json``: ``{"files": {name: [size, sha256]}}``, the key ``complete`` uses)."""
    files = digests(folder, tag_files(folder, record))
    (folder / record).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _record(tag_dir: Path, record: str) -> dict[str, Any] | None:
    """The JSON object in ``tag_dir / record``, None when it does not read as one."""
    f = tag_dir / record
    try:
        if f.is_symlink() or f.stat().st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def manifest(tag_dir: Path, record: str = COMPLETE) -> dict[str, Any] | None:
    """The ``files`` mapping ``record`` holds (None when there is none: such a directory is
    unusable, :func:`entries_problem`)."""
    files = (_record(tag_dir, record) or {}).get("files")
    return files if isinstance(files, dict) else None


def saved_bytes(save_dir: Path) -> int | None:
    """The size on disk of the newest complete checkpoint in ``save_dir`` whose files match its
    manifest's names and sizes (every rank's files), or None when there is none."""
    for _, tag in reversed(complete_tags(save_dir)):
        if manifest_problem(save_dir / tag, hashes=False) is None:
            return sum(size for size, _ in (manifest(save_dir / tag) or {}).values())
    return None


def _record_problem(tag_dir: Path, record: str) -> str | None:
    """Why ``record`` is not a manifest: unreadable, ``files`` not a mapping, or (``complete``)
    its iteration or consumed samples not counts, the iteration not the tag's."""
    data = _record(tag_dir, record)
    f = tag_dir / record
    if data is None:
        return f"{f}: not a readable JSON object, so nothing says which files are the checkpoint's"
    if not isinstance(data.get("files"), dict):
        return (
            f"{f}: 'files' is {data.get('files')!r:.40}, not the mapping of every file to "
            "[size, sha256] (written by an older version, or changed)"
        )
    if record != COMPLETE:
        return None
    for key in ("iteration", "consumed_samples"):
        v = data.get(key)
        if type(v) is not int or not 0 <= v < 2**62:
            return f"{f}: {key} is {v!r:.40}, not a count"
    if is_tag(tag_dir.name) and data["iteration"] != iteration_of(tag_dir.name):
        return f"{f}: iteration {data['iteration']}, not the tag's {iteration_of(tag_dir.name)}"
    return None


def _entry_problem(tag_dir: Path, root: Path, name: Any, entry: Any, record: str) -> str | None:
    """Why one manifest entry is not ``[size, sha256]`` of a file inside ``tag_dir``."""
    valid = isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
    if not (valid and 0 <= entry[0] <= MAX_FILE_BYTES and _SHA256.match(str(entry[1]))):
        return f"{tag_dir / record}: lists {name!r} as {entry!r:.60}, not [size, sha256]"
    rel = PurePosixPath(name)
    plain = bool(name) and "\0" not in name and not rel.is_absolute() and str(rel) == name
    if not (plain and ".." not in rel.parts and (root / name).resolve().is_relative_to(root)):
        return f"{tag_dir / record}: lists {name!r:.200}, not a file inside {tag_dir}"
    return None


def entries_problem(tag_dir: Path, record: str = COMPLETE) -> str | None:
    """Why the manifest in ``record`` does not cover exactly the files of ``tag_dir`` (one
    line), or None; reads no listed file, only the manifest and the directory listing. The
    manifest must be a JSON object whose ``files`` maps names to ``[size, sha256]`` (a size
    from 0 to 1 PiB); each name a plain relative path (no ``..``, not absolute) that stays
    inside ``tag_dir`` once symlinks are resolved, so checking a received manifest never reads
    a file elsewhere; every plain file but ``record`` listed, every listed one there, and no
    symbolic link or other entry anywhere in the directory."""
    why = _record_problem(tag_dir, record)
    if why is not None:
        return why
    files = manifest(tag_dir, record) or {}
    root = tag_dir.resolve()
    for name, entry in files.items():
        why = _entry_problem(tag_dir, root, name, entry, record)
        if why is not None:
            return why
    present, other = tag_entries(tag_dir)
    if other:
        return f"{tag_dir / other[0]}: a symbolic link or special file; refused (only plain files)"
    unlisted = sorted(set(present) - set(files) - {record})
    if unlisted:
        return f"{tag_dir / unlisted[0]}: not in the manifest {record} (added after saving)"
    missing = sorted(set(files) - set(present))
    if missing:
        return f"{tag_dir / missing[0]}: missing (the manifest lists it)"
    return None


def manifest_problem(
    tag_dir: Path, names: list[str] | None = None, hashes: bool = True, record: str = COMPLETE
) -> str | None:
    """What in ``tag_dir`` differs from its manifest in ``record`` (one line), or None: no
    manifest, an entry naming anything but a file inside ``tag_dir``, a file unlisted or
    missing, a symbolic link (:func:`entries_problem`, before any file is read), a listed file
    of another size, or (``hashes``) of another sha256 (streamed); ``names`` limits the size
    and hash checks to those files."""
    why = entries_problem(tag_dir, record)
    if why is not None:
        return why
    files = manifest(tag_dir, record) or {}
    names = list(files if names is None else names)
    try:
        for name in names:
            size, f = files[name][0], tag_dir / name
            if f.stat().st_size != size:
                return f"{f}: {f.stat().st_size} bytes, the manifest records {size}"
        for name, (_, sha) in zip(names, _digest_all(tag_dir, names) if hashes else ()):
            if sha != files[name][1]:
                f = tag_dir / name
                return f"{f}: sha256 differs from the manifest's (the file changed after saving)"
    except OSError as e:
        return f"{e.filename}: unreadable ({e.strerror})"
    return None


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
