"""Peak memory per rank of a ZeRO-3 run: the whole-model build against ``deepspeed.zero.Init``.

    python scripts/bench_zero3_memory.py [--config transformer_760m] [--ranks 4] [--seq-len 128]
        [--builds whole,zero_init] [--stop-after model|step] [--steps 3]
        [--zero KEY=VALUE ...] [--mmap-threshold BYTES] [--min-free-gib 2]
        [--section.key value ...]

For each build, ``--ranks`` real gloo ranks (CPU, one thread each) train the preset under ZeRO-3
(``ds_configs/zero3.json`` with ``--zero`` replacing keys of its ``zero_optimization``, fp32,
AdamW, micro-batch 1, the sequence cut to ``--seq-len``; ``--section.key value`` overrides the
preset) for ``--steps`` optimizer steps on random tokens (``--stop-after model``: the model
build only), exactly as the trainer builds it:

* ``whole``: every rank builds the whole model (``build_model``, the trainer before ``zero.Init``)
  and ``deepspeed.initialize`` partitions it;
* ``zero_init``: the trainer's ``build_partitioned`` (the model built under ``zero.Init``, each
  rank writing only its partition of the layout-invariant init).

Each rank reports its resident memory (``/proc/self/status``): ``footprint`` (after imports, the
process group and DeepSpeed's communication start, before the model: the framework's own
footprint), the peak (``VmHWM``) after the model is built and after ``deepspeed.initialize``
(``build``), then per step the peak of its forward, backward and optimizer step (``VmHWM`` reset
before each, ``/proc/self/clear_refs``): ``first_step_peak`` and ``step_peak``, the largest over
all steps (DeepSpeed's ZeRO-3 schedule is steady from the third step). The ranks run with glibc's
``MALLOC_MMAP_THRESHOLD_`` set to ``--mmap-threshold`` (default 1 MiB; 0 leaves glibc's dynamic
default), so freed tensors leave the resident set. The planner's prediction is the stage memory
of :func:`tapered_megatron.planning.balance.analyse` (the call ``python -m tapered_megatron.plan``
makes) for this layout and these ZeRO-3 sizes on the ``cpu`` device: model state (``static``)
and the steady-state step peak. One JSON line per build with per-rank figures in MiB, then a
summary line.

A watchdog stops a build whose ranks bring the machine's available memory under
``--min-free-gib`` (the line then says ``"fits": false``), so a build that does not fit does
not take the machine down with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from bench_common import ROOT, emit, reset_peak, stamp, status_mib

MiB = 2**20


def bench_config(
    name: str,
    seq_len: int,
    ranks: int,
    extra: list[str] | None = None,
    zero: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The preset with the sequence cut, and the ZeRO-3 DeepSpeed config the trainer would use
    (``zero``: keys of its ``zero_optimization`` section replaced)."""
    from tapered_megatron.config import load_config

    over = ["--model.seq_len", str(seq_len), "--train.micro_batch_size", "1", *(extra or [])]
    cfg = load_config(name, over)
    ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"].update(zero or {})
    ds.update(
        train_micro_batch_size_per_gpu=1,
        gradient_accumulation_steps=1,
        train_batch_size=ranks,
        gradient_clipping=cfg.train.clip_grad,
        bf16={"enabled": False},
    )
    return cfg, ds


def _progress(rank: int, what: str) -> None:
    """A line per phase on stderr (what a killed run leaves behind)."""
    print(
        f"rank {rank}: {what}: rss {status_mib('VmRSS'):.0f} MiB "
        f"(shared {status_mib('RssShmem'):.0f}, file {status_mib('RssFile'):.0f}), "
        f"peak {status_mib('VmHWM'):.0f} MiB",
        file=sys.stderr,
        flush=True,
    )


def _worker(
    rank: int,
    world: int,
    build: str,
    name: str,
    seq_len: int,
    extra: list[str],
    stop: str,
    steps: int,
    zero: dict[str, Any],
) -> dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist

    from tapered_megatron import parallel
    from tapered_megatron.models import build_model
    from tapered_megatron.training import optim
    from tapered_megatron.training.trainer import build_partitioned

    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # on a shared machine, the kernel takes a bench rank before anyone else
    cfg, ds = bench_config(name, seq_len, world, extra, zero)
    parallel.init_model_parallel(1, 1)
    deepspeed.init_distributed(dist.get_backend())
    out: dict[str, Any] = {"rank": rank, "footprint": status_mib("VmRSS")}
    t = time.perf_counter()
    model = build_model(cfg) if build == "whole" else build_partitioned(cfg, ds)
    out.update(model_peak=status_mib("VmHWM"), model_s=time.perf_counter() - t)
    _progress(rank, f"{build} model built")
    if stop == "model":
        dist.barrier()
        return out
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optim.build_optimizer(model, cfg.train), config=ds
    )
    dist.barrier()
    out.update(build_peak=status_mib("VmHWM"), build_rss=status_mib("VmRSS"))
    out["build_s"] = time.perf_counter() - t
    _progress(rank, "engine initialised")
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq_len + 1), generator=g)
    t = time.perf_counter()
    phases: list[dict[str, float]] = []
    for _ in range(steps):
        # Peak per phase: VmHWM is reset to the current RSS before each (clear_refs 5).
        reset_peak()
        loss = engine(ids[:, :-1], ids[:, 1:])
        fwd = status_mib("VmHWM")
        reset_peak()
        engine.backward(loss)
        bwd = status_mib("VmHWM")
        reset_peak()
        engine.step()
        dist.barrier()
        phases.append({"forward": fwd, "backward": bwd, "step": status_mib("VmHWM")})
        _progress(rank, f"step {len(phases)} " + json.dumps(phases[-1]))
    out.update(
        step_peak=max(max(p.values()) for p in phases),  # the steady state: every step
        first_step_peak=max(phases[0].values()),
        phases=phases,
        step_rss=status_mib("VmRSS"),
        loss=loss.item(),
    )
    out["step_s"] = (time.perf_counter() - t) / steps
    return out


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def _watchdog(stop: threading.Event, min_free: float, tripped: list[float]) -> None:
    """Kill this process's worker children when the machine runs short of memory."""
    import multiprocessing

    while not stop.wait(0.5):
        free = _mem_available_gib()
        if free < min_free:
            tripped.append(free)
            for child in multiprocessing.active_children():
                child.kill()
            return


