"""Command line, DeepSpeed-config resolution and process start-up for ``pretrain/main.py``.

Everything here that can reject a run does so before any process group exists, with a one-line
:class:`~tapered_megatron.config.ConfigError` naming the key and the fix. The world size is read
from the launcher's environment (DeepSpeed / torchrun ``WORLD_SIZE``, Open MPI
``OMPI_COMM_WORLD_SIZE``, MPICH / Intel MPI ``PMI_SIZE``); a plain ``python pretrain/main.py`` is
one process.

DeepSpeed-config keys that duplicate our config (batch sizes, gradient clipping) may be ``"auto"``
or absent (filled from ``train.*``) or equal to what ``train.*`` implies; anything else is an
error rather than a silent winner. ``bf16.enabled: "auto"`` means bf16 on accelerators that
support it, fp32 on CPU; an explicit ``true`` (bf16 or fp16) runs mixed precision on DeepSpeed's
CPU accelerator too (slow; for testing the GPU's code paths on a CPU, see :func:`precision`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from tapered_megatron.checkpoint.layout import ParallelLayout
from tapered_megatron.config import Config, ConfigError, load_config
from tapered_megatron.parallel.host import free_port, shm_workspace_path
from tapered_megatron.resources import resource
from tapered_megatron.training.heartbeat import Heartbeat, period_for
from tapered_megatron.training.preflight import check_inputs

DEFAULT_DS_CONFIG = resource("ds_configs") / "default.json"

# Environment variables that carry the world size / rank under the launchers we support.
_WORLD_ENV = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Split the command line into our options and the dotted config overrides."""
    ap = argparse.ArgumentParser(
        prog="pretrain/main.py",
        description="Pretrain a tapered language model with DeepSpeed. Any config key can be "
        "overridden as --section.key VALUE (e.g. --train.iters 20 --parallel.tp 2).",
        allow_abbrev=False,
    )
    ap.add_argument(
        "--ds_config",
        "--deepspeed_config",
        dest="ds_config",
        default=str(DEFAULT_DS_CONFIG),
        help="DeepSpeed JSON config (default: ds_configs/default.json)",
    )
    ap.add_argument(
        "--config",
        default="quickstart",
        help="preset name in pretrain/configs/ or a YAML path (default: quickstart)",
    )
    ap.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", 0)),
        help="set by the launcher",
    )
    ap.add_argument("--resume", default=None, help="alias of --train.resume (auto | PATH)")
    ap.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.resume is not None:
        if any(a.split("=")[0] == "--train.resume" for a in rest):
            raise ConfigError("--resume and --train.resume both given; use one")
        rest = [*rest, "--train.resume", args.resume]
    return args, rest


def env_world_size() -> int:
    """World size announced by the launcher (1 for a plain ``python`` start)."""
    for key in _WORLD_ENV:
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def env_rank() -> int:
    """Global rank announced by the launcher (0 for a plain ``python`` start)."""
    for key in _RANK_ENV:
        if os.environ.get(key):
            return int(os.environ[key])
    return 0


def load_ds_config(path: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON config (errors name the file)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--ds_config: {path} does not exist; see ds_configs/ for ready configs")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--ds_config: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--ds_config: {path} must hold a JSON object")
    return data


def _agree(ds: dict, key: str, want: Any, fix: str) -> None:
    """Fill ``ds[key]`` with ``want`` when absent/"auto"; reject a different explicit value."""
    have = ds.get(key, "auto")
    if have == "auto" or have is None:
        ds[key] = want
    elif have != want:
        raise ConfigError(f"ds_config {key}={have!r} disagrees with {fix}")


