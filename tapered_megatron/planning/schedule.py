"""Pipeline schedules as the runtime runs them: torch's action order, replayed with chunk costs.

A schedule (``parallel.schedule``) runs ``P * v`` chunks (stages) on ``P`` pipeline ranks, ``v``
per rank (``parallel.virtual_stages``). :func:`pipeline_order` asks
``torch.distributed.pipelining``'s own schedule class for its per-rank list of compute actions
(``pipeline_order``: forward ``F``, full backward ``B``, or input and weight backward ``I`` /
``W`` for the zero-bubble schedules; DualPipeV's overlapped pairs run one after the other),
and for ``1f1b``, which runs on DeepSpeed's PipelineEngine, DeepSpeed's ``TrainSchedule``, so
the simulator never re-derives an order the runtime does not follow. :func:`simulate` replays
that order with per-chunk times: every rank runs its actions in list order, an action starts
when its rank is free and its inputs exist (the previous chunk's forward, the next chunk's
backward, plus ``p2p`` when they cross ranks), which gives the step's makespan; walking each
rank's list gives the activations it holds at once (a micro-batch's activations of a chunk live
from its ``F`` to its ``B`` or ``W``), independent of timing.

Chunk times split a unit's training time into passes: forward ``1 / passes`` of it, the rest
backward (recompute adds a pass to backward), and under the split schedules the weight pass
``1 / passes`` (a matmul's weight gradient costs what its forward does).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, get_args

import numpy as np

from tapered_megatron.config import PipelineSchedule

#: ``parallel.schedule`` values -> torch.distributed.pipelining schedule class names.
TORCH_SCHEDULES: dict[str, str] = {
    "1f1b": "Schedule1F1B",  # the reference runs on DeepSpeed's engine (its TrainSchedule)
    "interleaved": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
#: Schedules that place a rank's two chunks in a V (rank r: stages r and 2P - 1 - r).
V_SCHEDULES = ("zbv", "dualpipev")
#: Schedules that run a backward as an input pass and a later weight pass (``I``, ``W``).
SPLIT_BACKWARD = ("zbv", "dualpipev", "zero_bubble")


def schedule_problem(schedule: str, pp: int, v: int, micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run ``pp`` ranks x ``v`` chunks with ``micro_batches``, or None."""
    if schedule not in TORCH_SCHEDULES:
        return f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}"
    if pp < 2:
        return f"parallel.schedule {schedule} needs parallel.pp >= 2 (got {pp})"
    if schedule == "1f1b" and v != 1:
        return f"1f1b runs one chunk per rank; pass --parallel.virtual_stages 1 (got {v})"
    if schedule in V_SCHEDULES and v != 2:
        return f"{schedule} runs two chunks per rank in a V; pass --parallel.virtual_stages 2"
    if schedule == "interleaved" and v < 2:
        return "interleaved needs --parallel.virtual_stages 2 or more (v = 1 is 1f1b)"
    if v < 1:
        return f"parallel.virtual_stages must be at least 1 (got {v})"
    if schedule == "dualpipev" and micro_batches < pp * v:
        return (
            f"dualpipev needs at least {pp * v} micro-batches (P x v), got {micro_batches}; "
            "raise train.global_batch_size"
        )
    if schedule in ("interleaved", "zero_bubble"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            return (
                f"{schedule} needs the micro-batch count ({micro_batches}) to be a multiple of "
                f"max(1, M // P) = {rounds}; change train.global_batch_size"
            )
    return None


def stage_ranks(schedule: str, pp: int, v: int) -> tuple[int, ...]:
    """The pipeline rank of every chunk (stage index ``0 .. P*v - 1``), torch's mapping."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    style = "v" if schedule in V_SCHEDULES else "loop"
    mapping = generate_stage_to_rank_mapping(pp, pp * v, style=style)
    return tuple(mapping[s] for s in range(pp * v))


@dataclass
class _StageShape:
    """What a torch schedule class reads from (and writes to) its stages to build
    ``pipeline_order``: the stage's index and place in the pipeline (no module, no
    communication)."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: Any = None
    stage_index_to_group_rank: dict[int, int] | None = None

    @property
    def is_first(self) -> bool:
        """The first stage of the pipeline."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """The last stage of the pipeline."""
        return self.stage_index == self.num_stages - 1


#: One compute action: (kind ``F``/``B``/``I``/``W``, stage, micro-batch).
Action = tuple[str, int, int]


@cache
def pipeline_order(
    schedule: str, pp: int, v: int, micro_batches: int
) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions in the order torch's schedule class runs them."""
    problem = schedule_problem(schedule, pp, v, micro_batches)
    if problem:
        raise ValueError(problem)
    if schedule == "1f1b":
        return _deepspeed_order(pp, micro_batches)
    import torch.distributed.pipelining.schedules as torch_schedules

    cls = getattr(torch_schedules, TORCH_SCHEDULES[schedule])
    ranks = stage_ranks(schedule, pp, v)
    mine = [_StageShape(s, pp * v, pp, 0) for s in range(pp * v) if ranks[s] == 0]
    sched = cls(mine, micro_batches)
    order = []
    for r in range(pp):
        acts: list[Action] = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    acts.append((kind, sub.stage_index, sub.microbatch_index))
        order.append(tuple(acts))
    return tuple(order)


