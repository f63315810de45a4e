"""Pipeline partitioning for heterogeneous-width models: our exact balancer and the baselines.

``partition(cfg, pp, method=..., micro_batches=...)`` returns stage boundaries in DeepSpeed's
``parts`` format (``parts[j]:parts[j+1]`` are the layer-spec indices of stage ``j``), for the
layer specs of :func:`tapered_megatron.models.pipeline_layer_specs` (``unit="layer"`` or
``"sublayer"``). Methods:

* ``balancer`` (alias ``balanced``): the exact min-max partition of :mod:`.solver` over the unit
  costs of :mod:`.cost`, under the per-stage 1F1B memory cap.
* ``uniform``: DeepSpeed's ``partition_method="uniform"`` -- ``deepspeed.runtime.utils.
  partition_uniform`` over the number of specs (every spec counts one, embedding and head
  included; the remainder goes to the first stages).
* ``parameters``: DeepSpeed's ``partition_method="parameters"`` -- ``partition_balanced`` over the
  per-spec trainable-parameter counts (DeepSpeed's DP minimises the spread max - min of the
  stage sums, not the maximum; reproduced by calling DeepSpeed's own function).
* ``megatron``: Megatron-LM's equal layer counts with ``--account-for-embedding-in-pipeline-split``
  and ``--account-for-loss-in-pipeline-split``: the embedding and the head + loss each count as one
  layer, blocks are never cut (a sub-layer pair stays together). Megatron requires ``(L + 2) % P ==
  0``; otherwise the counts are as equal as possible with the extra layers on the first stages
  (DeepSpeed's ``partition_uniform`` rule), since Megatron leaves uneven splits to the user.

CLI::

    python -m tapered_megatron.pipeline.balance --config transformer_1.3b --pp 8 [--micro-batches M]
        [--gpu-mem GiB] [--unit layer|sublayer] [--device h100] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.chunks import ChunkPlan, ChunkSetup, balance_chunks, chunk_table
from tapered_megatron.planning.schedule import SCHEDULES, schedule_problem
from tapered_megatron.planning.solver import InfeasibleError, Problem, bottleneck_ratio, solve

if TYPE_CHECKING:
    from tapered_megatron.config import Config

METHODS = ("balancer", "uniform", "parameters", "megatron")
ALIASES = {"balanced": "balancer"}


@dataclass(frozen=True)
class MethodResult:
    """One partition and what the cost model predicts for it."""

    method: str
    parts: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_mem: tuple[float, ...]
    stage_params: tuple[int, ...]
    bottleneck: float  # slowest stage / mean stage
    step_time: float  # 1F1B step time of the partition
    fits: bool  # every stage within the memory cap

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "parts": list(self.parts),
            "stage_times": list(self.stage_times),
            "stage_mem": list(self.stage_mem),
            "stage_params": list(self.stage_params),
            "bottleneck": self.bottleneck,
            "step_time": self.step_time,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Balance:
    """Unit costs of one configuration and the partition of every method."""

    costs: tuple[costlib.UnitCost, ...]
    pp: int
    micro_batches: int
    cap: float
    overhead: float
    methods: dict[str, MethodResult]

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: ``methods`` and ``layer_costs`` (+ unit names and memory)."""
        return {
            "pp": self.pp,
            "micro_batches": self.micro_batches,
            "gpu_mem": self.cap,
            "units": [c.name for c in self.costs],
            "layer_costs": [c.time for c in self.costs],
            "layer_params": [c.params for c in self.costs],
            "methods": {k: v.to_dict() for k, v in self.methods.items()},
        }

    def table(self, method: str) -> str:
        """Per-stage table of one method (printed at start-up and by the CLI)."""
        r = self.methods[method]
        total = sum(r.stage_times)
        lines = [
            f"pipeline partition [{method}] pp={self.pp} micro_batches={self.micro_batches} "
            f"bottleneck={r.bottleneck:.3f} (slowest/mean) step={r.step_time * 1e3:.1f} ms",
            f"{'stage':>5} {'units':>9} {'first..last':<28} {'params':>10} {'time ms':>9} "
            f"{'share':>6} {'mem GiB':>8}",
        ]
        for j in range(self.pp):
            lo, hi = r.parts[j], r.parts[j + 1]
            names = f"{self.costs[lo].name}..{self.costs[hi - 1].name}" if hi > lo else "-"
            lines.append(
                f"{j:>5} {f'{lo}:{hi}':>9} {names:<28} {r.stage_params[j] / 1e6:>9.1f}M "
                f"{r.stage_times[j] * 1e3:>9.2f} {r.stage_times[j] / total:>6.1%} "
                f"{r.stage_mem[j] / costlib.GiB:>8.2f}"
            )
        return "\n".join(lines)