def resolve(cfg: Config, ds_config: dict[str, Any], world_size: int) -> tuple[dict, ParallelLayout]:
    """Check ``cfg`` against ``ds_config`` and the world size; return the filled ds_config.

    Raises :class:`ConfigError` on any inconsistency. Never touches torch.distributed.
    """
    ds = copy.deepcopy(ds_config)
    check_sections(ds)
    tp, pp, tr = cfg.parallel.tp, cfg.parallel.pp, cfg.train
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {tp}*{pp}; "
            f"launch a multiple of {tp * pp} processes or change --parallel.tp / --parallel.pp"
        )
    dp = world_size // (tp * pp)
    mbs = tr.micro_batch_size
    gbs = tr.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise ConfigError(
            f"train.global_batch_size ({gbs}) must be a multiple of train.micro_batch_size "
            f"({mbs}) x data-parallel size ({dp}); set --train.global_batch_size "
            f"{mbs * dp * max(1, gbs // (mbs * dp))}"
        )
    gas = gbs // (mbs * dp)
    _agree(
        ds,
        "train_micro_batch_size_per_gpu",
        mbs,
        f'train.micro_batch_size={mbs}; remove the key or set it to "auto"',
    )
    _agree(
        ds,
        "train_batch_size",
        gbs,
        f"train.global_batch_size={gbs} (micro {mbs} x dp {dp} x accumulation {gas}); "
        'remove the key, set it to "auto" or pass --train.global_batch_size',
    )
    _agree(
        ds,
        "gradient_accumulation_steps",
        gas,
        f"train.global_batch_size / (micro_batch_size x dp) = {gbs}/({mbs}x{dp}) = {gas}; "
        'remove the key or set it to "auto"',
    )
    _agree(
        ds,
        "gradient_clipping",
        tr.clip_grad,
        f'train.clip_grad={tr.clip_grad}; remove the key, set it to "auto" or pass '
        "--train.clip_grad",
    )
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config zero_optimization.stage={stage!r}; use 0, 1, 2 or 3")
    if pp > 1 and stage >= 2:
        raise ConfigError(
            f"ds_config zero_optimization.stage={stage} cannot be combined with pipeline "
            f"parallelism (parallel.pp={pp}); use ds_configs/pipeline.json (ZeRO-1) "
            "or --parallel.pp 1"
        )
    stages = ds.get("pipeline", {}).get("stages", "auto")
    if stages != "auto" and stages != pp:
        raise ConfigError(
            f"ds_config pipeline.stages={stages!r} disagrees with parallel.pp={pp}; "
            'set it to "auto" or pass --parallel.pp'
        )
    if cfg.parallel.sequence_parallel and pp > 1:
        # The stages exchange sequence shards, already 1/tp of the tensor and different on each
        # TP rank: DeepSpeed sends them whole instead of partitioning one rank's tensor over the
        # TP group (its default, which sequence parallelism replaces).
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    for half in ("fp16", "bf16"):
        sec = ds.get(half)
        if isinstance(sec, dict) and sec.get("enabled") == "auto":
            sec["enabled"] = half == "bf16" and _bf16_available()
    if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
        raise ConfigError("ds_config enables both fp16 and bf16; enable one")
    half = precision(ds)
    if half == "fp16" and pp > 1 and stage == 0:
        raise ConfigError(
            "ds_config enables fp16 with pipeline parallelism and ZeRO stage 0, where DeepSpeed "
            "does not apply the loss scale; use ds_configs/pipeline.json (ZeRO-1) or bf16"
        )
    if half != "fp32" and not _supports(half):
        other = "bf16" if half == "fp16" else "fp16"
        raise ConfigError(
            f"ds_config enables {half} but this accelerator does not support it; set "
            f'"{half}": {{"enabled": false}} (or "auto"), or enable {other} instead'
        )
    if pp > 1 and cfg.parallel.schedule != "1f1b":
        from tapered_megatron.parallel.schedules import run_problem

        if problem := run_problem(cfg, gas, half):
            raise ConfigError(problem)
    ds.setdefault("steps_per_print", 10**9)
    layout = ParallelLayout(
        tp=tp,
        pp=pp,
        dp=dp,
        zero_stage=stage,
        pipeline_unit=cfg.parallel.pipeline_unit if pp > 1 else "none",
        schedule=cfg.parallel.schedule if pp > 1 else "1f1b",
        virtual_stages=cfg.parallel.virtual_stages if pp > 1 else 1,
        world_size=world_size,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        grad_accum=gas,
    )
    return ds, layout


