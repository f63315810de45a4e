"""Step time of each pipeline schedule against 1F1B on CPU ranks, beside the simulator's
prediction with this machine's runtime constants. Prints one JSON line per constant fit and per
(pipeline size, schedule).

    python scripts/bench_schedules.py [--pp 2] [--predict 4] [--steps 12]

One strongly tapered small model (cosine 1.75/0.25, 12 layers, large vocabulary), 8
micro-batches of 2 sequences per step, fp32, one data-parallel rank: ``1f1b`` on DeepSpeed's
PipelineEngine (the min-max stage cut), the others on torch.distributed.pipelining with ``v = 2``
chunks per rank (the virtual-stage balancer's cut).

First, on two ranks, micro-benchmarks give the CPU device's constants
(:class:`~tapered_megatron.planning.cost.Device`): a gloo send's fixed cost and bandwidth
(``p2p_latency_s``, ``intra_bw``) from ping-pongs of 256 B up to four activations; the
optimizer step (clip + AdamW) of the model's parameters as ``mem_bw``; torch's split backward
(input pass, then weight pass) of the model's blocks against a whole backward
(``split_backward``); and per schedule its
runtime's own seconds per compute action (``schedule_overhead``), fitted (least squares) to the
steps of the same model shrunk until its compute is small (d_model 32, sequence 16, the same 12
tapered layers) at 8 and 16 micro-batches, less that model's replayed step with its unit times
measured here (:func:`~tapered_megatron.planning.profile.profile_units`).
Then the balancers cut the model with those constants and every schedule runs on the same ranks,
the schedules rotated step by step so each sees the same background load. ``measured_ms`` is the
median over ``--steps`` steps (after one warm-up step) of the step's wall time (its slowest
rank), with the quartiles; ``measured_cpu_ms`` the median CPU time of the busiest rank.
``predicted_ms`` is the simulator's makespan of the same cut (torch's or DeepSpeed's own order,
the cost model's compute, pipeline sends and per-action cost) plus the slowest rank's optimizer
step; ``predicted_profiled_ms`` the same with the unit times measured here in place of the cost
model's; ``predicted_compute_ms`` the makespan with the cost model's compute alone.
``--predict`` adds pipeline sizes predicted only, with the constants measured on two ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from typing import Any

from bench_common import emit, stamp

from tapered_megatron.parallel.local_launch import run_workers

TAPER = [
    "--taper.schedule", "cosine", "--taper.ratio", "1.75", "0.25", "--taper.multiple", "16",
    "--train.micro_batch_size", "2", "--model.layers", "12",
]  # fmt: skip
MODEL = [
    "--model.d_model", "256", "--model.heads", "4", "--model.d_ff", "1024",
    "--model.vocab_size", "8192", "--model.seq_len", "256", *TAPER,
]  # fmt: skip
#: The model shrunk until the runtime's own cost dominates its step (the overhead fit).
TINY = [
    "--model.d_model", "32", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "256", "--model.seq_len", "16", *TAPER,
]  # fmt: skip
MICRO_BATCHES = 8
FIT_MICRO_BATCHES = (8, 16)
FIT_STEPS = 8
LAYOUTS = [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("zero_bubble", 2)]
P2P_SIZES = (256, 2**19, 2**21)  # bytes; 2**19 is one activation of MODEL (2 x 256 x 256 fp32)
P2P_REPS = 30
OPT_REPS = 5

Cuts = dict[str, list[int]]


def _cfg(model: list[str], pp: int, schedule: str, v: int):
    from tapered_megatron.config import load_config

    extra = ["--parallel.pp", str(pp), "--parallel.schedule", schedule]
    return load_config("quickstart", [*model, *extra, "--parallel.virtual_stages", str(v)])


def _batches(cfg, steps: int, micro_batches: int) -> list[list]:
    import torch

    g = torch.Generator().manual_seed(1234)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len + 1)
    out = []
    for _ in range(steps):
        ids = [torch.randint(0, cfg.model.vocab_size, shape, generator=g) for _ in range(8)]
        ids = ids * (micro_batches // len(ids))
        out.append([(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in ids])
    return out


def _ds_config(cfg, micro_batches: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }


def _adam(m):
    import torch

    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)


def _engines(model: list[str], pp: int, micro_batches: int, cuts: Cuts) -> list:
    """``train_batch`` of every layout on this rank, in :data:`LAYOUTS` order."""
    import deepspeed

    from tapered_megatron import parallel
    from tapered_megatron.models import lm_loss, pipeline_layer_specs
    from tapered_megatron.parallel.pipeline import BalancedPipelineModule
    from tapered_megatron.parallel.schedules import VirtualPipeline

    out = []
    for schedule, v in LAYOUTS:
        cfg = _cfg(model, pp, schedule, v)
        ds = _ds_config(cfg, micro_batches)
        if schedule == "1f1b":
            module = BalancedPipelineModule(
                pipeline_layer_specs(cfg), cuts[schedule], topology=parallel.get_topology(),
                loss_fn=lm_loss, table=f"[bench] 1f1b parts={cuts[schedule]}",
            )  # fmt: skip
            engine, *_ = deepspeed.initialize(model=module, optimizer=_adam(module), config=ds)
            out.append(lambda b, e=engine: float(e.train_batch(iter(b))))
        else:
            pipe = VirtualPipeline(
                cfg, ds, micro_batches, lambda m: {"optimizer": _adam(m)}, cuts[schedule]
            )
            out.append(lambda b, p=pipe: p.train_batch(iter(b)))
    return out


def _rotated(model: list[str], pp: int, micro_batches: int, cuts: Cuts, steps: int) -> list:
    """Per layout: wall and CPU seconds of each step on this rank after one warm-up step, and
    the losses; the layouts rotated step by step."""
    import torch

    runs = _engines(model, pp, micro_batches, cuts)
    out: list[dict[str, list[float]]] = [{"wall": [], "cpu": [], "loss": []} for _ in runs]
    batches = _batches(_cfg(model, pp, "1f1b", 1), steps + 1, micro_batches)
    for i, batch in enumerate(batches):
        for k in range(len(runs)):
            j = (i + k) % len(runs)
            torch.distributed.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            out[j]["loss"].append(runs[j](batch))
            if i:
                out[j]["wall"].append(time.perf_counter() - w0)
                out[j]["cpu"].append(time.process_time() - c0)
    return out


def _p2p(rank: int) -> dict[int, float]:
    """One-way seconds of a gloo send of each of :data:`P2P_SIZES`: half the fastest ping-pong
    (the others wait for a core on a shared machine)."""
    import torch
    import torch.distributed as dist

    out = {}
    for size in P2P_SIZES:
        t = torch.zeros(size // 4)
        times = []
        for i in range(P2P_REPS + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out[size] = min(times) / 2
    return out


def _optimizer_s_per_param() -> float:
    """CPU seconds per parameter of the pipeline's optimizer step (clip by the global norm, then
    AdamW) over the whole model's parameters, median of :data:`OPT_REPS` after two warm-ups."""
    import torch

    from tapered_megatron.models import build_model

    model = build_model(_cfg(MODEL, 1, "1f1b", 1))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _adam(model)
    times = []
    for i in range(OPT_REPS + 2):
        for p in params:
            p.grad = torch.randn_like(p)
        t0 = time.thread_time()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.thread_time() - t0)
    return statistics.median(times) / sum(p.numel() for p in params)