def baseline_parts(method: str, costs: Sequence[costlib.UnitCost], pp: int) -> list[int]:
    """Boundaries of a baseline method, computed the way DeepSpeed / Megatron-LM compute them."""
    from deepspeed.runtime import utils as ds_utils

    n = len(costs)
    if method == "uniform":
        return [int(x) for x in ds_utils.partition_uniform(num_items=n, num_parts=pp)]
    if method == "parameters":
        return [int(x) for x in ds_utils.partition_balanced([c.params for c in costs], pp)]
    if method == "megatron":
        groups: list[int] = []  # first unit index of each Megatron "layer" (a block's halves
        for i, c in enumerate(costs):  # share one; the embedding and the head are one each)
            if i == 0 or c.layer is None or c.layer != costs[i - 1].layer:
                groups.append(i)
        bounds = ds_utils.partition_uniform(num_items=len(groups), num_parts=pp)
        return [groups[b] if b < len(groups) else n for b in bounds]
    raise ValueError(f"unknown method {method!r}; use one of {METHODS}")


def problem_for(
    costs: Sequence[costlib.UnitCost], pp: int, micro_batches: int, cap: float, overhead: float
) -> Problem:
    """The solver instance of a configuration."""
    return Problem.make(
        [c.time for c in costs],
        pp,
        static=[c.static for c in costs],
        act=[c.act for c in costs],
        peak=[c.peak for c in costs],
        inflight=costlib.inflight(pp, micro_batches),
        fixed=[overhead] * pp,
        cap=cap,
        after=[c.after for c in costs],
        after_cap=costlib.AFTER_CAP,
    )


def evaluate(
    method: str,
    parts: Sequence[int],
    costs: Sequence[costlib.UnitCost],
    micro_batches: int,
    cap: float,
    overhead: float,
) -> MethodResult:
    """Predicted per-stage time, memory and parameters of ``parts``."""
    times = [c.time for c in costs]
    pp = len(parts) - 1
    st = [sum(times[parts[j] : parts[j + 1]]) for j in range(pp)]
    mem = costlib.stage_memory(costs, parts, micro_batches, overhead)
    return MethodResult(
        method=method,
        parts=tuple(int(x) for x in parts),
        stage_times=tuple(st),
        stage_mem=tuple(mem),
        stage_params=tuple(
            sum(c.params for c in costs[parts[j] : parts[j + 1]]) for j in range(pp)
        ),
        bottleneck=bottleneck_ratio(times, parts),
        step_time=costlib.step_time(st, micro_batches),
        fits=all(m <= cap * (1 + 1e-9) for m in mem),
    )


def balance_costs(
    costs: Sequence[costlib.UnitCost],
    pp: int,
    micro_batches: int,
    cap: float = float("inf"),
    overhead: float = 0.0,
    methods: Sequence[str] = METHODS,
) -> Balance:
    """Partition ``costs`` with every requested method and evaluate each."""
    out: dict[str, MethodResult] = {}
    for m in methods:
        m = ALIASES.get(m, m)
        if m == "balancer":
            parts = solve(problem_for(costs, pp, micro_batches, cap, overhead))
        else:
            parts = baseline_parts(m, costs, pp)
        out[m] = evaluate(m, parts, costs, micro_batches, cap, overhead)
    return Balance(tuple(costs), pp, micro_batches, cap, overhead, out)


