"""One rank's memory taken from the real code in a simulated world, beside the planner's figures.

:func:`simulate` builds rank ``r``'s model and DeepSpeed engine through the trainer's own code
for a planner layout, runs a few training steps (forward, backward, optimizer) inside
:func:`tapered_megatron.planning.fake_world.fake_world` (fake process group, fake tensors: no
memory is allocated) and reports, each beside the cost model's prediction for the same stage:

* ``params``: parameters this rank holds before ZeRO partitioning (its TP shard of its stage);
* ``model_state``: the bytes alive when the optimizer step begins: weights, gradients,
  optimizer state and DeepSpeed's buffers made once (ZeRO-1/2's reduce buckets, ZeRO-3's
  reduce bucket); the activations are gone;
* ``peak``: the most bytes alive at once during the last step (the first builds the optimizer
  state);
* ``block_act``: per block, what its forward of one micro-batch keeps for backward: the bytes
  it made that are still alive when the stage's forward ends, its output excepted, plus its
  input if that is still alive (under full recompute: the checkpointed input only).

The cost model's fixed per-device overhead (CUDA context, allocator slack) is not simulated and
is left out of the predicted peak. ``python scripts/simulate_rank.py`` is the command line.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from tapered_megatron.checkpoint.layout import ParallelLayout
from tapered_megatron.config import Config
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.fake_world import LiveBytes, fake_world
from tapered_megatron.planning.planner import Candidate, ds_config, evaluate, overrides
from tapered_megatron.training.launch import resolve

#: Training steps simulated: the first builds the optimizer state, the peak is taken after it.
STEPS = 2


@dataclass
class Figures:
    """Predicted and simulated figures of one rank (bytes; ``block_act`` per block)."""

    params: float
    model_state: float
    peak: float
    block_act: list[float] = field(default_factory=list)


@dataclass
class Simulation:
    """One rank of one layout: where it sits and its two sets of figures."""

    layout: str
    rank: int
    stage: int
    predicted: Figures
    simulated: Figures

    def errors(self) -> dict[str, float]:
        """Relative error of each simulated figure against the prediction (per-block: the
        largest in magnitude)."""
        p, s = self.predicted, self.simulated
        out = {k: getattr(s, k) / getattr(p, k) - 1 for k in ("params", "model_state", "peak")}
        blocks = [b / a - 1 for a, b in zip(p.block_act, s.block_act, strict=True) if a]
        out["block_act"] = max(blocks, key=abs, default=0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        return {
            "layout": self.layout,
            "rank": self.rank,
            "stage": self.stage,
            "predicted": vars(self.predicted),
            "simulated": vars(self.simulated),
            "errors": self.errors(),
        }


def layout_config(cfg: Config, c: Candidate) -> Config:
    """``cfg`` with the candidate's parallel layout, micro-batch and recompute settings."""
    return cfg.with_overrides(overrides(cfg, c))


def predicted(
    cfg: Config, c: Candidate, dev: costlib.Device, parts: list[int], stage: int
) -> Figures:
    """The cost model's figures for stage ``stage`` of ``parts`` under layout ``c``."""
    from tapered_megatron.planning.balance import analyse

    bal = analyse(
        cfg, c.pp, c.grad_accum, unit=c.unit, device=dev, gpu_mem=float("inf"),
        dp=c.dp, zero_stage=c.zero, recompute=c.recompute, tp=c.tp,
        sequence_parallel=c.sequence_parallel, micro_batch_size=c.micro_batch_size,
        methods=("balancer",),
    )  # fmt: skip
    units = bal.costs[parts[stage] : parts[stage + 1]]
    local = sum(u.local_params for u in units)
    elem = costlib.activation_scale(dev.precision)
    stage_params = sum(u.params for u in units) / c.tp  # as the planner sizes the buckets
    buckets = costlib.overlap_bucket_bytes(stage_params, elem, c.zero) if c.pp == 1 else 0.0
    fixed = bal.overhead - dev.overhead_bytes  # ZeRO-3, the pipeline, BF16_Optimizer's reduce
    peak = costlib.stage_memory(bal.costs, parts, c.grad_accum)[stage] + fixed + buckets
    shape = costlib.RunShape(
        micro_batch_size=c.micro_batch_size, seq_len=cfg.model.seq_len, micro_batches=c.grad_accum,
        tp=c.tp, precision=dev.precision, sequence_parallel=c.sequence_parallel,
    )  # fmt: skip
    buffers = buckets  # DeepSpeed's buffers made once
    if c.zero == 3:
        buffers += costlib.zero3_held_bytes([u.local_params for u in units], shape, dev)
    if c.pp > 1:
        buffers += costlib.pipeline_held_bytes(cfg, shape, c.pp, stage)
    static = sum(u.static for u in units) + buffers
    blocks = [u.act for u in units if u.kind in ("layer", "mixer", "mlp")]
    return Figures(local, static, peak, blocks)


