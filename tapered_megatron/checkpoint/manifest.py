"""Checkpoint and export manifests: the size and sha256 of every file of a tag (recorded in its
``complete`` marker) or of an export (``manifest.json``), written and checked here (no torch,
no process group). Several files are hashed at once (``HASH_THREADS``)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from tapered_megatron.checkpoint.layout import COMPLETE, complete_tags, is_tag, iteration_of

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


HASH_THREADS = 8  # files hashed at once per process (at most its cores)


EXPORT_MANIFEST = "manifest.json"


MAX_FILE_BYTES = 1 << 50  # a manifest entry above 1 PiB is absurd: the checkpoint is unusable


MAX_RECORD_BYTES = 256 << 20  # a manifest file larger than this is not read


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
