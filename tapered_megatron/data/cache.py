"""On-disk cache of index arrays: one builder at a time (file lock, rank 0 first), atomic."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np


def digest(*parts: bytes | str | np.ndarray, length: int = 20) -> str:
    """Hex digest of everything that determines a cached artefact."""
    h = hashlib.blake2b(digest_size=length)
    for p in parts:
        if isinstance(p, np.ndarray):
            p = np.ascontiguousarray(p).tobytes()
        elif isinstance(p, str):
            p = p.encode("utf-8", "surrogateescape")  # paths may hold any bytes
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if needed); blocks until acquired."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _dist_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_once(
    directory: str | os.PathLike,
    build: Callable[[Path], None],
    barrier: bool = True,
) -> Path:
    """Make sure ``directory`` exists, complete, built by exactly one process; return it.

    ``build(tmp_dir)`` writes the artefacts into a fresh temporary folder, which is then renamed
    to ``directory`` (atomic on POSIX), so readers never see a half-built cache. Concurrent
    processes serialise on ``directory + ".lock"``; the first to get it builds, the rest find it
    done. Under an initialised ``torch.distributed`` (and ``barrier``), rank 0 goes first and the
    others wait at a barrier, so every rank must call this (it is collective).
    """
    final = Path(directory)
    rank, world = _dist_rank_world()
    use_barrier = barrier and world > 1

    def ensure() -> None:
        if (final / "meta.json").exists():
            return
        with file_lock(str(final) + ".lock"):
            if (final / "meta.json").exists():
                return
            tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                build(tmp)
                if not (tmp / "meta.json").exists():
                    (tmp / "meta.json").write_text("{}")
                if final.exists():  # a stale, incomplete folder (no meta.json): replace it
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

    if use_barrier:
        import torch.distributed as dist

        if rank == 0:
            ensure()
        dist.barrier()
    ensure()
    return final


def save_arrays(directory: Path, meta: dict, **arrays: np.ndarray) -> None:
    for name, arr in arrays.items():
        np.save(directory / f"{name}.npy", arr, allow_pickle=False)
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def load_arrays(directory: Path, *names: str) -> list[np.ndarray]:
    return [np.load(directory / f"{n}.npy", mmap_mode="r", allow_pickle=False) for n in names]
