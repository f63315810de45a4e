"""Scale planner: choose TP x PP x DP, sequence parallelism, ZeRO stage, micro-batch,
recompute and pipeline unit.

``python -m tapered_megatron.plan --config transformer_7b --gpus 64 --gpu-mem 80 [--nodes 8]``
enumerates every layout that divides the GPUs (TP inside a node, dividing the heads, the taper
unit and the vocabulary padding; PP up to the number of pipeline units; DP the rest), every ZeRO
stage DeepSpeed allows for it (0-3 without pipeline, 0-1 with), micro-batch sizes that divide the
global batch, activation recomputation (``train.recompute``: none, selective, full), sequence
parallelism (TP > 1, a sequence the TP size divides: on, and also off where a half of the block
runs on the whole sequence and SP costs an all-gather more; elsewhere off has the same time and
more memory), and whole-layer or sub-layer pipeline units.
For each it

1. builds the unit costs and memory (:mod:`tapered_megatron.planning.cost`, the cost model the
   trainer's balancer reads, tensor-parallel all-reduces included),
2. runs the exact balancer under the per-GPU memory cap (infeasible -> rejected, with the reason)
   through the same call as the trainer (:func:`tapered_megatron.planning.balance.analyse`),
3. predicts the step time: the 1F1B pipeline (fill/drain + (M-1) x slowest stage, the stage
   times including their tensor-parallel all-reduces), pipeline sends (activation forward and
   gradient backward per micro-batch, NVLink when neighbouring stages share a node, else the
   network), the data-parallel communication (:func:`tapered_megatron.planning.cost.dp_comm`:
   the gradient reduce, per micro-batch under ZeRO-2/3, and the parameter all-gather, per pass
   under ZeRO-3; over NVLink when the DP group fits in a node, else over the network ports of
   the group's GPUs on each node (:func:`tapered_megatron.planning.cost.dp_bandwidth`); without
   pipeline, ZeRO-1/2/3 overlap the reduce with backward (``overlap_comm``) but for the last
   bucket, pipelines (DeepSpeed's 1F1B engine and the virtual-stage runtime, which both reduce
   after their schedule) and ZeRO-0 overlap nothing; what is hidden still slows the
   compute by the device's ``overlap_tax``) and the optimizer step (memory-bound, the model
   state read and written once),
4. reports MFU = model FLOPs (3 x forward FLOPs per token from the counters, recompute excluded) /
   (step time x GPUs x peak).

``--layout "tp2 sp pp1 dp32 zero3 mbs4 gas1 rc-none layer"`` (a label as the table prints it)
evaluates that one layout instead of searching, for any config (a preset, or a YAML file, e.g. a
uniform GPT/Llama given by its dimensions with ``taper.schedule: uniform``), and prints what the
search prints for its pick; a layout breaking a rule of the search (GPU count, TP inside a node
and dividing the model, ZeRO 0-1 under a pipeline) is refused with the rule.

``--calibrate`` predicts the published measured runs of the calibration set and scores the
predictions (:mod:`tapered_megatron.planning.calibration`); ``--calibrate --fit`` refits the GPU
presets' constants on its fitting runs.

Candidates are ranked by step time (the global batch is fixed by the config, so this is
throughput), ties broken by lower peak memory. The parameter total is checked on the meta device
(the model is built there, never allocated) against the counters. Device constants
(:data:`tapered_megatron.planning.cost.DEVICES`) are CLI options: ``--device``, ``--peak-tflops``,
``--nvlink-gbps``, ``--network-gbps``.

``--write-ds-config PATH`` and ``--write-slurm PATH`` fill a DeepSpeed JSON and the SLURM template
``scripts/slurm_cluster_template.sbatch`` from the best candidate; the JSON's ZeRO section
overlaps communication (``overlap_comm``) with the bucket sizes of
:func:`tapered_megatron.planning.cost.reduce_bucket_elems`, whose two reduce buffers the memory
prediction counts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tapered_megatron.config import Config, tp_problem
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.balance import analyse
from tapered_megatron.planning.solver import InfeasibleError
from tapered_megatron.resources import resource

TEMPLATE = resource("slurm_template")
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Candidate:
    """One layout and its prediction."""

    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch_size: int
    grad_accum: int
    recompute: str
    unit: str
    sequence_parallel: bool = False
    parts: tuple[int, ...] = ()
    mem_gib: float = 0.0  # the most loaded stage
    step_s: float = float("inf")
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    bottleneck: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    dp_comm: str = ""  # how the DP communication runs (cost.DPComm.how)
    reduce_bucket: int = 0  # ZeRO-1/2 reduce_bucket_size written to the DeepSpeed config
    schedule: str = "1f1b"  # parallel.schedule (search_schedules)
    virtual_stages: int = 1  # parallel.virtual_stages

    @property
    def label(self) -> str:
        """Short human-readable label."""
        sp = " sp" if self.sequence_parallel else ""
        sched = f" {self.schedule} v{self.virtual_stages}" if self.schedule != "1f1b" else ""
        return (
            f"tp{self.tp}{sp} pp{self.pp}{sched} dp{self.dp} zero{self.zero} "
            f"mbs{self.micro_batch_size} gas{self.grad_accum} rc-{self.recompute} {self.unit}"
        )


LAYOUT = re.compile(
    r"tp(?P<tp>\d+)(?P<sp> sp)? pp(?P<pp>\d+)"
    r"(?: (?P<schedule>interleaved|zbv|dualpipev|zero_bubble) v(?P<v>\d+))? "
    r"dp(?P<dp>\d+) zero(?P<zero>[0-3]) "
    r"mbs(?P<mbs>\d+) gas(?P<gas>\d+) rc-(?P<rc>none|selective|full) (?P<unit>layer|sublayer)"
)


def parse_layout(text: str) -> Candidate:
    """The candidate a :attr:`Candidate.label` names (the planner's table column), e.g.
    ``"tp2 sp pp1 dp32 zero3 mbs4 gas1 rc-none layer"`` or, with a pipeline schedule,
    ``"tp4 sp pp4 zero_bubble v2 dp32 zero1 mbs1 gas4 rc-none layer"``; ``ValueError`` naming
    the expected form otherwise."""
    m = LAYOUT.fullmatch(" ".join(text.split()))
    if m is None:
        raise ValueError(
            f"--layout {text!r} is not a layout; write it as the planner prints it, e.g. "
            '"tp2 sp pp1 dp32 zero3 mbs4 gas1 rc-none layer"'
        )
    g = {k: int(v) for k, v in m.groupdict().items() if v and v.isdigit()}
    c = Candidate(
        g["tp"], g["pp"], g["dp"], g["zero"], g["mbs"], g["gas"], m["rc"], m["unit"], bool(m["sp"])
    )
    return replace(c, schedule=m["schedule"], virtual_stages=g["v"]) if m["schedule"] else c


def layout_problem(cfg: Config, c: Candidate, gpus: int, gpus_per_node: int) -> str | None:
    """Why the layout ``c`` cannot run ``cfg`` on ``gpus`` GPUs (the rules the search enumerates
    by), or ``None``."""
    from tapered_megatron.models import resolve_architecture

    if c.tp * c.pp * c.dp != gpus:
        return f"tp{c.tp} x pp{c.pp} x dp{c.dp} = {c.tp * c.pp * c.dp} GPUs, not --gpus {gpus}"
    if min(c.tp, c.pp, c.dp, c.micro_batch_size, c.grad_accum) < 1:
        return "tp, pp, dp, mbs and gas must be at least 1"
    if c.tp > gpus_per_node:
        return f"tp{c.tp} spans nodes of {gpus_per_node} GPUs; use tp <= {gpus_per_node}"
    if tp_problem(cfg, c.tp):
        return tp_problem(cfg, c.tp)
    if c.pp > cfg.model.layers:
        return f"pp{c.pp} exceeds the model's {cfg.model.layers} layers"
    if c.pp > 1 and c.zero > 1:
        return f"DeepSpeed's pipeline engine runs ZeRO 0-1 only, not zero{c.zero}"
    if c.pp > 1 and resolve_architecture(cfg.model.arch).first_pass_config(cfg) is not None:
        return "this architecture's first pass of the whole model runs only with pp1"
    if c.sequence_parallel and (c.tp == 1 or cfg.model.seq_len % c.tp):
        return f"sequence parallelism needs tp > 1 dividing seq_len {cfg.model.seq_len}"
    if c.pp == 1 and c.unit != "layer":
        return "without a pipeline the unit is layer"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(
    cfg: Config, c: Candidate, dev: costlib.Device, cap: float, **run: Any
) -> Candidate | str:
    """Predict one candidate; returns the filled candidate or the reason it is rejected.

    The stages come from :func:`tapered_megatron.planning.balance.analyse`, the call the
    trainer's balancer makes, so a run launched with this candidate's overrides on the same
    device and memory cap gets these boundaries. ``run``: further keywords of that call
    (``zero3``, ``stand_in``: a published run of another code base, the calibration's).
    """
    m = cfg.model
    layout = dict(
        unit=c.unit,
        device=dev,
        dp=c.dp,
        zero_stage=c.zero,
        recompute=c.recompute,
        tp=c.tp,
        sequence_parallel=c.sequence_parallel,
        micro_batch_size=c.micro_batch_size,
        methods=("balancer",),
        **run,
    )
    elem = costlib.activation_scale(dev.precision)
    try:
        bal = analyse(cfg, c.pp, c.grad_accum, gpu_mem=cap / costlib.GiB, **layout)
    except InfeasibleError:
        bal = analyse(cfg, c.pp, c.grad_accum, gpu_mem=float("inf"), **layout)
    r, costs = bal.methods["balancer"], bal.costs
    # ZeRO-1/2 without pipeline: overlap_comm's two reduce buckets (a fixed size per rank; one
    # stage, so adding them cannot change the partition)
    stage_param = max(r.stage_params) / c.tp  # TP-local parameters of the heaviest stage
    buckets = costlib.overlap_bucket_bytes(stage_param, elem, c.zero) if c.pp == 1 else 0.0
    worst = max(r.stage_mem) + buckets
    if worst > cap:
        return f"out of memory: needs {worst / costlib.GiB:.1f} GiB on its worst stage"
    act_bytes = c.micro_batch_size * m.seq_len * m.d_model * elem  # one residual-stream tensor
    # Pipeline sends: neighbouring stages are dp*tp ranks apart (topology axes pipe, data, model).
    pp_bw = dev.intra_bw if c.dp * c.tp < dev.gpus_per_node else dev.inter_bw
    # 1/tp each: DeepSpeed's pipe_partitioned, or the sequence shards under sequence parallelism
    p2p = costlib.p2p_time(act_bytes / c.tp, pp_bw, dev) if c.pp > 1 else 0.0
    # DeepSpeed's 1F1B engine: per micro-batch and stage a forward and a backward action, each
    # with its send and the runtime's own cost per action (as the schedule replay charges them)
    action = dev.schedule_overhead.get("1f1b", 0.0) if c.pp > 1 else 0.0
    stage_times = [t + (2 * (p2p + action) if c.pp > 1 else 0.0) for t in r.stage_times]
    pipe_s = costlib.step_time(stage_times, c.grad_accum)
    # Data parallel: gradients of the heaviest stage (bf16 grads / fp32) over dp, overlapped
    # with backward where DeepSpeed overlaps them (cost.dp_comm)
    dp_bw = costlib.dp_bandwidth(dev, c.tp, c.dp)
    compute = max(r.stage_times)  # one micro-batch on the slowest stage
    passes = 4 if c.recompute == "full" else 3
    dp = costlib.dp_comm(
        stage_param, c.dp, c.zero, c.grad_accum, c.pp > 1, elem, dp_bw,
        compute * (passes - 1) / passes, compute, bf16_optimizer=dev.precision == "bf16",
    )  # fmt: skip
    bpp = costlib.bytes_per_param(dev.precision, c.zero, c.dp, c.pp > 1)
    opt_s = costlib.optimizer_time(stage_param, bpp, dev)
    tax = dev.overlap_tax * dp.overlapped  # compute slowed by the communication it hides
    step = pipe_s + dp.exposed + tax + opt_s
    gpus = c.tp * c.pp * c.dp
    tokens = c.micro_batch_size * c.grad_accum * c.dp * m.seq_len
    model_flops = 3 * sum(u.flops_fwd for u in costs) * tokens
    ideal = sum(r.stage_times) * c.grad_accum / c.pp
    return replace(
        c,
        parts=r.parts,
        mem_gib=worst / costlib.GiB,
        step_s=step,
        mfu=model_flops / (step * gpus * dev.peak_flops),
        tokens_per_s=tokens / step,
        bottleneck=r.bottleneck,
        breakdown={
            "compute_ideal_s": ideal,
            "pipeline_s": pipe_s,
            "bubble_and_imbalance_s": pipe_s - ideal,
            "tp_comm_s": sum(u.tp_comm for u in costs) * c.grad_accum / c.pp,
            "p2p_s": 2 * p2p * c.grad_accum,
            "dp_comm_s": dp.total,
            "dp_overlapped_s": dp.overlapped,
            "overlap_tax_s": tax,
            "optimizer_s": opt_s,
        },
        dp_comm=dp.how,
        reduce_bucket=costlib.reduce_bucket_elems(stage_param) if c.zero in (1, 2) else 0,
    )


def enumerate_candidates(cfg: Config, gpus: int, gpus_per_node: int) -> list[Candidate]:
    """Every layout / ZeRO / micro-batch / recompute / unit combination to evaluate."""
    from tapered_megatron.architectures import resolve_architecture
    from tapered_megatron.models import blocks

    m, tr = cfg.model, cfg.train
    gbs = tr.global_batch_size or tr.micro_batch_size * gpus
    arch = resolve_architecture(m.arch)
    # without SP: the same time and more memory, unless a half runs on the whole sequence
    parts = blocks(arch)
    sp_off_too = not (parts.mixer.takes_sequence_shards and parts.mlp.takes_sequence_shards)
    # a first pass of the whole model (Hope's teach signal) runs only without a pipeline
    whole_model_pass = arch.first_pass_config(cfg) is not None
    out = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node or tp_problem(cfg, tp):
            continue
        for pp in _divisors(gpus // tp):
            if pp > m.layers or (pp > 1 and whole_model_pass):
                continue
            dp = gpus // (tp * pp)
            sps = (False,)
            if tp > 1 and m.seq_len % tp == 0:
                sps = (False, True) if sp_off_too else (True,)
            for zero in (0, 1) if pp > 1 else (0, 1, 2, 3):
                for mbs in MICRO_BATCHES:
                    if gbs % (mbs * dp):
                        continue
                    gas = gbs // (mbs * dp)
                    for rc in ("none", "selective", "full"):
                        for unit in ("layer", "sublayer") if pp > 1 else ("layer",):
                            for sp in sps:
                                out.append(Candidate(tp, pp, dp, zero, mbs, gas, rc, unit, sp))
    return out


def plan(
    cfg: Config, gpus: int, dev: costlib.Device, cap: float
) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """Evaluate all candidates: (fitting ones ranked best first, rejected ones with reasons)."""
    ok, rejected = [], []
    for c in enumerate_candidates(cfg, gpus, dev.gpus_per_node):
        r = evaluate(cfg, c, dev, cap)
        if isinstance(r, str):
            rejected.append((c, r))
        else:
            ok.append(r)
    ok.sort(key=lambda c: (c.step_s, c.mem_gib))
    return ok, rejected


# ------------------------------------------------------------------ pipeline schedules
#: (schedule, virtual stages) the planner tries on its best pipeline layouts, beside 1F1B.
SCHEDULE_OPTIONS = (
    ("1f1b", 1),
    ("interleaved", 2),
    ("interleaved", 4),
    ("zbv", 2),
    ("dualpipev", 2),
    ("zero_bubble", 2),
)


#: How a virtual-stage schedule's DP communication runs (``Candidate.dp_comm``).
VIRTUAL_DP_COMM = "not overlapped (the virtual-stage runtime reduces after its schedule)"


def with_schedule(
    cfg: Config, c: Candidate, dev: costlib.Device, cap: float, schedule: str, v: int
) -> Candidate | str:
    """The evaluated 1F1B candidate ``c`` under ``schedule`` with ``v`` chunks per rank, or why
    it cannot run or fit. Its pipeline time is the replayed makespan of the schedule's own
    order with pipeline sends (``1f1b``: ``c``'s stages; otherwise the virtual-stage
    balancer's cut), its memory the worst rank's with the schedule's activations in flight;
    the rest of ``c``'s step (DP communication, optimizer) stays: the virtual-stage runtime
    reduces the gradients after its schedule as DeepSpeed's 1F1B engine does
    (:meth:`~tapered_megatron.parallel.schedules.VirtualPipeline.reduce_gradients`), so the
    DP communication stays exposed."""
    from tapered_megatron.planning.balance import chunk_setup
    from tapered_megatron.planning.chunks import balance_chunks, evaluate_chunks
    from tapered_megatron.planning.schedule import SPLIT_BACKWARD

    if c.recompute != "none" and schedule in SPLIT_BACKWARD:
        return f"{schedule} with recompute {c.recompute}: not supported"
    try:
        setup = chunk_setup(
            cfg, c.pp, v, schedule, c.grad_accum, p2p=c.breakdown["p2p_s"] / (2 * c.grad_accum),
            unit=c.unit, device=dev, gpu_mem=cap / costlib.GiB, dp=c.dp, zero_stage=c.zero,
            recompute=c.recompute, tp=c.tp, sequence_parallel=c.sequence_parallel,
            micro_batch_size=c.micro_batch_size,
        )  # fmt: skip
        best = (
            evaluate_chunks(setup, c.parts, "1f1b")
            if schedule == "1f1b"
            else balance_chunks(setup)["balancer"]
        )
    except (ValueError, InfeasibleError) as e:
        return str(e)
    if not best.fits:
        return f"out of memory: needs {max(best.rank_mem) / costlib.GiB:.1f} GiB on its worst rank"
    pipe_s = best.sim.makespan
    step = c.step_s - c.breakdown["pipeline_s"] + pipe_s
    return replace(
        c,
        schedule=schedule,
        virtual_stages=v,
        parts=best.parts,
        mem_gib=max(best.rank_mem) / costlib.GiB,
        step_s=step,
        mfu=c.mfu * c.step_s / step,
        tokens_per_s=c.tokens_per_s * c.step_s / step,
        breakdown={
            **c.breakdown,
            "pipeline_s": pipe_s,
            "bubble_and_imbalance_s": pipe_s - c.breakdown["compute_ideal_s"],
        },
        dp_comm=c.dp_comm if schedule == "1f1b" or c.dp == 1 else VIRTUAL_DP_COMM,
    )


def search_schedules(
    cfg: Config, ranked: list[Candidate], dev: costlib.Device, cap: float, top: int = 3
) -> list[Candidate]:
    """``ranked`` with its ``top`` best pipeline layouts replaced by their replays under every
    schedule of :data:`SCHEDULE_OPTIONS` that runs and fits, ranked best first."""
    base = [c for c in ranked if c.pp > 1][:top]
    replays = []
    for c in base:
        for schedule, v in SCHEDULE_OPTIONS:
            r = with_schedule(cfg, c, dev, cap, schedule, v)
            if not isinstance(r, str):
                replays.append(r)
    rest = [c for c in ranked if not any(c is b for b in base)]
    return sorted([*replays, *rest], key=lambda c: (c.step_s, c.mem_gib))


def cluster_lines(
    cfg: Config,
    dev: costlib.Device,
    gpus: int,
    nodes: int,
    cap_gib: float,
    meta_params: int,
    counted: int,
    mem_fraction: float = 1.0,
) -> list[str]:
    """The model and cluster a plan is for (the first lines of :func:`reasoning`)."""
    return [
        f"model {cfg.name}: {counted / 1e9:.2f}B parameters by the counters"
        + f", {meta_params / 1e9:.2f}B built on the meta device",
        f"cluster: {gpus} x {dev.name} ({cap_gib:.0f} GiB, {mem_fraction:.0%} usable, "
        f"{dev.peak_flops / 1e12:.0f} TFLOP/s "
        f"{dev.precision}), {nodes} node(s) of {dev.gpus_per_node}; NVLink "
        f"{dev.intra_bw / 1e9:.0f} GB/s, network {dev.inter_bw / 1e9:.0f} GB/s per GPU",
    ]


def pick_lines(best: Candidate, what: str = "best") -> list[str]:
    """The account of one evaluated layout: its step, throughput, MFU and memory (predicted),
    where the time goes, the DP communication and the pipeline partition."""
    b = best.breakdown
    lines = [
        f"{what}: {best.label}: predicted step {best.step_s:.2f} s, "
        f"{best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%}, "
        f"worst stage {best.mem_gib:.1f} GiB",
        "  time: " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in b.items() if k != "pipeline_s"),
        f"  DP communication {b['dp_comm_s']:.2f}s, {b['dp_overlapped_s']:.2f}s of it hidden: "
        f"{best.dp_comm}",
    ]
    if best.pp > 1:
        lines.append(f"  partition {list(best.parts)} bottleneck {best.bottleneck:.3f}")
    return lines


def exposed_parts(c: Candidate) -> dict[str, float]:
    """Where a candidate's predicted step goes, in parts that add up to it (seconds)."""
    b = c.breakdown
    return {
        "compute and TP communication": b["compute_ideal_s"],
        "bubble and imbalance": b["bubble_and_imbalance_s"],
        "pipeline sends": b["p2p_s"],
        "exposed DP communication": b["dp_comm_s"] - b["dp_overlapped_s"],
        "overlap tax": b["overlap_tax_s"],
        "optimizer": b["optimizer_s"],
    }


def pipeline_loss(best: Candidate, piped: list[Candidate]) -> list[str]:
    """What the fastest pipeline layout (``piped``: it, or nothing) loses to ``best``, a layout
    without a pipeline: the difference of each part of the predicted step, largest first
    (DeepSpeed's pipeline engine runs ZeRO 0-1 only and reduces gradients after its schedule,
    so its DP communication is exposed)."""
    if not piped:
        return []
    pp, ours = exposed_parts(piped[0]), exposed_parts(best)
    diff = sorted(((pp[k] - ours[k], k) for k in pp), reverse=True)
    parts = ", ".join(f"{k} {d:+.2f}s" for d, k in diff if abs(d) >= 0.005)
    return [
        f"  best pipeline layout {piped[0].label} is {piped[0].step_s / best.step_s - 1:+.1%} "
        f"slower (predicted): {parts} (ZeRO-{piped[0].zero}: the pipeline engine runs ZeRO 0-1)"
    ]


def reasoning(ranked: list[Candidate], rejected: list[tuple[Candidate, str]]) -> list[str]:
    """Plain-language account of the choice (printed after :func:`cluster_lines`, and returned
    in --json)."""
    lines = [
        f"{len(ranked) + len(rejected)} candidates, {len(ranked)} fit in memory, "
        f"{len(rejected)} rejected"
    ]
    if not ranked:
        lines.append("nothing fits: add GPUs, enable ZeRO-3/offload, or shorten the sequence")
        return lines
    best = ranked[0]
    lines += pick_lines(best)
    no_pp = [c for c in ranked if c.pp == 1]
    if best.pp > 1:
        if not no_pp:
            lines.append("  pipeline needed: no PP=1 layout fits the memory cap")
        else:
            lines.append(
                f"  PP={best.pp} beats the best PP=1 layout ({no_pp[0].label}, "
                f"{no_pp[0].step_s:.2f} s)"
            )
    else:
        lines += pipeline_loss(best, [c for c in ranked if c.pp > 1][:1])
    for key, what in (
        ("tp", "TP"),
        ("sequence_parallel", "sequence parallelism"),
        ("zero", "ZeRO"),
        ("recompute", "recompute"),
        ("unit", "pipeline unit"),
    ):
        alt = [c for c in ranked if getattr(c, key) != getattr(best, key)]
        if alt:
            lines.append(
                f"  vs other {what}: best alternative {alt[0].label} is "
                f"{alt[0].step_s / best.step_s - 1:+.1%} slower"
            )
    reasons: dict[str, int] = {}
    for _, why in rejected:
        reasons[why.split(":")[0]] = reasons.get(why.split(":")[0], 0) + 1
    for why, n in reasons.items():
        lines.append(f"  rejected {n}: {why}")
    return lines


def ds_config(cfg: Config, best: Candidate, dev: costlib.Device) -> dict[str, Any]:
    """A DeepSpeed JSON for the best candidate (batch keys match train.*)."""
    out: dict[str, Any] = {
        "train_batch_size": best.micro_batch_size * best.grad_accum * best.dp,
        "train_micro_batch_size_per_gpu": best.micro_batch_size,
        "gradient_accumulation_steps": best.grad_accum,
        "gradient_clipping": cfg.train.clip_grad,
        "bf16": {"enabled": dev.precision == "bf16"},
        "zero_optimization": {"stage": best.zero},
        "steps_per_print": 1000000000,
        "wall_clock_breakdown": False,
    }
    if best.zero >= 3:
        # the buffer sizes the memory model counted (cost.zero3_stage_bytes)
        out["zero_optimization"].update(costlib.Zero3().ds_keys())
    if best.pp == 1 and best.zero >= 1:
        # the gradient reduce overlaps backward (cost.dp_comm); ZeRO-1/2's two reduce buckets
        # of this size are in the memory prediction
        z = out["zero_optimization"]
        z.update(overlap_comm=True, contiguous_gradients=True)
        if best.zero in (1, 2):
            z.update(
                reduce_scatter=True,
                reduce_bucket_size=best.reduce_bucket,
                allgather_bucket_size=best.reduce_bucket,
            )
    if dev.precision == "bf16" and best.zero >= 1:
        # micro-batches accumulate in fp32; DeepSpeed refuses fp32 accumulation with bf16
        # under ZeRO-0 (pipeline or not), which accumulates in bf16
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    if best.pp > 1:
        # BF16_Optimizer under the pipeline engine adds each micro-batch's cumulative 16-bit
        # gradient to its fp32 buffer again (gradients counted several times) unless it moves
        # them there in the backward hooks
        out["bf16"]["immediate_grad_update"] = True
        # recomputation is done by the model's own units (--train.recompute)
        out["pipeline"] = {
            "stages": best.pp,
            "activation_checkpoint_interval": 0,
            # sequence shards are already split over the TP group
            "pipe_partitioned": best.tp > 1 and not best.sequence_parallel,
            "grad_partitioned": best.tp > 1 and not best.sequence_parallel,
        }
    return out


def overrides(cfg: Config, best: Candidate) -> list[str]:
    """The dotted config overrides that select the best candidate."""
    return [
        "--parallel.tp", str(best.tp),
        "--parallel.sequence_parallel", str(best.sequence_parallel).lower(),
        "--parallel.pp", str(best.pp),
        "--parallel.partition", "balanced",
        "--parallel.pipeline_unit", best.unit,
        "--train.recompute", best.recompute,
        "--train.micro_batch_size", str(best.micro_batch_size),
        "--train.global_batch_size", str(best.micro_batch_size * best.grad_accum * best.dp),
        *schedule_overrides(best),
    ]  # fmt: skip


def schedule_overrides(best: Candidate) -> list[str]:
    """``--parallel.schedule`` / ``--parallel.virtual_stages`` of a schedule other than 1F1B."""
    if best.schedule == "1f1b":
        return []
    return [
        "--parallel.schedule",
        best.schedule,
        "--parallel.virtual_stages",
        str(best.virtual_stages),
    ]


def fill_slurm(
    cfg_name: str,
    best: Candidate,
    nodes: int,
    gpus_per_node: int,
    ds_path: str,
    template: Path = TEMPLATE,
) -> str:
    """The SLURM template with the best candidate's values substituted."""
    text = template.read_text()
    values = {
        "JOB_NAME": f"tm-{cfg_name}",
        "NODES": str(nodes),
        "GPUS_PER_NODE": str(gpus_per_node),
        "CONFIG": cfg_name,
        "DS_CONFIG": ds_path,
        "OVERRIDES": " ".join(overrides(None, best)),
        "PLAN": best.label,
    }
    for k, v in values.items():
        text = text.replace("{{" + k + "}}", v)
    return text


def evaluate_layout(
    cfg: Config, layout: str, gpus: int, dev: costlib.Device, cap: float
) -> Candidate | str:
    """Predict the layout a :attr:`Candidate.label` string names (``--layout``): the filled
    candidate, or why it cannot run (not a layout, a rule it breaks, out of memory under
    ``cap`` bytes)."""
    try:
        c = parse_layout(layout)
    except ValueError as e:
        return str(e)
    problem = layout_problem(cfg, c, gpus, dev.gpus_per_node)
    if problem:
        return f"layout {c.label}: {problem}"
    one = evaluate(cfg, replace(c, schedule="1f1b", virtual_stages=1), dev, cap)
    if isinstance(one, str) or c.schedule == "1f1b":
        return one
    return with_schedule(cfg, one, dev, cap, c.schedule, c.virtual_stages)


def _table(cands: list[Candidate]) -> list[str]:
    """The printed table of candidates (predicted figures)."""
    lines = [
        f"{'rank':>4} {'layout':<48} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'mem GiB':>8} "
        f"{'bneck':>6}   (predicted)"
    ]
    for i, c in enumerate(cands):
        lines.append(
            f"{i + 1:>4} {c.label:<48} {c.step_s:>8.3f} {c.tokens_per_s:>10,.0f} {c.mfu:>6.1%} "
            f"{c.mem_gib:>8.1f} {c.bottleneck:>6.3f}"
        )
    return lines


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.plan", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", help="preset name or YAML path (a model by its dimensions too)")
    ap.add_argument("--gpus", type=int, help="total GPUs")
    ap.add_argument("--gpu-mem", type=float, help="memory per GPU, GiB")
    ap.add_argument("--nodes", type=int, default=None, help="nodes (default gpus / 8)")
    ap.add_argument("--device", default="h100", help=f"one of {', '.join(costlib.DEVICES)}")
    ap.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default=None,
        help="default: the device's (the GPU presets' peaks are bf16: give fp32 its --peak-tflops)",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense peak per GPU")
    ap.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per GPU")
    ap.add_argument("--network-gbps", type=float, default=None, help="network GB/s per GPU")
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=0.9,
        help="usable share of --gpu-mem (allocator fragmentation headroom)",
    )
    ap.add_argument(
        "--layout",
        default=None,
        help='evaluate this one layout, as the table prints it ("tp2 sp pp1 dp32 zero3 mbs4 '
        'gas1 rc-none layer"), instead of searching',
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="predict the published runs of the calibration set and score the predictions",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="with --calibrate: fit the cost model's constants on the fitting runs, print them",
    )
    ap.add_argument("--top", type=int, default=10, help="candidates to list")
    ap.add_argument(
        "--schedules", action="store_true",
        help="also try the pipeline schedules (interleaved, zbv, dualpipev, zero_bubble) on the "
        "best pipeline layouts and pick among them (replayed schedules, slower)",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument("--write-ds-config", default=None, help="write the best DeepSpeed JSON here")
    ap.add_argument("--write-slurm", default=None, help="write the filled SLURM script here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring)."""
    from tapered_megatron.config import load_config_or_exit
    from tapered_megatron.models.counters import count_model
    from tapered_megatron.models.language_model import meta_param_count

    ap = arguments()
    a, rest = ap.parse_known_args(argv)
    if a.calibrate or a.fit:
        print("error: --calibrate runs from python -m tapered_megatron.plan", file=sys.stderr)
        return 2
    missing = [
        f"--{k.replace('_', '-')}" for k in ("config", "gpus", "gpu_mem") if not getattr(a, k)
    ]
    if missing:
        print(f"error: {', '.join(missing)} required (or --calibrate)", file=sys.stderr)
        return 2
    cfg = load_config_or_exit(a.config, rest)
    nodes = a.nodes or max(1, a.gpus // 8)
    if a.gpus % nodes:
        print(f"error: --gpus {a.gpus} is not a multiple of --nodes {nodes}", file=sys.stderr)
        return 2
    try:
        dev = costlib.get_device(
            a.device,
            precision=a.precision,
            peak_flops=a.peak_tflops * 1e12 if a.peak_tflops else None,
            intra_bw=a.nvlink_gbps * 1e9 if a.nvlink_gbps else None,
            inter_bw=a.network_gbps * 1e9 if a.network_gbps else None,
            mem_bytes=a.gpu_mem * costlib.GiB,
            gpus_per_node=a.gpus // nodes,
        )
    except ValueError as e:
        print(f"error: --device: {e}", file=sys.stderr)
        return 2
    cap = a.mem_fraction * a.gpu_mem * costlib.GiB
    head = cluster_lines(
        cfg, dev, a.gpus, nodes, a.gpu_mem, meta_param_count(cfg), count_model(cfg).params_total,
        a.mem_fraction,
    )  # fmt: skip
    if a.layout is not None:
        one = evaluate_layout(cfg, a.layout, a.gpus, dev, cap)
        if isinstance(one, str):
            print(f"error: {one}", file=sys.stderr)
            return 1 if one.startswith("out of memory") else 2
        ranked, rejected, why = [one], [], [*head, *pick_lines(one, "layout")]
    else:
        ranked, rejected = plan(cfg, a.gpus, dev, cap)
        if a.schedules:
            ranked = search_schedules(cfg, ranked, dev, cap)
        why = head + reasoning(ranked, rejected)
    if ranked and a.write_ds_config:
        Path(a.write_ds_config).write_text(
            json.dumps(ds_config(cfg, ranked[0], dev), indent=2) + "\n"
        )
    if ranked and a.write_slurm:
        Path(a.write_slurm).write_text(
            fill_slurm(
                a.config,
                ranked[0],
                nodes,
                a.gpus // nodes,
                a.write_ds_config or "ds_configs/zero1.json",
            )
        )
    picks = [c for c in ranked if c.pp > 1][: a.top]
    if a.json:
        print(
            json.dumps(
                {
                    "config": cfg.name,
                    "gpus": a.gpus,
                    "nodes": nodes,
                    "device": dev.name,
                    "best": asdict(ranked[0]) if ranked else None,
                    "candidates": [asdict(c) for c in ranked[: a.top]],
                    "rejected": len(rejected),
                    "reasoning": why,
                    "pipeline": [asdict(c) for c in picks],
                }
            )
        )
        return 0 if ranked else 1
    print("\n".join(why))
    print()
    print("\n".join(_table(ranked[: a.top])))
    if a.schedules:
        print("\nbest pipeline layouts and schedules (predicted, schedules replayed):")
        for c in picks:
            print(f"     {c.label:<58} step {c.step_s:>8.3f} s  {c.mem_gib:>6.1f} GiB")
    return 0 if ranked else 1


if __name__ == "__main__":
    sys.exit(main())
