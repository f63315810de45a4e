"""The README's main command on a fresh copy of the repo: prepares the sample corpus, trains the
quickstart preset to the end, evaluates and checkpoints. Slow (minutes): ``pytest -m slow -k
quickstart``; prints the wall time.
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


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_main_command_on_fresh_copy(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(".git", ".cache", "checkpoints", "__pycache__", "*.egg-info"),
    )
    env = dict(os.environ, PYTHONPATH=str(repo))
    t = time.time()
    r = subprocess.run(
        ["deepspeed", "pretrain/main.py", "--ds_config", "ds_configs/default.json"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.time() - t
    print(json.dumps({"readme_main_command_wall_s": round(wall, 1)}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    iters = load_config("quickstart").train.iters
    ckpt = repo / "checkpoints" / "quickstart"
    assert (ckpt / "latest").read_text() == f"global_step{iters}"
    assert (ckpt / f"global_step{iters}" / "complete").exists()
    assert f"validation at iter {iters}" in r.stdout
    assert (repo / ".cache" / "tapered_megatron").is_dir()