def planner_prediction(
    name: str,
    seq_len: int,
    ranks: int,
    extra: list[str] | None = None,
    zero: dict[str, Any] | None = None,
) -> dict[str, float]:
    """The planner's per-rank memory for this run (MiB): model state and step peak."""
    from tapered_megatron.planning import cost
    from tapered_megatron.planning.balance import analyse

    cfg, ds = bench_config(name, seq_len, ranks, extra, zero)
    bal = analyse(
        cfg,
        1,
        1,
        device=cost.get_device("cpu"),
        gpu_mem=float("inf"),
        dp=ranks,
        zero_stage=3,
        tp=1,
        micro_batch_size=1,
        methods=("balancer",),
        zero3=cost.Zero3.from_ds_config(ds),
    )
    r = bal.methods["balancer"]
    return {
        "static": sum(u.static for u in bal.costs) / MiB,
        "step": r.stage_mem[0] / MiB,
        "params": sum(u.params for u in bal.costs),
    }


def run_build(args: argparse.Namespace, build: str) -> dict[str, Any]:
    """One build on ``args.ranks`` ranks; the per-rank figures (or why it did not finish)."""
    from tapered_megatron.parallel.local_launch import run_workers

    stop, tripped = threading.Event(), []
    dog = threading.Thread(target=_watchdog, args=(stop, args.min_free_gib, tripped), daemon=True)
    dog.start()
    try:
        ranks = run_workers(
            _worker,
            args.ranks,
            build,
            args.config,
            args.seq_len,
            args.overrides,
            args.stop_after,
            args.steps,
            args.zero,
            timeout=args.timeout,
        )
        return {"build": build, "fits": True, "ranks": ranks}
    except Exception as e:  # a rank killed by the watchdog or failing: report, don't hide
        why = f"available memory fell to {tripped[0]:.2f} GiB" if tripped else str(e)[-400:]
        return {"build": build, "fits": False, "why": why}
    finally:
        stop.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="transformer_760m")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--builds", default="whole,zero_init")
    ap.add_argument(
        "--steps",
        type=int,
        default=3,
        help="optimizer steps; DeepSpeed's ZeRO-3 schedule is steady from the third",
    )
    ap.add_argument(
        "--zero",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replace a zero_optimization key (e.g. stage3_max_reuse_distance=0)",
    )
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        default=2**20,
        help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks in bytes (0: glibc's dynamic default)",
    )
    ap.add_argument("--min-free-gib", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument(
        "--stop-after", choices=("model", "step"), default="step", help="model: build only"
    )
    args, args.overrides = ap.parse_known_args(argv)  # the rest: config overrides
    args.zero = {k: json.loads(v) for k, _, v in (z.partition("=") for z in args.zero)}
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.mmap_threshold:
        # The ranks (spawned, so they read it at start) return every freed tensor of at least
        # this size to the system: resident memory is then the live tensors, what the planner
        # counts. glibc's default raises the threshold up to 32 MiB after the first frees and
        # keeps freed memory below it in its heaps.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    pred = planner_prediction(args.config, args.seq_len, args.ranks, args.overrides, args.zero)
    model_mib = pred["params"] * 4 / MiB  # fp32 weights
    summary: dict[str, Any] = {
        **stamp(),
        "config": args.config,
        "ranks": args.ranks,
        "seq_len": args.seq_len,
        "overrides": args.overrides,
        "zero": args.zero,
        "mmap_threshold": args.mmap_threshold,
        "params": pred["params"],
        "model_mib": model_mib,
        "planner_static_mib": pred["static"],
        "planner_step_mib": pred["step"],
    }
    for build in args.builds.split(","):
        res = run_build(args, build)
        emit(res)
        if not res["fits"]:
            summary[build] = {"fits": False, "why": res["why"]}
            continue
        rk = res["ranks"]
        foot = max(r["footprint"] for r in rk)
        keys = [
            k
            for k in (
                "model_peak",
                "build_peak",
                "first_step_peak",
                "step_peak",
                "model_s",
                "build_s",
                "step_s",
            )
            if k in rk[0]
        ]
        worst = {k: max(r[k] for r in rk) for k in keys}
        summary[build] = {
            "fits": True,
            "footprint_mib": foot,
            **{k if k.endswith("_s") else f"{k}_mib": v for k, v in worst.items()},
            "model_over_share": (worst["model_peak"] - foot) / (model_mib / args.ranks),
        }
        if "step_peak" in worst:
            summary[build]["engine_vs_planner_static"] = (worst["build_peak"] - foot) / pred[
                "static"
            ]
            summary[build]["step_vs_planner"] = (worst["step_peak"] - foot) / pred["step"]
            summary[build]["loss"] = rk[0]["loss"]
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
