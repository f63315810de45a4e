"""Real ``pretrain/main.py`` ranks for the tests: a tiny model, launch and read back.

Every launch trains the same tiny tapered model on the same synthetic corpus (the ``corpus``
fixture of ``conftest.py``) with the same seed and global batch (8 samples); tests change the
layout, the ds_config or the run's arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tapered_megatron.parallel.host import free_port

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


def job_env() -> dict[str, str]:
    """The environment of a job: single-threaded, unbuffered, no inherited world size."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def without(args: list[str], keys: set[str]) -> list[str]:
    """``args`` (flag value pairs) minus the flags in ``keys``."""
    pairs = zip(args[::2], args[1::2])
    return [x for k, v in pairs if k not in keys for x in (k, v)]


def common_args(corpus: str, out: Path, ds: str, extra: list[str]) -> list[str]:
    """``pretrain/main.py`` arguments of the tiny model on ``corpus`` writing under ``out``
    (``extra`` replaces the tiny model's flags it repeats)."""
    tiny = without(TINY, {a for a in extra if a.startswith("--")})
    return [
        "--ds_config", str(ROOT / "ds_configs" / ds), *tiny,
        "--data.path", corpus, "--data.cache_dir", str(out / "cache"),
        "--train.save_dir", str(out / "ckpt"), "--logging.metrics_file", str(out / "metrics.jsonl"),
        *extra,
    ]  # fmt: skip


def check_ranks(procs: list[subprocess.Popen], out: Path, timeout: float) -> None:
    """Wait for ``procs``; write their logs to ``out/log.txt``; fail naming a failed rank."""
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


def launch_ranks(
    n: int,
    corpus: str,
    out: Path,
    ds: str,
    extra: list[str],
    timeout: float = 240,
    wrapper: tuple[str, ...] = (),
) -> None:
    """Start ``n`` ranks the way DeepSpeed's launcher does (RANK/LOCAL_RANK/WORLD_SIZE env);
    ``wrapper``: a script that runs ``pretrain/main.py`` (e.g. ``fp16_on_cpu.py``).

    Afterwards no shared-memory file of DeepSpeed's CPU all-reduce may be left in ``/dev/shm``.
    """
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(job_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_SIZE=str(n))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [
            sys.executable,
            "-u",
            *wrapper,
            MAIN,
            f"--local_rank={r}",
            *common_args(corpus, out, ds, extra),
        ]
        procs.append(popen_job(cmd, env))
    check_ranks(procs, out, timeout)
    left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"))
    assert not left, f"shared-memory files left behind: {left}"


def popen_job(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in the repository root, stdout and stderr captured together."""
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def metrics(out: Path) -> list[dict]:
    """Per-iteration records written by rank 0 (several runs append)."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    """The training loss of every logged iteration."""
    return [r["loss"] for r in metrics(out)]


def grad_norms(out: Path) -> list[float]:
    """The gradient norm of every logged iteration."""
    return [r["grad_norm"] for r in metrics(out)]


def assert_close(a: list[float], b: list[float], rtol: float = RTOL) -> None:
    """Equal lengths and every value within ``rtol``."""
    assert len(a) == len(b), (a, b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=0)


def reseal(tag_dir: Path) -> None:
    """Rewrite the manifest in a checkpoint's ``complete`` for its files as they are now (a
    checkpoint whose sender or saver wrote these files consistently)."""
    from tapered_megatron.checkpoint.layout import COMPLETE
    from tapered_megatron.checkpoint.manifest import digests

    marker = json.loads((tag_dir / COMPLETE).read_text())
    marker["files"] = digests(tag_dir)
    (tag_dir / COMPLETE).write_text(json.dumps(marker))


_HOLD = """
import sys, time
from pathlib import Path
from tapered_megatron.checkpoint.layout import lock_save_dir
held = lock_save_dir(Path(sys.argv[1]))
print("held" if held else "busy", flush=True)
time.sleep(600)
"""


def hold_save_dir(save_dir: Path) -> subprocess.Popen:
    """A process holding ``save_dir``'s lock (as a running job does) until it is killed."""
    holder = popen_job([sys.executable, "-c", _HOLD, str(save_dir)], job_env())
    line = holder.stdout.readline().strip()
    if line != "held":
        holder.kill()
        holder.wait()
        raise AssertionError(f"the lock of {save_dir} was not taken: {line!r}")
    return holder
