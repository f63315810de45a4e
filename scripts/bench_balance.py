"""Benchmarks of the pipeline balancer and the planner. Each mode prints JSON lines.

    python scripts/bench_balance.py predict            # 1.3B presets, 4 archs, PP 4/8, all methods
    python scripts/bench_balance.py measure            # real PP=2 CPU runs (2 gloo processes)
    python scripts/bench_balance.py memory             # planner memory vs measured peak (PP=2)

``measure`` trains one strongly tapered small model (cosine 1.75/0.25, large vocabulary) with
DeepSpeed's pipeline engine (1F1B, 2 stages, our ``BalancedPipelineModule``) once per partition
method, in one invocation, on the same batches, and reports per method: step time (median),
per-stage busy time (forward + loss + backward per pass, thread CPU time from
``tapered_megatron.planning.clock.StageClock`` hooks) next to the
cost model's prediction (profiled per-unit times, and the analytic FLOP model), and the losses.
It also runs the balancer's sub-layer split and checks its losses equal the whole-layer split's.
``memory`` starts fresh process pairs per configuration and compares each stage's peak resident
memory growth with the planner's per-stage memory prediction.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

from bench_common import emit, stamp

from tapered_megatron.parallel.local_launch import run_workers

MODEL = [
    "--model.d_model", "256", "--model.layers", "12", "--model.heads", "4",
    "--model.d_ff", "1024", "--model.vocab_size", "8192", "--model.seq_len", "256",
    "--taper.schedule", "cosine", "--taper.ratio", "1.75", "0.25", "--taper.multiple", "16",
    "--train.micro_batch_size", "2", "--train.global_batch_size", "16",
]  # fmt: skip
MICRO_BATCH = 2
MICRO_BATCHES = 8


# --------------------------------------------------------------------------- predicted (1.3B)
def predict() -> list[dict]:
    from tapered_megatron.architectures import BUILT_IN
    from tapered_megatron.config import load_config
    from tapered_megatron.planning.balance import METHODS, analyse

    rows = []
    for arch in BUILT_IN:
        cfg = load_config(f"{arch}_1.3b")
        for pp in (4, 8):
            for unit in ("layer", "sublayer"):
                res = analyse(cfg, pp, 128, unit=unit, device="h100")
                row = {
                    "bench": "balance_predict",
                    "config": f"{arch}_1.3b",
                    "pp": pp,
                    "unit": unit,
                    **{m: round(res.methods[m].bottleneck, 4) for m in METHODS},
                    "parts": list(res.methods["balancer"].parts),
                }
                rows.append(row)
                emit(row)
    return rows


# --------------------------------------------------------------------------- measured (PP=2)
def _batches(cfg, steps: int) -> list[list]:
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        mb = []
        for _ in range(MICRO_BATCHES):
            ids = torch.randint(0, cfg.model.vocab_size, (MICRO_BATCH, cfg.model.seq_len + 1),
                                generator=g)  # fmt: skip
            mb.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        out.append(mb)
    return out


class _Run:
    """One DeepSpeed pipeline engine (2 stages) over a given split, instrumented for busy time."""

    def __init__(self, cfg, unit: str, parts, zero: int) -> None:
        import deepspeed
        import torch

        from tapered_megatron.models import lm_loss, pipeline_layer_specs
        from tapered_megatron.parallel.pipeline import BalancedPipelineModule
        from tapered_megatron.planning.clock import StageClock

        torch.manual_seed(cfg.train.seed)
        # thread CPU time: the compute this stage did, not time spent waiting for a core
        self.clock = StageClock(time.thread_time, synchronize=False)
        self.module = BalancedPipelineModule(
            pipeline_layer_specs(cfg, unit=unit), list(parts), num_stages=2,
            loss_fn=self.clock.timed(lm_loss), table=f"[bench] unit={unit} parts={list(parts)}",
        )  # fmt: skip
        self.clock.attach(self.module)
        opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3, weight_decay=0.0)
        ds = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": MICRO_BATCHES,
            "train_batch_size": MICRO_BATCH * MICRO_BATCHES,
            "zero_optimization": {"stage": zero},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=opt, config=ds)
        self.walls: list[float] = []
        self.busys: list[float] = []
        self.instrs: list[list[float]] = []
        self.losses: list[float] = []

    def step(self, batches) -> None:
        import torch

        first = len(self.clock.passes)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = self.engine.train_batch(iter(batches))
        self.walls.append(time.perf_counter() - t0)
        instr = [seconds for _, seconds in self.clock.passes[first:]]  # in execution order
        self.busys.append(sum(instr))
        self.instrs.append(instr)
        self.losses.append(float(loss))


def _measure_worker(rank: int, world: int, steps: int, runs: list) -> list[dict]:
    import deepspeed

    from tapered_megatron.config import load_config

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config("quickstart", MODEL)
    engines = [_Run(cfg, unit, parts, zero=0) for unit, _, parts in runs]
    for i, step_batches in enumerate(_batches(cfg, steps)):
        # interleaved, rotating order: every split sees the same background load
        for k in range(len(engines)):
            engines[(i + k) % len(engines)].step(step_batches)
    return [
        {"wall": e.walls, "busy": e.busys, "instr": e.instrs, "losses": e.losses} for e in engines
    ]


def critical_path(instr: list[list[float]], micro_batches: int) -> float:
    """1F1B makespan of one step rebuilt from each stage's measured forward/backward durations
    (``instr[s]`` in the order the stage executed them) and DeepSpeed's own TrainSchedule:
    forward k on stage s waits for forward k on stage s-1, backward k for backward k on s+1.
    Communication and optimizer time are left out: this is the compute critical path."""
    from deepspeed.runtime.pipe import schedule

    p = len(instr)
    order = []
    for s in range(p):
        cmds = [c for step in schedule.TrainSchedule(micro_batches, p, s).steps() for c in step]
        kinds = [
            type(c).__name__
            for c in cmds
            if isinstance(c, (schedule.ForwardPass, schedule.BackwardPass))
        ]
        order.append(kinds)
    end_f = [[0.0] * micro_batches for _ in range(p)]
    end_b = [[0.0] * micro_batches for _ in range(p)]
    pos = [0] * p  # next instruction of each stage
    clock = [0.0] * p
    nf, nb = [0] * p, [0] * p
    done = 0
    total = sum(len(o) for o in order)
    while done < total:
        progressed = False
        for s in range(p):
            if pos[s] == len(order[s]):
                continue
            kind, dur = order[s][pos[s]], instr[s][pos[s]]
            if kind == "ForwardPass":
                k = nf[s]
                if s > 0 and nf[s - 1] <= k:
                    continue
                start = max(clock[s], end_f[s - 1][k] if s > 0 else 0.0)
                end_f[s][k] = clock[s] = start + dur
                nf[s] += 1
            else:
                k = nb[s]
                if s < p - 1 and nb[s + 1] <= k:
                    continue
                start = max(clock[s], end_b[s + 1][k] if s < p - 1 else 0.0)
                end_b[s][k] = clock[s] = start + dur
                nb[s] += 1
            pos[s] += 1
            done += 1
            progressed = True
        assert progressed, "schedule deadlock"
    return max(clock)


def measure(steps: int) -> list[dict]:
    import torch

    from tapered_megatron.config import load_config
    from tapered_megatron.planning.balance import analyse, evaluate

    torch.set_num_threads(1)
    cfg = load_config("quickstart", MODEL)
    runs, models = [], {}
    for unit in ("layer", "sublayer"):
        prof = analyse(cfg, 2, MICRO_BATCHES, unit=unit, device="cpu", profiled=True, zero_stage=0)
        ana = analyse(cfg, 2, MICRO_BATCHES, unit=unit, device="cpu", zero_stage=0)
        models[unit] = (prof, ana)
        for m in ("balancer", "uniform", "parameters") if unit == "layer" else ("balancer",):
            runs.append((unit, m, list(prof.methods[m].parts)))
    per_rank = run_workers(_measure_worker, 2, steps, runs, timeout=1800)
    warm = 1  # the first step allocates and warms up
    rows, by_key = [], {}
    for i, (unit, method, parts) in enumerate(runs):
        r0, r1 = per_rank[0][i], per_rank[1][i]
        prof, ana = models[unit]
        wall = statistics.median([max(a, b) for a, b in zip(r0["wall"], r1["wall"])][warm:])
        crit = statistics.median(
            critical_path([r0["instr"][i], r1["instr"][i]], MICRO_BATCHES)
            for i in range(warm, len(r0["instr"]))
        )
        busy = [statistics.median(r["busy"][warm:]) for r in (r0, r1)]
        ev = [
            evaluate(method, parts, x.costs, MICRO_BATCHES, x.cap, x.overhead) for x in (prof, ana)
        ]
        pred_p = [MICRO_BATCHES * t for t in ev[0].stage_times]  # M micro-batches per step
        pred_a = [MICRO_BATCHES * t for t in ev[1].stage_times]
        row = {
            "bench": "balance_measure", "unit": unit, "method": method, "parts": parts,
            "step_s": round(wall, 4), "critical_path_s": round(crit, 4),
            "step_s_all": [round(max(a, b), 3) for a, b in zip(r0["wall"], r1["wall"])],
            "step_s_min": round(min(max(a, b) for a, b in zip(r0["wall"], r1["wall"])), 4),
            "busy_s": [round(x, 4) for x in busy],
            "pred_profiled_s": [round(x, 4) for x in pred_p],
            "pred_analytic_s": [round(x, 4) for x in pred_a],
            "err_profiled": [round(p / m - 1, 4) for p, m in zip(pred_p, busy)],
            "err_analytic": [round(p / m - 1, 4) for p, m in zip(pred_a, busy)],
            "bottleneck_measured": round(max(busy) / statistics.mean(busy), 4),
            "bottleneck_profiled": round(ev[0].bottleneck, 4),
            "losses": [round(x, 6) for x in r1["losses"]],
            **stamp(),
        }  # fmt: skip
        by_key[(unit, method)] = row
        rows.append(row)
        emit(row)
    ours = by_key[("layer", "balancer")]
    sub = by_key[("sublayer", "balancer")]
    summary = {
        "bench": "balance_measure_summary", "steps": steps, "micro_batches": MICRO_BATCHES,
        "speedup_vs_uniform": round(by_key[("layer", "uniform")]["step_s"] / ours["step_s"], 4),
        "speedup_vs_parameters": round(
            by_key[("layer", "parameters")]["step_s"] / ours["step_s"], 4),
        "sublayer_speedup_vs_layer": round(ours["step_s"] / sub["step_s"], 4),
        # fastest step of each split (the least disturbed by other processes)
        "min_speedup_vs_uniform": round(
            by_key[("layer", "uniform")]["step_s_min"] / ours["step_s_min"], 4),
        "min_speedup_vs_parameters": round(
            by_key[("layer", "parameters")]["step_s_min"] / ours["step_s_min"], 4),
        # the same ratios on the compute critical path rebuilt from measured instruction times
        "crit_speedup_vs_uniform": round(
            by_key[("layer", "uniform")]["critical_path_s"] / ours["critical_path_s"], 4),
        "crit_speedup_vs_parameters": round(
            by_key[("layer", "parameters")]["critical_path_s"] / ours["critical_path_s"], 4),
        "crit_sublayer_speedup_vs_layer": round(
            ours["critical_path_s"] / sub["critical_path_s"], 4),
        "sublayer_max_loss_diff": max(abs(a - b) for a, b in zip(sub["losses"], ours["losses"])),
        "sublayer_first_loss_equal": sub["losses"][0] == ours["losses"][0],
        # float-noise floor: two whole-layer splits of the same model differ this much too
        "layer_splits_max_loss_diff": max(
            abs(a - b) for a, b in zip(by_key[("layer", "uniform")]["losses"], ours["losses"])),
        "max_abs_err_profiled": max(abs(e) for r in rows for e in r["err_profiled"]),
        "max_abs_err_analytic": max(abs(e) for r in rows for e in r["err_analytic"]),
        **stamp(),
    }  # fmt: skip
    emit(summary)
    return [*rows, summary]


# --------------------------------------------------------------------------- memory (planner)
def _rss() -> tuple[float, float]:
    """(current, peak) resident bytes of this process."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = float(line.split()[1]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _warm_up(cfg) -> None:
    """Touch the kernels and libraries a training step uses (one block + head + AdamW at batch
    1), so the measured growth is the job's memory, not one-time library pages."""
    import torch

    from tapered_megatron.models import lm_loss, pipeline_layer_specs

    specs = pipeline_layer_specs(cfg, unit="layer")
    mods = torch.nn.Sequential(specs[1].build(), specs[-1].build())
    opt = torch.optim.AdamW(mods.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len))
    x = torch.randn(1, cfg.model.seq_len, cfg.model.d_model, requires_grad=True)
    lm_loss(mods(x), ids).backward()
    opt.step()
    torch.distributed.barrier()
    del mods, opt, x
    gc.collect()