def _split_backward() -> tuple[float, float]:
    """torch's input and weight backward passes (``stage_backward_input`` / ``_weight``, what
    the zero-bubble schedules run) as fractions of one whole backward, over the model's blocks
    on one micro-batch (thread CPU time, medians of :data:`OPT_REPS` after one warm-up)."""
    import torch
    from torch import nn
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from tapered_megatron.models import units

    cfg = _cfg(MODEL, 1, "1f1b", 1)
    blocks = nn.Sequential(*(u.build() for u in units(cfg) if u.kind == "layer"))
    x0 = torch.randn(cfg.train.micro_batch_size, cfg.model.seq_len, cfg.model.d_model)
    times: list[list[float]] = [[], [], []]
    for i in range(OPT_REPS + 1):
        for split in (False, True):
            x = x0.clone().requires_grad_()
            y = blocks(x)
            g = torch.randn_like(y)
            t0 = time.thread_time()
            if split:
                _, groups = stage_backward_input([y], [g], [x], blocks.parameters())
                t1 = time.thread_time()
                stage_backward_weight(blocks.parameters(), groups)
                spans = [(1, t1 - t0), (2, time.thread_time() - t1)]
            else:
                y.backward(g)
                spans = [(0, time.thread_time() - t0)]
            blocks.zero_grad(set_to_none=True)
            for k, t in spans:
                if i:
                    times[k].append(t)
    whole, inp, wgt = (statistics.median(t) for t in times)
    return inp / whole, wgt / whole


def _init(world: int) -> None:
    """This rank's gloo group and a pipeline of ``world`` stages."""
    import deepspeed

    from tapered_megatron.parallel import init_model_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    init_model_parallel(tp=1, pp=world)


def _calibrate(rank: int, world: int, tiny_cuts: dict[int, Cuts]) -> dict[str, Any]:
    _init(world)
    return {
        "p2p": _p2p(rank),
        "opt": _optimizer_s_per_param(),
        "tiny": {m: _rotated(TINY, world, m, tiny_cuts[m], FIT_STEPS) for m in tiny_cuts},
    }


