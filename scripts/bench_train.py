"""Benchmark the training engine: DeepSpeed overhead, DP scaling, launch-to-first-step time.

    python scripts/bench_train.py [--config quickstart] [--rounds 5] [--steps 4] [overrides]

1. Overhead: the run's model under the DeepSpeed engine of ``pretrain/main.py`` (the same
   ``Trainer`` step: engine forward/backward/step, ZeRO per ``--ds_config``, clipping, LR
   schedule) against a bare
   PyTorch loop (same model, same batches, AdamW + clipping + the same schedule), in one
   process, interleaved round by round so both see the same machine load. Tokens/s are from the
   median step time of each side.
2. Scaling: ``pretrain/main.py`` launched with 1 and with 2 ranks (DP=2, same micro-batch per
   rank, so twice the tokens per step), tokens/s from the median step time after warm-up.
3. Launch to first step: wall time from starting ``deepspeed pretrain/main.py`` to the end of
   its first optimizer step (from the per-iteration metrics file).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, emit, interleaved, stamp


def _overhead(config: str, ds_config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    import torch

    from tapered_megatron.config import load_config
    from tapered_megatron.models import build_model
    from tapered_megatron.training import launch, optim
    from tapered_megatron.training.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    iters = rounds * steps + 2
    tmp = tempfile.mkdtemp(prefix="bench_train_")
    cfg = load_config(
        config,
        [*overrides, "--train.iters", str(iters), "--eval.interval", "0", "--train.save_dir", tmp],
    )
    ds, layout = launch.resolve(cfg, launch.load_ds_config(ds_config), 1)
    launch.init_distributed()
    trainer = Trainer(cfg, ds, layout, time.time())
    total = iters * layout.global_batch_size
    engine_batches = trainer.batches(trainer.train_ds, total, 0)
    bare_batches = trainer.batches(trainer.train_ds, total, 0)

    model = build_model(cfg)
    opt = optim.build_optimizer(model, cfg.train)
    sched = optim.build_scheduler(opt, cfg.train)

    def bare_step() -> None:
        for _ in range(layout.grad_accum):
            x, y = next(bare_batches)
            (model(x, y) / layout.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    def engine_step() -> None:
        trainer.train_step(engine_batches, want_norm=False)

    for fn in (bare_step, engine_step):  # warm-up, not timed
        fn()
    sides = {"bare": bare_step, "engine": engine_step}  # who goes first alternates
    times = interleaved(sides, rounds, order="alternate", repeats=steps)["wall"]
    tokens = layout.global_batch_size * cfg.model.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    import torch.distributed as dist

    dist.destroy_process_group()
    return {
        "tokens_per_step": tokens,
        "bare_tokens_per_s": round(tokens / med["bare"], 1),
        "engine_tokens_per_s": round(tokens / med["engine"], 1),
        "engine_overhead_pct": round(100 * (med["engine"] / med["bare"] - 1), 2),
    }


def launch_main(
    ranks: int, config: str, ds_config: str, overrides: list[str], iters: int, out: Path
) -> dict:
    """Run main.py through the DeepSpeed launcher; the median step time after two warm-up
    steps, launch-to-first-step, the run's wall time and its per-iteration losses."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
        "--master_port", str(29500 + os.getpid() % 1000 + ranks),
        str(ROOT / "pretrain" / "main.py"), "--ds_config", ds_config,
        "--config", config, *overrides, "--train.iters", str(iters), "--eval.interval", "0",
        "--train.save_dir", str(out / "ckpt"), "--logging.metrics_file", str(metrics),
        "--logging.interval", str(iters),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{ranks}-rank run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    steady = [r["step_s"] for r in recs[2:]] or [r["step_s"] for r in recs]
    return {
        "step_s": statistics.median(steady),
        "first_step_s": recs[0]["wall"] - t0,
        "wall_s": time.time() - t0,
        "losses": [r["loss"] for r in recs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--ds_config", default=str(ROOT / "ds_configs" / "default.json"))
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (overhead)")
    ap.add_argument("--steps", type=int, default=4, help="steps per side per round")
    ap.add_argument("--scaling-iters", type=int, default=8, help="iterations per launched run")
    ap.add_argument("--skip-launch", action="store_true", help="only the in-process overhead")
    a, overrides = ap.parse_known_args(argv)
    from tapered_megatron.config import load_config

    cfg = load_config(a.config, overrides)
    result: dict = {
        "bench": "train",
        "config": a.config,
        "overrides": overrides,
        "model": f"{cfg.model.arch} L{cfg.model.layers} d{cfg.model.d_model} s{cfg.model.seq_len}",
        "micro_batch": cfg.train.micro_batch_size,
        **stamp(),
    }
    if not a.skip_launch:
        with tempfile.TemporaryDirectory() as tmp:
            run = (a.config, a.ds_config, overrides, a.scaling_iters)
            one = launch_main(1, *run, Path(tmp) / "dp1")
            two = launch_main(2, *run, Path(tmp) / "dp2")
        tok1 = cfg.train.micro_batch_size * cfg.model.seq_len
        result.update(
            dp1_tokens_per_s=round(tok1 / one["step_s"], 1),
            dp2_tokens_per_s=round(2 * tok1 / two["step_s"], 1),
            dp2_speedup=round(2 * one["step_s"] / two["step_s"], 3),
            launch_to_first_step_s=round(one["first_step_s"], 1),
            launch_to_first_step_dp2_s=round(two["first_step_s"], 1),
        )
    result["ds_config"] = Path(a.ds_config).name
    result.update(_overhead(a.config, a.ds_config, overrides, a.rounds, a.steps))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