def _deepspeed_order(pp: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    """DeepSpeed PipelineEngine's per-rank order (its ``TrainSchedule``); it runs forwards and
    backwards each in micro-batch order, so counting them gives the micro-batch."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    order = []
    for r in range(pp):
        acts: list[Action] = []
        count = {"F": 0, "B": 0}
        for cmds in TrainSchedule(micro_batches=micro_batches, stages=pp, stage_id=r).steps():
            for c in cmds:
                if isinstance(c, ForwardPass | BackwardPass):
                    kind = "F" if isinstance(c, ForwardPass) else "B"
                    acts.append((kind, r, count[kind]))
                    count[kind] += 1
        order.append(tuple(acts))
    return tuple(order)


@dataclass(frozen=True)
class ChunkTimes:
    """Per-chunk times of one micro-batch (seconds): forward, backward (input + weight when the
    schedule runs them as one ``B``), and the input and weight passes a split schedule runs as
    ``I`` and ``W`` instead."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    inp: tuple[float, ...]
    wgt: tuple[float, ...]

    @classmethod
    def split(
        cls,
        totals: Sequence[float],
        passes: int = 3,
        split_backward: tuple[float, float] | None = None,
    ) -> ChunkTimes:
        """Times from each chunk's forward + backward total and the passes it runs (3, 4 with
        recompute). ``split_backward``: the input and the weight pass as fractions of the whole
        backward (:attr:`~tapered_megatron.planning.cost.Device.split_backward`); None: the
        weight pass costs a forward, the input pass the rest."""
        fwd = tuple(t / passes for t in totals)
        bwd = tuple(t - f for t, f in zip(totals, fwd, strict=True))
        if split_backward is None:
            return cls(fwd, bwd, tuple(b - f for b, f in zip(bwd, fwd, strict=True)), fwd)
        i, w = split_backward
        return cls(fwd, bwd, tuple(b * i for b in bwd), tuple(b * w for b in bwd))


@dataclass(frozen=True)
class Simulation:
    """A replayed step: its makespan, each rank's compute, and the activations in flight."""

    makespan: float
    rank_busy: tuple[float, ...]
    peak_act: tuple[float, ...]  # bytes of activations a rank holds at once, its worst moment
    live: tuple[int, ...]  # per chunk: most micro-batches whose activations it holds at once


@dataclass(frozen=True)
class _Replay:
    """A schedule's order compiled for replaying it many times: actions in an order where each
    follows its rank's previous actions and its inputs, as (rank, kind, chunk, inputs), the
    inputs as positions in that order and whether they cross ranks; per rank the number of
    micro-batches of each chunk whose activations it holds after each of its actions."""

    steps: tuple[tuple[int, str, int, tuple[tuple[int, bool], ...]], ...]
    held: tuple[np.ndarray, ...]  # per rank: [actions, chunks]


@cache
def _replay(schedule: str, pp: int, v: int, micro_batches: int) -> _Replay:
    """Compile :func:`pipeline_order` (raises when the order cannot run)."""
    order = pipeline_order(schedule, pp, v, micro_batches)
    n = pp * v
    ranks = stage_ranks(schedule, pp, v)
    pos = [0] * pp
    made: dict[Action, int] = {}
    steps = []
    total = sum(len(o) for o in order)
    while len(steps) < total:
        progressed = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts) and all(d in made for d in _deps(acts[pos[r]], n)):
                a = acts[pos[r]]
                inputs = tuple((made[d], ranks[d[1]] != r) for d in _deps(a, n))
                for key in _made(a):
                    made[key] = len(steps)
                steps.append((r, a[0], a[1], inputs))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = [acts[p] for acts, p in zip(order, pos, strict=True) if p < len(acts)]
            raise RuntimeError(f"pipeline order cannot proceed past {stuck}")
    return _Replay(tuple(steps), tuple(_held(acts, n) for acts in order))


