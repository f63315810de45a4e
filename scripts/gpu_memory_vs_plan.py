"""Peak accelerator memory of a few training steps beside the planner's prediction for the layout.

    python scripts/gpu_memory_vs_plan.py --ds_config ds_configs/zero1.json \
        [--config transformer_440m] [--steps 3] [--section.key value ...]

One process on DeepSpeed's accelerator. The config and ds_config are resolved as
``pretrain/main.py`` resolves them (``launch.setup``), the model and engine built as the trainer
builds them without pipeline parallelism (``build_partitioned``, the trainer's optimizer and
schedule, ``deepspeed.initialize``), then ``--steps`` optimizer steps run on random tokens
(the config's micro-batch and accumulation). Measured: the peak the training log reports
(``memory_gb``: ``get_accelerator().max_memory_allocated()``, on a CPU the peak RSS).
Predicted: the stage memory of :func:`tapered_megatron.planning.balance.analyse` (what
``python -m tapered_megatron.plan`` reports for this layout) on this accelerator's cost-model
preset at the ds_config's precision. The preset's fixed overhead (CUDA context, allocator slack,
communication buffers) is outside ``max_memory_allocated``, so the line gives the prediction
with and without it. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import deepspeed
import torch
from bench_common import emit, stamp
from deepspeed.accelerator import get_accelerator

from tapered_megatron import parallel
from tapered_megatron.checkpoint.layout import ParallelLayout
from tapered_megatron.planning import cost
from tapered_megatron.planning.balance import analyse
from tapered_megatron.training import launch, optim
from tapered_megatron.training.logger import device_product_name, memory_gb
from tapered_megatron.training.trainer import build_partitioned


def predicted(cfg, ds: dict, layout: ParallelLayout) -> dict[str, float]:
    """The planner's bytes for this layout: the whole stage, its fixed overhead, model state."""
    acc = get_accelerator()
    dev = cost.get_device("cpu") if acc.device_name() == "cpu" else cost.resolve_device("auto")
    dev = replace(dev, precision="fp32" if launch.precision(ds) == "fp32" else "bf16")
    bal = analyse(
        cfg,
        1,
        layout.grad_accum,
        device=dev,
        gpu_mem=float("inf"),
        dp=layout.dp,
        zero_stage=layout.zero_stage,
        tp=layout.tp,
        micro_batch_size=layout.micro_batch_size,
        methods=("balancer",),
        zero3=cost.Zero3.from_ds_config(ds) if layout.zero_stage == 3 else None,
    )
    return {
        "device_preset": dev.name,
        "stage_bytes": bal.methods["balancer"].stage_mem[0],
        "overhead_bytes": dev.overhead_bytes,
        "model_state_bytes": sum(u.static for u in bal.costs) / layout.tp,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps")
    own, rest = ap.parse_known_args(argv)
    steps = own.steps
    _args, cfg, ds, layout = launch.setup(rest)
    if layout.world_size != 1 or layout.pp != 1:
        raise SystemExit("gpu_memory_vs_plan: one process without pipeline parallelism")
    launch.init_distributed()
    parallel.init_model_parallel(1, 1)
    device = torch.device(get_accelerator().current_device_name())
    torch.manual_seed(0)
    model = build_partitioned(cfg, ds)
    model.to(device)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optim.build_optimizer(model, cfg.train),
        lr_scheduler=lambda opt: optim.build_scheduler(opt, cfg.train),
        config=ds,
    )
    b, s = layout.micro_batch_size, cfg.model.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (b, s + 1), device=device)
    t = time.perf_counter()
    for _ in range(steps * layout.grad_accum):
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
    get_accelerator().synchronize()
    step_s = (time.perf_counter() - t) / steps
    measured = memory_gb() * 1e9
    plan = predicted(cfg, ds, layout)
    allocated = plan["stage_bytes"] - plan["overhead_bytes"]
    line = {
        "bench": "memory_vs_plan",
        **stamp("" if device.type == "cpu" else device_product_name()),
        "device": device_product_name(),
        "arch": cfg.model.arch,
        "params": sum(p.numel() for p in model.parameters()),
        "layout": {
            "zero": layout.zero_stage,
            "dp": layout.dp,
            "micro_batch": b,
            "accumulation": layout.grad_accum,
            "seq_len": s,
            "layers": cfg.model.layers,
            "precision": launch.precision(ds),
            "recompute": cfg.train.recompute,
        },
        "steps": steps,
        "step_s": round(step_s, 4),
        "loss": round(loss.item(), 4),
        "measured_peak_gib": round(measured / cost.GiB, 3),
        "predicted_gib": round(plan["stage_bytes"] / cost.GiB, 3),
        "predicted_without_overhead_gib": round(allocated / cost.GiB, 3),
        "predicted_model_state_gib": round(plan["model_state_bytes"] / cost.GiB, 3),
        "device_preset": plan["device_preset"],
        "measured_over_predicted": round(measured / allocated, 3),
    }
    emit(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
