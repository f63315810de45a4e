"""``run_workers`` leaves nothing behind: DeepSpeed's CPU all-reduce files in ``/dev/shm``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tapered_megatron.parallel.local_launch import run_workers

pytestmark = pytest.mark.distributed


def _start_deepspeed_comm(rank: int, world_size: int, die: bool) -> str:
    """Start DeepSpeed's communication (which maps the shared-memory files); report this rank's."""
    import deepspeed

    from tapered_megatron.parallel.host import shm_workspace_path

    deepspeed.init_distributed(dist_backend="gloo")
    path = shm_workspace_path(rank)
    assert path.exists(), f"DeepSpeed made no {path}: the test would prove nothing"
    if die and rank == 1:
        os._exit(3)  # killed: no clean-up of its own runs
    return str(path)


def test_shared_memory_files_are_removed():
    paths = run_workers(_start_deepspeed_comm, 2, False)
    assert len(set(paths)) == 2
    assert not [p for p in paths if Path(p).exists()]


@pytest.mark.slow
def test_shared_memory_files_are_removed_when_a_rank_dies():
    before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    # rank 0 sees its peer gone at the closing barrier, or the parent sees rank 1's exit first
    with pytest.raises(RuntimeError, match=r"rank 1 died|rank 0 failed"):
        run_workers(_start_deepspeed_comm, 2, True, timeout=120)
    new = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - before
    ours = [p for p in new if p.name.startswith(f"deepspeed_allreduce_buffer_{os.getuid()}_127")]
    assert not ours, ours