def simulate(
    cfg: Config, c: Candidate, dev: costlib.Device, rank: int, cap: float = float("inf")
) -> Simulation:
    """Simulate ``rank`` of layout ``c`` (see the module docstring); ``cap``: the planner's
    per-device memory cap in bytes (it picks the pipeline stages)."""
    filled = evaluate(cfg, c, dev, cap)
    if isinstance(filled, str):
        raise ValueError(f"layout {c.label}: {filled}")
    run_cfg = layout_config(cfg, filled)
    world = c.tp * c.pp * c.dp
    ds, layout = resolve(run_cfg, ds_config(run_cfg, filled, dev), world)
    seq = run_cfg.model.seq_len // (c.tp if c.sequence_parallel else 1)
    received = (c.micro_batch_size, seq, run_cfg.model.d_model)
    with fake_world(world, rank, dev, received) as live:
        engine, stage, parts = _build(run_cfg, ds, layout, filled)
        probe = _Probe(engine, live)
        for step in range(STEPS):
            if step == STEPS - 1:
                live.reset_peak()
                probe.arm()
            _train_step(engine, run_cfg, layout)
        probe.remove()
        params = _rank_params(engine.module)
        simulated = Figures(params, probe.model_state, live.peak, probe.block_act)
    return Simulation(
        filled.label, rank, stage, predicted(run_cfg, filled, dev, parts, stage), simulated
    )


def _build(
    cfg: Config, ds: dict[str, Any], layout: ParallelLayout, c: Candidate
) -> tuple[Any, int, list[int]]:
    """The trainer's engine for this rank, its pipeline stage and the stage boundaries."""
    from tapered_megatron import parallel
    from tapered_megatron.models import units
    from tapered_megatron.planning.clock import StageClock
    from tapered_megatron.training.trainer import build_engine

    parallel.init_model_parallel(layout.tp, layout.pp)
    parallel.model_parallel_seed(cfg.train.seed)
    engine = build_engine(cfg, ds, layout, StageClock() if layout.pp > 1 else None)
    stage = parallel.get_pipeline_model_parallel_rank()
    parts = engine.module.parts if layout.pp > 1 else [0, len(units(cfg, c.unit))]
    return engine, stage, list(parts)


def _train_step(engine: Any, cfg: Config, layout: ParallelLayout) -> None:
    """One optimizer step of random token batches, made and fed as the trainer's ``batches`` and
    ``train_step`` make and feed them."""
    import torch

    def batches() -> Any:
        while True:
            shape = (layout.micro_batch_size, cfg.model.seq_len + 1)
            tokens = torch.randint(0, cfg.model.vocab_size, shape)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    if layout.pp > 1:
        engine.train_batch(batches())
        return
    it = batches()
    for _ in range(layout.grad_accum):
        x, y = next(it)
        engine.backward(engine(x, y))
        engine.step()


def _rank_params(module: Any) -> float:
    """Parameters this rank holds before ZeRO-3 partitioning (its TP shard of its stage)."""
    return float(sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()))


class _Probe:
    """The figures of one steady-state step: the bytes alive when the optimizer step begins
    (model state, after the last backward) and, per block, the bytes that the block's forward
    of the first micro-batch made and that are still alive when the stage's forward ends (what
    it keeps for backward)."""

    def __init__(self, engine: Any, live: LiveBytes) -> None:
        from tapered_megatron.models.language_model import Block

        self.live, self.armed, self._module = live, False, engine.module
        self.model_state = 0.0
        self.block_act: list[float] = []
        self._logs: list[list] = []
        blocks = [m for m in engine.module.modules() if isinstance(m, Block)]
        self._hooks = [h for b in blocks for h in self._hook_block(b)]
        self._hooks.append(engine.module.register_forward_hook(self._stage_done))
        take = engine._take_model_step

        def take_model_step(*args: Any, **kwargs: Any) -> Any:
            self.model_state = float(live.current)
            return take(*args, **kwargs)

        engine._take_model_step = take_model_step

    def _hook_block(self, block: Any) -> list[Any]:
        def pre(_: Any, args: tuple) -> None:
            if self.armed:
                self.live.log = []
                self._logs.append((self.live.log, _storage_ref(args[0]), None))

        def post(_: Any, args: tuple, out: Any) -> None:
            if self.live.log is not None:
                log, kept, _ = self._logs[-1]
                self._logs[-1] = (log, kept, _storage_ref(out))
            self.live.log = None

        return [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]

    def arm(self) -> None:
        """Measure the next forward."""
        self.armed = True

    def _stage_done(self, *_: Any) -> None:
        if self.armed:
            # ZeRO-3 gathers weights inside the blocks and keeps them for backward: not theirs
            weights = {id(p.untyped_storage()) for p in self._module.parameters()}
            self.block_act = [_kept(*entry, weights) for entry in self._logs]
            self.armed, self._logs = False, []

    def remove(self) -> None:
        """Take the hooks off."""
        for h in self._hooks:
            h.remove()


def _storage_ref(t: Any) -> weakref.ref:
    return weakref.ref(t.untyped_storage())


def _kept(
    log: list, block_input: weakref.ref, block_output: weakref.ref, weights: set[int]
) -> float:
    """What a block keeps for backward: the storages its forward made and are still alive, but
    its output (alive only where the next block keeps it as input) and weights (ZeRO-3's
    gathered ones, storage ids in ``weights``), and its input if alive."""
    out = block_output()
    made = [(r, n) for r, n in log if r() is not out and id(r()) not in weights]
    held = block_input()
    return float(LiveBytes.alive(made) + (held.nbytes() if held is not None else 0))
