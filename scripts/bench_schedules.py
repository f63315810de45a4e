"""Step time of each pipeline schedule against 1F1B on CPU ranks, beside the simulator's
prediction. Prints one JSON line per (pipeline size, schedule).

    python scripts/bench_schedules.py [--pp 2 4] [--steps 4]

One strongly tapered small model (cosine 1.75/0.25, 12 layers, large vocabulary), 8
micro-batches of 2 sequences per step, fp32, one data-parallel rank. Per pipeline size one
invocation builds every schedule on the same ranks: ``1f1b`` on DeepSpeed's PipelineEngine
(the min-max stage cut of the balancer), the others on torch.distributed.pipelining with ``v =
2`` chunks per rank (the virtual-stage balancer's cut); the steps rotate over the schedules so
each sees the same background load. ``measured_ms`` is the median wall time of a step after
one warm-up step; ``predicted_ms`` the simulator's makespan of the same cut with the CPU cost
model (the measured matmul peak of this machine), without point-to-point or optimizer time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import emit, stamp

from tapered_megatron.parallel.local_launch import run_workers

MODEL = [
    "--model.d_model", "256", "--model.layers", "12", "--model.heads", "4",
    "--model.d_ff", "1024", "--model.vocab_size", "8192", "--model.seq_len", "256",
    "--taper.schedule", "cosine", "--taper.ratio", "1.75", "0.25", "--taper.multiple", "16",
    "--train.micro_batch_size", "2",
]  # fmt: skip
MICRO_BATCHES = 8
LAYOUTS = [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("zero_bubble", 2)]


def _cfg(pp: int, schedule: str, v: int):
    from tapered_megatron.config import load_config

    extra = ["--parallel.pp", str(pp), "--parallel.schedule", schedule]
    return load_config("quickstart", [*MODEL, *extra, "--parallel.virtual_stages", str(v)])


def _batches(cfg, steps: int) -> list[list]:
    import torch

    g = torch.Generator().manual_seed(1234)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len + 1)
    out = []
    for _ in range(steps):
        ids = [torch.randint(0, cfg.model.vocab_size, shape, generator=g) for _ in range(8)]
        out.append([(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in ids])
    return out


def _ds_config(cfg) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }


def _engines(pp: int, cuts: dict[str, list[int]]) -> list:
    """``train_batch`` of every layout on this rank, in :data:`LAYOUTS` order."""
    import deepspeed
    import torch

    from tapered_megatron import parallel
    from tapered_megatron.models import lm_loss, pipeline_layer_specs
    from tapered_megatron.parallel.pipeline import BalancedPipelineModule
    from tapered_megatron.parallel.schedules import VirtualPipeline

    def adam(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)

    def engine_kwargs(m: torch.nn.Module) -> dict:
        return {"optimizer": adam(m)}

    out = []
    for schedule, v in LAYOUTS:
        cfg = _cfg(pp, schedule, v)
        if schedule == "1f1b":
            module = BalancedPipelineModule(
                pipeline_layer_specs(cfg), cuts[schedule], topology=parallel.get_topology(),
                loss_fn=lm_loss, table=f"[bench] 1f1b parts={cuts[schedule]}",
            )  # fmt: skip
            engine, *_ = deepspeed.initialize(
                model=module, optimizer=adam(module), config=_ds_config(cfg)
            )
            out.append(lambda b, e=engine: float(e.train_batch(iter(b))))
        else:
            pipe = VirtualPipeline(
                cfg, _ds_config(cfg), MICRO_BATCHES, engine_kwargs, cuts[schedule]
            )
            out.append(lambda b, p=pipe: p.train_batch(iter(b)))
    return out


def _worker(rank: int, world: int, steps: int, cuts: dict[str, list[int]]) -> list[dict]:
    import deepspeed
    import torch

    from tapered_megatron.parallel import init_model_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    init_model_parallel(tp=1, pp=world)
    runs = _engines(world, cuts)
    walls: list[list[float]] = [[] for _ in runs]
    losses: list[list[float]] = [[] for _ in runs]
    for i, batches in enumerate(_batches(_cfg(world, "1f1b", 1), steps + 1)):
        for k in range(len(runs)):
            j = (i + k) % len(runs)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            losses[j].append(runs[j](batches))
            walls[j].append(time.perf_counter() - t0)
    return [{"walls": w[1:], "losses": x} for w, x in zip(walls, losses, strict=True)]


def predictions(pp: int) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Per layout the cut the run uses and the simulator's step (seconds, predicted)."""
    from tapered_megatron.planning.balance import analyse_chunks

    cuts, steps = {}, {}
    for schedule, v in LAYOUTS:
        _, plans = analyse_chunks(_cfg(pp, schedule, v), pp, v, schedule, MICRO_BATCHES)
        plan = plans["solver" if schedule == "1f1b" else "balancer"]
        cuts[schedule], steps[schedule] = list(plan.parts), plan.sim.makespan
    return cuts, steps


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per schedule")
    a = ap.parse_args(argv)
    for pp in a.pp:
        cuts, predicted = predictions(pp)
        per_rank = run_workers(_worker, pp, a.steps, cuts, timeout=3000)
        measured = {
            s: statistics.median(per_rank[0][i]["walls"]) for i, (s, _) in enumerate(LAYOUTS)
        }
        for i, (schedule, v) in enumerate(LAYOUTS):
            emit(
                {
                    "bench": "pipeline_schedules",
                    "pp": pp,
                    "schedule": schedule,
                    "virtual_stages": v,
                    "micro_batches": MICRO_BATCHES,
                    "measured_ms": round(measured[schedule] * 1e3, 1),
                    "predicted_ms": round(predicted[schedule] * 1e3, 1),
                    "measured_vs_1f1b": round(measured[schedule] / measured["1f1b"], 3),
                    "predicted_vs_1f1b": round(predicted[schedule] / predicted["1f1b"], 3),
                    "first_loss": round(per_rank[0][i]["losses"][0], 5),
                    "parts": cuts[schedule],
                    **stamp(),
                }
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