#: ds_config sections that must be JSON objects, each with an example.
_SECTIONS = {
    "zero_optimization": '{"stage": 1}',
    "bf16": '{"enabled": true}',
    "fp16": '{"enabled": true}',
    "optimizer": '{"type": "AdamW", "params": {...}}',
    "scheduler": '{"type": "WarmupCosineLR", "params": {...}}',
    "data_types": '{"grad_accum_dtype": "fp32"}',
    "pipeline": '{"stages": "auto"}',
}


def check_sections(ds: dict[str, Any]) -> None:
    """Type-check the ds_config's sections and DeepSpeed's optimizer / scheduler types, so a
    typo is one line before any process group starts instead of a traceback inside
    ``deepspeed.initialize``."""
    import torch
    from deepspeed.runtime import config as ds_cfg
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    for key, example in _SECTIONS.items():
        if key in ds and not isinstance(ds[key], dict):
            raise ConfigError(
                f'ds_config "{key}": {json.dumps(ds[key])} is not a JSON object; write e.g. '
                f'"{key}": {example}'
            )
    if "optimizer" in ds:
        name = str(ds["optimizer"].get("type"))
        if name.lower() not in ds_cfg.DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, name):
            raise ConfigError(
                f"ds_config optimizer.type={ds['optimizer'].get('type')!r} is neither one of "
                f"DeepSpeed's ({', '.join(ds_cfg.DEEPSPEED_OPTIMIZERS)}) nor a torch.optim "
                "class; fix it or remove the optimizer section (our AdamW is used then)"
            )
    name = ds.get("scheduler", {}).get("type")
    if "scheduler" in ds and name not in VALID_LR_SCHEDULES:
        raise ConfigError(
            f"ds_config scheduler.type={name!r} is not one DeepSpeed knows "
            f"({', '.join(VALID_LR_SCHEDULES)}); fix it or remove the scheduler section (our "
            "warmup + cosine schedule is used then)"
        )


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def precision(ds: dict[str, Any]) -> str:
    """The training precision a resolved ds_config asks for: ``"bf16"``, ``"fp16"`` or
    ``"fp32"``."""
    for half in ("bf16", "fp16"):
        sec = ds.get(half)
        if isinstance(sec, dict) and sec.get("enabled") is True:
            return half
    return "fp32"


def precision_note(ds: dict[str, Any]) -> str:
    """One line for the log when mixed precision runs on DeepSpeed's CPU accelerator ("" else)."""
    half = precision(ds)
    if half == "fp32" or not _on_cpu():
        return ""
    return (
        f"{half} on the CPU accelerator: runs the GPU's mixed-precision code paths for testing "
        'and is slow; use "enabled": "auto" for fp32 on a CPU'
    )