def _measure(rank: int, world: int, cuts: Cuts, steps: int) -> list:
    _init(world)
    return _rotated(MODEL, world, MICRO_BATCHES, cuts, steps)


def _plan(model: list[str], pp: int, schedule: str, v: int, m: int, dev, parts=None, **kw):
    """The balancer's cut (or ``parts``) of ``model`` for one layout on device ``dev``, its
    setup, each rank's optimizer step and the predicted step: the makespan and the slowest
    rank's optimizer step. ``kw``: :func:`~tapered_megatron.planning.balance.unit_setup`'s
    (``profiled=True``: unit times measured here instead of the cost model's)."""
    from tapered_megatron.planning import cost as costlib
    from tapered_megatron.planning.balance import chunk_setup
    from tapered_megatron.planning.chunks import balance_chunks, evaluate_chunks
    from tapered_megatron.planning.schedule import rank_sums

    cfg = _cfg(model, pp, schedule, v)
    act = cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.d_model * 4
    p2p = costlib.p2p_time(act, dev.intra_bw, dev)
    setup = chunk_setup(cfg, pp, v, schedule, m, device=dev, p2p=p2p, zero_stage=0, **kw)
    if parts is None:
        plan = balance_chunks(setup)["solver" if schedule == "1f1b" else "balancer"]
    else:
        plan = evaluate_chunks(setup, parts, "measured")
    bpp = costlib.bytes_per_param("fp32", 0, 1, True)
    params = rank_sums(plan.chunk_params, plan.ranks, pp)
    opt = [costlib.optimizer_time(n, bpp, dev) for n in params]
    return setup, plan, opt, plan.sim.makespan + max(opt)


def _fit_p2p(one_way: dict[int, float]) -> tuple[float, float]:
    """A send's fixed cost (s: the smallest message's time) and bandwidth (bytes/s: the
    largest message's extra bytes over its extra time) from one-way times."""
    small, large = min(one_way), max(one_way)
    return one_way[small], (large - small) / (one_way[large] - one_way[small])


def _fit_overhead(dev, pp: int, tiny_cuts: dict[int, Cuts], tiny: dict[int, list]) -> dict:
    """Per schedule, the CPU seconds per compute action (least squares over the ranks and both
    micro-batch counts) that make each rank's predicted CPU time for the tiny model (its unit
    times measured here, the rank's optimizer step) its measured median CPU time."""
    from tapered_megatron.planning.schedule import pipeline_order

    out = {}
    for i, (schedule, v) in enumerate(LAYOUTS):
        ky = kk = 0.0
        for m, cuts in tiny_cuts.items():
            _, plan, opt, _ = _plan(TINY, pp, schedule, v, m, dev, cuts[schedule], profiled=True)
            for r, acts in enumerate(pipeline_order(schedule, pp, v, m)):
                rest = statistics.median(tiny[m][r][i]["cpu"]) - plan.sim.rank_busy[r] - opt[r]
                ky += len(acts) * rest
                kk += len(acts) ** 2
        out[schedule] = ky / kk
    return out


def _slowest(per_rank: list, layout: int, clock: str = "wall") -> list[float]:
    """Per step, the slowest rank's seconds of ``layout`` on ``clock``."""
    steps = zip(*(r[layout][clock] for r in per_rank), strict=True)
    return [max(s) for s in steps]


def _busiest_cpu(per_rank: list, layout: int) -> float:
    """The largest of the ranks' median CPU seconds per step of ``layout``."""
    return max(statistics.median(r[layout]["cpu"]) for r in per_rank)


def _predicted_cpu(plan, opt: list[float]) -> float:
    """The busiest rank's predicted CPU seconds per step: its actions and its optimizer step."""
    return max(b + o for b, o in zip(plan.sim.rank_busy, opt, strict=True))


def _quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [round(q[0] * 1e3, 1), round(q[2] * 1e3, 1)]


