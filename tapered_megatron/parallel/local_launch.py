"""Run a function in several real local processes joined by a gloo process group.

Used by the distributed tests and the benchmark scripts to stand in for ranks on one machine.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters, initialises
``torch.distributed`` (gloo, CPU) in each, calls ``fn(rank, world_size, *args)`` and returns the
list of per-rank return values (anything picklable). A failure on any rank fails the caller with
that rank's traceback, and a rank that dies without reporting (killed, out of memory) fails it
at once. ``fn`` must be a module-level function of an importable module.
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from tapered_megatron.parallel.host import free_port, shm_workspace_path


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # killed (e.g. out of memory) before it could report
                    code = procs[dead[0]].exitcode
                    raise RuntimeError(f"rank {dead[0]} died (exit code {code})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for r in range(world_size):  # made if ``fn`` started DeepSpeed's comm, even if killed
            shm_workspace_path(r, "127.0.0.1", port).unlink(missing_ok=True)
    return [results[r] for r in range(world_size)]
