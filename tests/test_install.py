"""The installed package works: a wheel (not editable) in a fresh virtual environment, used from a
directory outside the checkout, finds its presets, DeepSpeed configs and sample corpus, trains,
exports and loads through Hugging Face.

Offline: the wheel is built with ``--no-build-isolation`` and the venv sees this interpreter's
site-packages (torch, deepspeed, transformers), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*cache", ".hypothesis", "runs",
    "checkpoints", "exports", ".benchmarks",
)  # fmt: skip
TINY = [
    "--model.d_model", "32", "--model.heads", "2", "--model.layers", "2", "--model.d_ff", "64",
    "--model.seq_len", "32", "--model.vocab_size", "512", "--train.iters", "2",
    "--train.micro_batch_size", "2", "--eval.interval", "0",
]  # fmt: skip
HF_LOAD = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("exp", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("exp")
out = model.generate(tokenizer("To be", return_tensors="pt").input_ids, max_new_tokens=4)
print(out.shape[1], sys.modules[type(model).__module__].__file__)
"""


def _venv_with_wheel(tmp: Path) -> Path:
    """Build the wheel from a copy of the checkout and install it into a fresh venv; returns
    the venv's python."""
    src, wheels, venv = tmp / "src", tmp / "wheels", tmp / "venv"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", wheels],
        check=True,
        cwd=src,
    )
    (wheel,) = wheels.glob("tapered_megatron-*.whl")
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], check=True
    )
    python = venv / "bin" / "python"
    # this interpreter's pip installs into the venv; --ignore-installed: the editable install
    # of the checkout that the venv also sees must not count as installed
    subprocess.run(
        [str(python), *pip[1:], "install", "--no-deps", "--no-index", "--ignore-installed", wheel],
        check=True,
    )
    return python


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_tools_from_any_directory(tmp_path: Path) -> None:
    python = _venv_with_wheel(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))

    def run(*args: str) -> str:
        p = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{args}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    py, site = str(python), python.parents[1] / "lib"
    code = "from tapered_megatron import resources as r; print(r.__file__, r.resource('presets'))"
    for path in run(py, "-c", code).split():  # the wheel and its copies, not the checkout
        assert Path(path).is_relative_to(site), path

    assert "sum=3072 budget=3072" in run(
        py, "-m", "tapered_megatron.config", "--config", "quickstart"
    )
    taper = ["--layers", "24", "--d-ff", "4096", "--schedule", "cosine", "--ratio", "1.5", "0.5"]
    for cli in ([py, "-m", "tapered_megatron.taper"], [str(python.parent / "tm-taper")]):
        plan = json.loads(run(*cli, *taper, "--json").splitlines()[-1])
        assert plan["sum"] == plan["budget"] == 24 * 4096 and plan["widths"][0] == 6144
    summary = ["-m", "tapered_megatron.models.summary", "--config", "transformer_760m"]
    assert "sum=98304 budget=98304" in run(py, *summary)

    # a tiny run on the shipped sample corpus with the default ds_config, both found in the wheel
    main = str(ROOT / "pretrain" / "main.py")
    run(py, main, "--config", "quickstart", *TINY, "--train.save_dir", "ckpt")
    assert (work / "ckpt" / "latest").read_text() == "global_step2"
    run(py, "-m", "tapered_megatron.export", "--checkpoint", "ckpt", "--out", "exp")
    length, module = run(py, "-c", HF_LOAD).split()[-2:]
    assert int(length) > 2 and Path(module).is_relative_to(site), module


def test_every_resource_is_found_in_the_checkout() -> None:
    from tapered_megatron.resources import RESOURCES, resource

    for name, relative in RESOURCES.items():
        assert resource(name) == ROOT / relative and resource(name).exists(), name
