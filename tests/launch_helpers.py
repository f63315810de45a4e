"""Real ``pretrain/main.py`` ranks for the tests: a tiny model, a tiny corpus, launch and read back.

Every launch trains the same tiny tapered model on the same synthetic corpus with the same seed
and global batch (8 samples); tests change the layout, the ds_config or the run's arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tapered_megatron.parallel.local_launch import free_port

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "pretrain" / "main.py")

TINY = [
    "--model.d_model", "32", "--model.heads", "2", "--model.layers", "2", "--model.d_ff", "64",
    "--model.seq_len", "16", "--model.vocab_size", "256", "--taper.multiple", "16",
    "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--train.iters", "20",
    "--train.warmup_iters", "3", "--train.lr", "1e-2", "--train.min_lr", "1e-3",
    "--eval.interval", "10", "--eval.iters", "1", "--logging.interval", "5",
]  # fmt: skip
RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small learnable token corpus (arithmetic runs) as a Megatron .bin/.idx pair."""
    from tapered_megatron.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = []
    for _ in range(300):
        start, step, n = rng.integers(0, 255), rng.integers(1, 4), rng.integers(12, 48)
        docs.append([*((start + step * np.arange(n)) % 255).tolist(), 255])
    prefix = str(tmp_path_factory.mktemp("corpus") / "tiny_text_document")
    write_indexed_dataset(prefix, docs)
    return prefix


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def _without(args: list[str], keys: set[str]) -> list[str]:
    """``args`` (flag value pairs) minus the flags in ``keys``."""
    pairs = zip(args[::2], args[1::2])
    return [x for k, v in pairs if k not in keys for x in (k, v)]


def _common(corpus: str, out: Path, ds: str, extra: list[str]) -> list[str]:
    tiny = _without(TINY, {a for a in extra if a.startswith("--")})
    return [
        "--ds_config", str(ROOT / "ds_configs" / ds), *tiny,
        "--data.path", corpus, "--data.cache_dir", str(out / "cache"),
        "--train.save_dir", str(out / "ckpt"), "--logging.metrics_file", str(out / "metrics.jsonl"),
        *extra,
    ]  # fmt: skip


def _check(procs: list[subprocess.Popen], out: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    logs = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(stdout)
    (out / "log.txt").write_text("\n".join(logs))
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not bad, f"ranks {bad} failed:\n{logs[bad[0]][-4000:]}"


def launch_ranks(n: int, corpus: str, out: Path, ds: str, extra: list[str], timeout=240) -> None:
    """Start ``n`` ranks the way DeepSpeed's launcher does (RANK/LOCAL_RANK/WORLD_SIZE env).

    Afterwards no shared-memory file of DeepSpeed's CPU all-reduce may be left in ``/dev/shm``.
    """
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_SIZE=str(n))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-u", MAIN, f"--local_rank={r}", *_common(corpus, out, ds, extra)]
        procs.append(_popen(cmd, env))
    _check(procs, out, timeout)
    left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"))
    assert not left, f"shared-memory files left behind: {left}"


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def metrics(out: Path) -> list[dict]:
    """Per-iteration records written by rank 0 (several runs append)."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out)]


def grad_norms(out: Path) -> list[float]:
    return [r["grad_norm"] for r in metrics(out)]


def assert_close(a: list[float], b: list[float], rtol: float = RTOL) -> None:
    assert len(a) == len(b), (a, b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=0)