def calibrated_device(pp: int) -> tuple[Any, dict]:
    """The CPU device with the constants measured on ``pp`` ranks, and the raw measurements."""
    import torch

    from tapered_megatron.planning import cost as costlib

    torch.set_num_threads(1)  # as each rank
    base = replace(costlib.resolve_device("cpu"), split_backward=_split_backward())
    tiny_cuts = {
        m: {s: list(_plan(TINY, pp, s, v, m, base)[1].parts) for s, v in LAYOUTS}
        for m in FIT_MICRO_BATCHES
    }
    raw = run_workers(_calibrate, pp, tiny_cuts, timeout=3000)
    latency, bw = _fit_p2p(raw[0]["p2p"])
    opt = max(r["opt"] for r in raw)
    bpp = costlib.bytes_per_param("fp32", 0, 1, True)
    # mem_bw that makes the cost model's optimizer step of one parameter take ``opt``
    unit_bw = costlib.optimizer_time(1, bpp, replace(base, mem_bw=1.0))
    dev = replace(base, p2p_latency_s=latency, intra_bw=bw, mem_bw=unit_bw / opt)
    tiny = {m: [r["tiny"][m] for r in raw] for m in FIT_MICRO_BATCHES}
    dev = replace(dev, schedule_overhead=_fit_overhead(dev, pp, tiny_cuts, tiny))
    fit = {
        "p2p_one_way_ms": {k: round(t * 1e3, 3) for k, t in raw[0]["p2p"].items()},
        "tiny_cpu_measured_ms": {
            m: {s: round(_busiest_cpu(t, i) * 1e3, 1) for i, (s, _) in enumerate(LAYOUTS)}
            for m, t in tiny.items()
        },
        "tiny_cpu_predicted_ms": {
            m: {s: round(_predicted_cpu(*_plan(TINY, pp, s, v, m, dev, tiny_cuts[m][s],
                                               profiled=True)[1:3]) * 1e3, 1)
                for s, v in LAYOUTS}
            for m in FIT_MICRO_BATCHES
        },
    }  # fmt: skip
    return dev, fit


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="*", default=[2], help="pipeline sizes measured")
    ap.add_argument("--predict", type=int, nargs="*", default=[4], help="sizes predicted only")
    ap.add_argument("--steps", type=int, default=12, help="measured steps per schedule")
    a = ap.parse_args(argv)
    dev, fit = calibrated_device(2)
    emit(
        {
            "bench": "pipeline_schedules_constants",
            "p2p_latency_ms": round(dev.p2p_latency_s * 1e3, 4),
            "p2p_bw_gbs": round(dev.intra_bw / 1e9, 3),
            "optimizer_mem_bw_gbs": round(dev.mem_bw / 1e9, 3),
            "peak_gflops": round(dev.peak_flops / 1e9, 1),
            "split_backward_input_weight": [round(x, 3) for x in dev.split_backward],
            "overhead_ms_per_action": {
                s: round(o * 1e3, 3) for s, o in dev.schedule_overhead.items()
            },
            **fit,
            **stamp(),
        }
    )
    bare = replace(dev, schedule_overhead={}, p2p_latency_s=0.0, intra_bw=float("inf"))
    for pp in [*a.pp, *a.predict]:
        plans = {s: _plan(MODEL, pp, s, v, MICRO_BATCHES, dev) for s, v in LAYOUTS}
        compute, profiled = {}, {}
        for s, v in LAYOUTS:
            parts = plans[s][1].parts
            compute[s] = _plan(MODEL, pp, s, v, MICRO_BATCHES, bare, parts)[1].sim.makespan
            profiled[s] = _plan(MODEL, pp, s, v, MICRO_BATCHES, dev, parts, profiled=True)
        cuts = {s: list(p[1].parts) for s, p in plans.items()}
        per_rank = None
        if pp in a.pp:
            load = os.getloadavg()[0]
            per_rank = run_workers(_measure, pp, cuts, a.steps, timeout=3000)
            load = [round(load, 2), round(os.getloadavg()[0], 2)]
        predicted = {s: p[3] for s, p in plans.items()}
        for i, (schedule, v) in enumerate(LAYOUTS):
            _, plan, opt, step = plans[schedule]
            row = {
                "bench": "pipeline_schedules",
                "pp": pp,
                "schedule": schedule,
                "virtual_stages": v,
                "micro_batches": MICRO_BATCHES,
                "parts": cuts[schedule],
                "predicted_ms": round(step * 1e3, 1),
                "predicted_profiled_ms": round(profiled[schedule][3] * 1e3, 1),
                "predicted_compute_ms": round(compute[schedule] * 1e3, 1),
                "predicted_cpu_ms": round(_predicted_cpu(plan, opt) * 1e3, 1),
                "predicted_profiled_cpu_ms": round(
                    _predicted_cpu(*profiled[schedule][1:3]) * 1e3, 1
                ),
                "predicted_vs_1f1b": round(step / predicted["1f1b"], 3),
            }
            if per_rank is not None:
                wall = _slowest(per_rank, i)
                base = statistics.median(_slowest(per_rank, 0))
                row |= {
                    "measured_ms": round(statistics.median(wall) * 1e3, 1),
                    "measured_quartiles_ms": _quartiles(wall),
                    "measured_cpu_ms": round(_busiest_cpu(per_rank, i) * 1e3, 1),
                    "measured_vs_1f1b": round(statistics.median(wall) / base, 3),
                    "predicted_over_measured": round(step / statistics.median(wall), 3),
                    "profiled_over_measured": round(
                        profiled[schedule][3] / statistics.median(wall), 3
                    ),
                    "first_loss": round(per_rank[0][i]["loss"][0], 5),
                    "steps": a.steps,
                    "load_avg_1min_before_after": load,
                }
            emit({**row, **stamp()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