def _memory_worker(rank: int, world: int, unit: str, steps: int) -> dict:
    import deepspeed

    from tapered_megatron.config import load_config
    from tapered_megatron.planning.balance import analyse, evaluate

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config("quickstart", MODEL)
    res = analyse(cfg, 2, MICRO_BATCHES, unit=unit, device="cpu", zero_stage=0)
    prof = analyse(cfg, 2, MICRO_BATCHES, unit=unit, device="cpu", zero_stage=0, profiled=True)
    parts = res.methods["balancer"].parts
    pred_p = evaluate("balancer", parts, prof.costs, MICRO_BATCHES, prof.cap, prof.overhead)
    batches = _batches(cfg, steps)
    _warm_up(cfg)
    rss0, _ = _rss()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS watermark (VmHWM)
        f.write("5")
    run = _Run(cfg, unit, parts, zero=0)
    for b in batches:
        run.step(b)
    _, peak = _rss()
    return {"peak_growth": peak - rss0, "pred": res.methods["balancer"].stage_mem[rank],
            "pred_profiled": pred_p.stage_mem[rank], "parts": list(parts)}  # fmt: skip


def memory(steps: int) -> list[dict]:
    import torch

    from tapered_megatron.config import load_config
    from tapered_megatron.planning.balance import analyse

    # Freed tensors must go back to the OS, or RSS measures glibc's heap, not the job.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    torch.set_num_threads(1)
    cfg = load_config("quickstart", MODEL)
    rows = []
    for unit in ("layer", "sublayer"):
        analyse(cfg, 2, MICRO_BATCHES, unit=unit, device="cpu", profiled=True)  # fill the cache
        per_rank = run_workers(_memory_worker, 2, unit, steps, timeout=1800)
        row = {
            "bench": "plan_memory", "unit": unit, "zero": 0, "precision": "fp32",
            "micro_batch": MICRO_BATCH, "micro_batches": MICRO_BATCHES,
            "parts": per_rank[0]["parts"],
            "measured_mib": [round(r["peak_growth"] / 2**20, 1) for r in per_rank],
            "predicted_mib": [round(r["pred"] / 2**20, 1) for r in per_rank],
            "predicted_profiled_mib": [round(r["pred_profiled"] / 2**20, 1) for r in per_rank],
            "err": [round(r["pred"] / r["peak_growth"] - 1, 4) for r in per_rank],
            "err_profiled": [round(r["pred_profiled"] / r["peak_growth"] - 1, 4) for r in per_rank],
            **stamp(),
        }  # fmt: skip
        rows.append(row)
        emit(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("predict", "measure", "memory"))
    ap.add_argument("--steps", type=int, default=5, help="training steps per method")
    a = ap.parse_args(argv)
    if a.mode == "predict":
        predict()
    elif a.mode == "measure":
        measure(a.steps)
    else:
        memory(a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