def _held(acts: Sequence[Action], n: int) -> np.ndarray:
    """Micro-batches of each chunk whose activations a rank holds after each of its actions:
    from a chunk's ``F`` to its ``B``, or to its ``W`` (a split backward's input pass keeps
    them for the weight pass)."""
    out = np.zeros((len(acts), n))
    now = np.zeros(n)
    for i, (kind, s, _) in enumerate(acts):
        now[s] += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
        out[i] = now
    return out


def _made(a: Action) -> tuple[Action, ...]:
    """What an action makes: itself, and for ``B`` or ``I`` its input gradient ``G``."""
    kind, s, m = a
    return (a, ("G", s, m)) if kind in ("B", "I") else (a,)


def _deps(a: Action, n: int) -> list[Action]:
    """What an action needs: the previous chunk's forward, or its own forward and the next
    chunk's input gradient, or (``W``) its input backward."""
    kind, s, m = a
    if kind == "F":
        return [("F", s - 1, m)] if s > 0 else []
    if kind == "W":
        return [("I", s, m)]
    return [("F", s, m)] + ([("G", s + 1, m)] if s < n - 1 else [])


def simulate(
    schedule: str,
    pp: int,
    v: int,
    micro_batches: int,
    times: ChunkTimes,
    act: Sequence[float],
    p2p: float = 0.0,
    action: float = 0.0,
) -> Simulation:
    """Replay ``schedule``'s order with chunk ``times`` and activation bytes ``act`` (one
    micro-batch's, per chunk); ``p2p`` is the send time of an activation or its gradient,
    ``action`` the runtime's own time per compute action, on the rank beside the chunk's."""
    replay = _replay(schedule, pp, v, micro_batches)
    dur = {
        "F": times.fwd,
        "B": times.bwd,
        "I": times.inp,
        "W": times.wgt,
    }
    end = [0.0] * len(replay.steps)
    free = [0.0] * pp
    busy = [0.0] * pp
    for i, (r, kind, s, inputs) in enumerate(replay.steps):
        start = free[r]
        for j, crosses in inputs:
            start = max(start, end[j] + p2p) if crosses else max(start, end[j])
        d = dur[kind][s] + action
        end[i] = free[r] = start + d
        busy[r] += d
    a = np.asarray(act, dtype=np.float64)
    peak = tuple(float((h @ a).max(initial=0.0)) for h in replay.held)
    live = np.max([h.max(axis=0) for h in replay.held], axis=0)
    return Simulation(max(free), tuple(busy), peak, tuple(int(x) for x in live))


def rank_sums(values: Sequence[float], ranks: Sequence[int], pp: int) -> list[float]:
    """Sum of per-chunk ``values`` over the chunks of each rank."""
    out = [0.0] * pp
    for x, r in zip(values, ranks, strict=True):
        out[r] += x
    return out


def chunk_sums(values: Sequence[float], parts: Sequence[int]) -> list[float]:
    """Per-chunk sums of per-unit ``values`` for boundaries ``parts``."""
    return [float(sum(values[a:b])) for a, b in itertools.pairwise(parts)]
