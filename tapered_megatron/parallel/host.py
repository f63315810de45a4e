"""Helpers for the processes of one host: a free TCP port, and the ``/dev/shm`` files DeepSpeed's
CPU all-reduce leaves behind. A leaf module, shared by the launcher and the local test ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port() -> int:
    """An unused TCP port on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_workspace_path(rank: int, addr: str | None = None, port: int | str | None = None) -> Path:
    """The ``/dev/shm`` file DeepSpeed's CPU shared-memory all-reduce creates for ``rank``.

    DeepSpeed's CPU communication op (built when every rank is on one host, ``LOCAL_SIZE`` equal
    to the world size) creates one such file per rank, named after the user, the rendezvous
    address and port (default: ``MASTER_ADDR`` / ``MASTER_PORT``), and never removes it.
    """
    addr = os.environ.get("MASTER_ADDR", "") if addr is None else addr
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"