def _supports(half: str) -> bool:
    """Whether DeepSpeed's accelerator runs ``half`` ("bf16" / "fp16") training."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return bool(acc.is_bf16_supported() if half == "bf16" else acc.is_fp16_supported())


def _bf16_available() -> bool:
    return not _on_cpu() and _supports("bf16")


def setup(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config, dict, ParallelLayout]:
    """Parse, load and validate everything, input files included (:mod:`.preflight`); no
    process group is started here."""
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides)
    world = env_world_size()
    kept, note = resumed_global_batch(cfg, world)
    if kept:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=kept))
    try:
        ds, layout = resolve(cfg, load_ds_config(args.ds_config), world)
    except ConfigError as e:
        if kept:
            raise ConfigError(f"{e} (the resumed checkpoint's global batch is {kept})") from None
        raise
    check_inputs(cfg, ds, layout)
    if note and env_rank() == 0:
        print(note, flush=True)
    return args, cfg, ds, layout


def resumed_global_batch(cfg: Config, world_size: int) -> tuple[int | None, str]:
    """Keep a resumed run's global batch when the layout changes.

    With ``train.global_batch_size`` 0 the global batch is micro batch x DP, so resuming on
    another number of ranks would silently train another run (learning-rate schedule and
    consumed samples describe a different batch). Returns ``(batch, note)``: the checkpoint's
    global batch to set (``None``: nothing to change) and a line saying which batch the run
    goes on with ("" when nothing differs). An explicit ``train.global_batch_size`` wins, and
    the note says so. :func:`resolve` rejects a kept batch the new layout cannot divide.
    """
    from tapered_megatron.checkpoint import resume

    tp_pp = cfg.parallel.tp * cfg.parallel.pp
    if not cfg.train.resume or world_size % tp_pp:
        return None, ""
    try:
        where = resume.find_resume(cfg)
    except (FileNotFoundError, ConfigError):
        return None, ""  # pre-flight names the problem
    saved = resume.saved_global_batch(where[0] / where[1], cfg.model.plugins) if where else None
    implied = cfg.train.micro_batch_size * world_size // tp_pp
    now = cfg.train.global_batch_size or implied
    if saved is None or saved == now:
        return None, ""
    if cfg.train.global_batch_size:
        return None, (
            f"global batch {now} (train.global_batch_size, set explicitly); the checkpoint "
            f"trained with {saved}"
        )
    return saved, (
        f"global batch {saved} kept from the checkpoint (micro {cfg.train.micro_batch_size} x "
        f"dp {world_size // tp_pp} = {implied} here); pass --train.global_batch_size to change it"
    )


def release_shm_workspace(rank: int, world_size: int) -> None:
    """Unlink this rank's shared-memory all-reduce file once every rank has mapped it.

    Each rank maps all ranks' files inside ``deepspeed.init_distributed``, so after a barrier the
    names are no longer needed; unlinking them keeps the mappings (freed when the last process
    exits, however it exits) and stops every run from leaving 64 MiB per rank in ``/dev/shm``,
    which is RAM, until the machine restarts.
    """
    import torch.distributed as dist

    if os.environ.get("LOCAL_SIZE") != str(world_size):  # the op made no files (multi-host)
        return
    if world_size > 1:
        dist.barrier()
    shm_workspace_path(rank).unlink(missing_ok=True)


def init_distributed(timeout_s: float | None = None) -> Heartbeat | None:
    """Start ``torch.distributed`` through DeepSpeed (MPI ranks are discovered with mpi4py).

    A plain single ``python`` process (no launcher, no MPI) gets a one-rank group on localhost.
    ``timeout_s`` (``train.collective_timeout_s``) bounds every collective, on the world group
    and on every group created later (ours, DeepSpeed's: torch gives those its 30-minute default
    otherwise): a rank that stops responding makes the others raise instead of waiting forever,
    so the job exits non-zero. With more than one rank, returns the started
    :class:`~tapered_megatron.training.heartbeat.Heartbeat` that names such a rank.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from torch.distributed import distributed_c10d

    under_mpi = any(os.environ.get(k) for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    if not under_mpi and not os.environ.get("WORLD_SIZE"):
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
        )
    if timeout_s is not None:  # the default of every later new_group (read when it is called)
        distributed_c10d.default_pg_timeout = timedelta(seconds=timeout_s)
        if isinstance(distributed_c10d.default_pg_nccl_timeout, timedelta):  # NCCL's own
            distributed_c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=int(os.environ.get("MASTER_PORT", 29500)),
        verbose=False,
        **({} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}),
    )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(local_rank)
    else:
        release_shm_workspace(dist.get_rank(), dist.get_world_size())
    if dist.get_world_size() == 1:
        return None
    store = distributed_c10d._get_default_store()
    period = period_for(timeout_s if timeout_s is not None else 600.0)
    return Heartbeat(store, dist.get_rank(), dist.get_world_size(), period).start()
