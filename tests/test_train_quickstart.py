"""The README's main command on a fresh copy of the repo: prepares the sample corpus (tokenizer
and dataset on first use), trains the quickstart preset, evaluates and checkpoints. The default
test runs it shortened by flags (4 iterations); the slow one runs it to the end and prints the
wall time (``pytest -m slow -k quickstart``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tapered_megatron.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README_COMMAND = ["deepspeed", "pretrain/main.py", "--ds_config", "ds_configs/default.json"]


def run_readme_command(tmp_path: Path, flags: list[str]) -> tuple[Path, str]:
    """The README's main command (plus ``flags``) on a fresh copy of the repo; (copy, stdout)."""
    assert (
        "deepspeed pretrain/main.py --ds_config ds_configs/default.json"
        in (ROOT / "README.md").read_text()
    )
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(".git", ".cache", "checkpoints", "__pycache__", "*.egg-info"),
    )
    env = dict(os.environ, PYTHONPATH=str(repo))
    t = time.time()
    r = subprocess.run(
        [*README_COMMAND, *flags], cwd=repo, env=env, capture_output=True, text=True, timeout=1800
    )
    print(json.dumps({"readme_main_command_wall_s": round(time.time() - t, 1), "flags": flags}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (repo / ".cache" / "tapered_megatron" / "sample_corpus").is_dir()
    return repo, r.stdout


def assert_trained_to(repo: Path, out: str, iters: int) -> None:
    """The run saved a complete checkpoint at ``iters`` and validated there."""
    ckpt = repo / "checkpoints" / "quickstart"
    assert (ckpt / "latest").read_text() == f"global_step{iters}"
    assert (ckpt / f"global_step{iters}" / "complete").exists()
    assert f"validation at iter {iters}" in out


@pytest.mark.distributed
def test_readme_main_command_shortened(tmp_path):
    """The README's command shortened: a 2-layer model of the preset's shape family with a
    512-piece sample tokenizer, 4 iterations (evaluation at 2 and 4, one batch each)."""
    flags = ["--model.layers", "2", "--model.d_model", "64", "--model.heads", "2"]
    flags += ["--model.vocab_size", "512", "--train.iters", "4", "--train.warmup_iters", "1"]
    flags += ["--eval.interval", "2", "--eval.iters", "1", "--logging.interval", "2"]
    repo, out = run_readme_command(tmp_path, flags)
    assert_trained_to(repo, out, 4)
    assert "validation at iter 2" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_main_command_on_fresh_copy(tmp_path):
    repo, out = run_readme_command(tmp_path, [])
    assert_trained_to(repo, out, load_config("quickstart").train.iters)
