"""Weights & Biases logging (``--logging.wandb_project``), in real ``pretrain/main.py`` processes:
an offline run's files hold the scalars tensorboard gets, the config, the layout and the taper
plan; without the package, training is unchanged (asking for wandb then is one line, exit 2:
``tests/test_preflight.py``)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from launch_helpers import MAIN, common_args, job_env, metrics, popen_job
from wandb.proto import wandb_internal_pb2  # a dev dependency: a broken install fails here

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
RUN = ["--train.iters", "4", "--logging.interval", "1", "--eval.interval", "2"]
WANDB = ["--logging.wandb_project", "tm-test", "--logging.wandb_mode", "offline"]


def run(corpus: str, out: Path, extra: list[str], wrapper: tuple[str, ...] = ()) -> tuple:
    """One rank of ``pretrain/main.py`` (through ``wrapper``); its exit code and output."""
    env = dict(job_env(), WANDB_SILENT="true", WANDB_MODE="offline")  # never the network
    cmd = [sys.executable, "-u", *wrapper, MAIN, *common_args(corpus, out, "zero0.json", extra)]
    p = popen_job(cmd, env)
    log = p.communicate(timeout=400)[0]
    return p.returncode, log


def records(path: Path, header: int) -> list[bytes]:
    """The records of a LevelDB-style log (wandb's ``.wandb`` file after its ``header`` bytes:
    32 KiB blocks, each record a 7-byte header then data, split FIRST/MIDDLE/LAST)."""
    data, pos, block, pending, out = path.read_bytes(), header, 1 << 15, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if left < 7 or kind == 0:  # the zero-filled tail of a block
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            out.append(pending)
            pending = b""
    return out


def wandb_run(save_dir: Path) -> tuple[dict[tuple[str, int], float], dict]:
    """The scalars ``{(tag, step): value}`` and the config of the one offline run under
    ``save_dir``, read from its ``.wandb`` file with wandb's own record protobuf."""
    (path,) = save_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert path.read_bytes()[:4] == b":W&B"
    scalars, config = {}, {}
    for raw in records(path, 7):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item
            }
            step = row.pop("_step")
            scalars.update({(k, step): v for k, v in row.items() if not k.startswith("_")})
    return scalars, config


def tensorboard_scalars(folder: Path) -> dict[tuple[str, int], float]:
    """``{(tag, step): value}`` of the tensorboardX event files in ``folder`` (TFRecords)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in folder.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 16 + n
            for v in event.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    out[(v.tag, event.step)] = v.simple_value
    return out


@pytest.fixture(scope="module")
def offline_run(corpus, tmp_path_factory) -> Path:
    """A tiny run logging to an offline wandb run; its output directory."""
    out = tmp_path_factory.mktemp("wandb")
    rc, log = run(corpus, out, [*RUN, *WANDB])
    assert rc == 0, log[-3000:]
    return out


def test_offline_wandb_run_holds_the_tensorboard_scalars_config_layout_and_widths(
    offline_run, tmp_path
):
    from tapered_megatron.config import load_config

    scalars, config = wandb_run(offline_run / "ckpt")
    board = tensorboard_scalars(offline_run / "ckpt" / "tensorboard")
    assert scalars.keys() == board.keys() and len(board) > 30
    assert {t for t, _ in board} >= {"train/loss", "train/lr", "train/mfu", "val/loss"}
    for key, v in board.items():  # tensorboard stores float32
        assert scalars[key] == pytest.approx(v, rel=1e-6), key
    losses = [r["loss"] for r in metrics(offline_run)]
    assert [scalars[("train/loss", it)] for it in (1, 2, 3, 4)] == losses
    assert config["model"]["d_model"] == 32 and config["train"]["iters"] == 4
    assert config["logging"]["wandb_project"] == "tm-test"
    assert config["layout"] == {
        "world_size": 1, "tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 4,
        "global_batch_size": 8, "grad_accum": 2, "zero_stage": 0,
        "pipeline_unit": "none", "schedule": "1f1b", "virtual_stages": 1,
    }  # fmt: skip
    args = common_args("", tmp_path, "zero0.json", RUN)
    plan = load_config(overrides=args[args.index("--model.d_model") :]).taper_plan
    assert config["taper_plan"]["widths"] == list(plan.widths)


@pytest.mark.slow
def test_training_without_wandb_installed_is_unchanged(corpus, offline_run, tmp_path):
    """The same run where ``import wandb`` fails: the same losses, no wandb files."""
    rc, log = run(corpus, tmp_path, RUN, (str(HERE / "without_wandb.py"),))
    assert rc == 0, log[-3000:]
    assert [r["loss"] for r in metrics(tmp_path)] == [r["loss"] for r in metrics(offline_run)]
    assert not (tmp_path / "ckpt" / "wandb").exists()