def default_micro_batches(cfg: Config, pp: int, dp: int = 1) -> int:
    """Micro-batches per step implied by ``train.global_batch_size`` (1 when it is 0)."""
    tr = cfg.train
    if tr.global_batch_size:
        return max(1, tr.global_batch_size // (tr.micro_batch_size * dp))
    return 1


def analyse(
    cfg: Config,
    pp: int,
    micro_batches: int | None = None,
    *,
    methods: Sequence[str] = METHODS,
    **kwargs: Any,
) -> Balance:
    """Unit costs of ``cfg`` and the partitions of ``methods`` at pipeline size ``pp``.

    The trainer (through :class:`~tapered_megatron.parallel.pipeline.BalancedPipelineModule`) and
    the planner both call this, so they choose the same stages for the same run. Keyword
    arguments are :func:`unit_setup`'s.
    """
    costs, m, cap, fixed = unit_setup(cfg, pp, micro_batches, **kwargs)
    return balance_costs(costs, pp, m, cap, fixed, methods)


def chunk_setup(
    cfg: Config,
    pp: int,
    v: int,
    schedule: str,
    micro_batches: int | None = None,
    *,
    p2p: float = 0.0,
    **kwargs: Any,
) -> ChunkSetup:
    """The unit costs of ``cfg`` and what a ``pp x v`` cut for ``schedule`` is scored against
    (the device's per-action cost of the schedule's runtime, ``Device.schedule_overhead``, and
    its split backward's cost, ``Device.split_backward``, included); keyword arguments are
    :func:`unit_setup`'s. Raises ``ValueError`` for a schedule that cannot run the layout."""
    dev = kwargs.pop("device", "auto")
    dev = dev if isinstance(dev, costlib.Device) else costlib.resolve_device(dev)
    costs, m, cap, fixed = unit_setup(cfg, pp, micro_batches, device=dev, **kwargs)
    problem = schedule_problem(schedule, pp, v, m)
    if problem:
        raise ValueError(problem)
    full = (kwargs.get("recompute") or cfg.train.recompute) == "full"
    passes, action = 4 if full else 3, dev.schedule_overhead.get(schedule, 0.0)
    return ChunkSetup(
        tuple(costs), schedule, pp, v, m, cap, fixed, passes, p2p, action, dev.split_backward
    )


def analyse_chunks(
    cfg: Config, pp: int, v: int, schedule: str, micro_batches: int | None = None, **kwargs: Any
) -> tuple[ChunkSetup, dict[str, ChunkPlan]]:
    """:func:`chunk_setup` and the cut of every method of
    :data:`~tapered_megatron.planning.chunks.CHUNK_METHODS`."""
    setup = chunk_setup(cfg, pp, v, schedule, micro_batches, **kwargs)
    return setup, balance_chunks(setup)


def unit_setup(
    cfg: Config,
    pp: int,
    micro_batches: int | None = None,
    *,
    unit: str | None = None,
    device: str | costlib.Device = "auto",
    gpu_mem: float | None = None,
    dp: int = 1,
    zero_stage: int = 1,
    recompute: str | None = None,
    tp: int | None = None,
    sequence_parallel: bool | None = None,
    micro_batch_size: int | None = None,
    profiled: bool = False,
    zero3: costlib.Zero3 | costlib.Fsdp | None = None,
    stand_in: costlib.StandIn | None = None,
) -> tuple[list[costlib.UnitCost], int, float, float]:
    """Unit costs, micro-batches, per-device cap and fixed bytes of ``cfg`` at pipeline size
    ``pp``. ``gpu_mem`` is the per-device cap in GiB (default: the device's memory);
    ``recompute`` (``none``, ``selective``, ``full``), ``tp``, ``sequence_parallel`` and
    ``micro_batch_size`` default to the config's; ``profiled`` uses per-unit times measured on
    this machine (cached) instead of the analytic FLOP model. Under ZeRO-3 (``zero_stage`` 3,
    ``pp`` 1) ``zero3`` holds DeepSpeed's buffer sizes (default: ``ds_configs/zero3.json``'s),
    or PyTorch FSDP's in its place, and the fixed bytes add
    :func:`~tapered_megatron.planning.cost.zero3_stage_bytes`; under a pipeline every stage adds
    the engine's buffers
    (:func:`~tapered_megatron.planning.cost.pipeline_buffer_bytes`); a single bf16 ZeRO-1 stage
    (DeepSpeed's ``BF16_Optimizer``) holds the larger of its activations and its gradient
    reduce's flat copies (:func:`~tapered_megatron.planning.cost.fallback_reduce_bytes`).
    ``stand_in``: how a published run's model differs from ``cfg``'s
    (:class:`~tapered_megatron.planning.cost.StandIn`)."""
    dev = device if isinstance(device, costlib.Device) else costlib.resolve_device(device)
    m = micro_batches if micro_batches is not None else default_micro_batches(cfg, pp, dp)
    shape = costlib.RunShape(
        micro_batch_size=micro_batch_size or cfg.train.micro_batch_size,
        seq_len=cfg.model.seq_len,
        micro_batches=m,
        tp=tp or cfg.parallel.tp,
        dp=dp,
        zero_stage=zero_stage,
        precision=dev.precision,
        recompute=recompute or cfg.train.recompute,
        sequence_parallel=(
            cfg.parallel.sequence_parallel if sequence_parallel is None else sequence_parallel
        ),
        pipeline=pp > 1,
        zero3=zero3 or costlib.Zero3(),
        stand_in=stand_in or costlib.StandIn(),
    )
    u = unit or cfg.parallel.pipeline_unit
    costs = costlib.model_unit_costs(cfg, shape, dev, unit=u, profiled=profiled)
    cap = gpu_mem * costlib.GiB if gpu_mem is not None else dev.mem_bytes
    fixed = dev.overhead_bytes
    if zero_stage >= 3:
        if pp > 1:
            raise ValueError(
                f"ZeRO stage {zero_stage} with {pp} pipeline stages: DeepSpeed runs ZeRO-3 "
                "only without pipeline parallelism; use ZeRO 0 or 1, or pp 1"
            )
        fixed += costlib.zero3_stage_bytes(cfg, costs, shape, dev)
    if pp > 1:
        fixed += costlib.pipeline_buffer_bytes(cfg, shape, pp)
    elif zero_stage == 1 and dev.precision == "bf16":
        # BF16_Optimizer's reduce after backward, instead of the activations; the last
        # micro-batch's token tensors (the batch, its ids and labels) are still alive
        units = sum(c.act for c in costs) + costlib.units_transient(costs)
        local = sum(c.local_params for c in costs)
        batch = 3 * costlib.TOKEN_ID_BYTES * shape.tokens
        fixed += max(0.0, costlib.fallback_reduce_bytes(local, 2) + batch - units)
    return costs, m, cap, fixed


def partition(
    cfg: Config,
    pp: int,
    method: str = "balancer",
    micro_batches: int | None = None,
    **kwargs: Any,
) -> list[int]:
    """Stage boundaries (DeepSpeed ``parts``, length ``pp + 1``) of ``method`` for ``cfg``.

    Keyword arguments go to :func:`analyse` (``unit``, ``device``, ``gpu_mem``, ``dp``,
    ``zero_stage``, ``recompute``, ``profiled``).
    """
    m = ALIASES.get(method, method)
    if m not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; use one of {METHODS}")
    return list(analyse(cfg, pp, micro_batches, methods=(m,), **kwargs).methods[m].parts)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring)."""
    from tapered_megatron.config import load_config_or_exit

    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.pipeline.balance",
        description="Per-stage table of our exact pipeline balancer and of the baselines.",
    )
    ap.add_argument("--config", default="quickstart", help="preset name or YAML path")
    ap.add_argument("--pp", type=int, required=True, help="pipeline stages")
    ap.add_argument("--micro-batches", type=int, default=None, help="1F1B micro-batches per step")
    ap.add_argument("--gpu-mem", type=float, default=None, help="per-device memory cap, GiB")
    ap.add_argument("--unit", choices=("layer", "sublayer"), default=None)
    ap.add_argument(
        "--device",
        default="h100",
        help=f"cost-model device: one of {', '.join(costlib.DEVICES)}, or auto (this machine)",
    )
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (ZeRO sharding)")
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1), help="ZeRO stage (PP: 0/1)")
    ap.add_argument(
        "--recompute", choices=("none", "selective", "full"), default=None,
        help="activation recomputation (default: the config's train.recompute)",
    )  # fmt: skip
    ap.add_argument("--profiled", action="store_true", help="per-unit times measured here")
    ap.add_argument(
        "--schedule", choices=SCHEDULES, default="1f1b",
        help="pipeline schedule; with --virtual-stages: the per-chunk table of P x v chunks",
    )  # fmt: skip
    ap.add_argument("--virtual-stages", type=int, default=1, help="chunks per pipeline rank")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    a, rest = ap.parse_known_args(argv)
    cfg = load_config_or_exit(a.config, rest)
    setup_kwargs = {
        "unit": a.unit,
        "device": a.device,
        "gpu_mem": a.gpu_mem,
        "dp": a.dp,
        "zero_stage": a.zero,
        "recompute": a.recompute,
        "profiled": a.profiled,
    }
    try:
        if a.schedule != "1f1b" or a.virtual_stages != 1:
            return _print_chunks(cfg, a, setup_kwargs)
        res = analyse(cfg, a.pp, a.micro_batches, **setup_kwargs)
    except (InfeasibleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"config": cfg.name, **res.to_dict()}))
        return 0
    for m in METHODS:
        print(res.table(m))
        print()
    print(
        "bottleneck ratio (slowest stage / mean): "
        + ", ".join(f"{m} {res.methods[m].bottleneck:.3f}" for m in METHODS)
    )
    return 0


def _print_chunks(cfg: Config, a: argparse.Namespace, setup_kwargs: dict[str, Any]) -> int:
    """The chunk table (or ``--json``) of ``--schedule`` at ``--virtual-stages``."""
    setup, plans = analyse_chunks(
        cfg, a.pp, a.virtual_stages, a.schedule, a.micro_batches, **setup_kwargs
    )
    if a.json:
        out = {
            "config": cfg.name,
            "schedule": setup.schedule,
            "pp": setup.pp,
            "virtual_stages": setup.v,
            "micro_batches": setup.micro_batches,
            "units": [c.name for c in setup.costs],
            "predicted": {m: p.to_dict() for m, p in plans.items()},
        }
        print(json.dumps(out))
    else:
        print(chunk_table(setup, plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
