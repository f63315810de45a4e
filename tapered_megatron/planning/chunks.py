"""The balancer for virtual stages: cut the units into ``P x v`` chunks for a pipeline schedule.

With ``v`` chunks per rank (``parallel.virtual_stages``) the slowest *chunk* no longer sets the
step: a rank runs all of its chunks, so what matters is the sum of each rank's chunks, the order
the schedule runs them in, and the activations the schedule keeps in flight. The balancer
therefore scores a cut by replaying the schedule (:func:`~.schedule.simulate`, torch's own
order): the objective is, in this order, the memory overflow of the worst rank (static memory of
its chunks + the most activations it holds at once + one unit's transient, against the cap),
the simulated makespan, and the spread of the per-rank chunk sums (sum of squares). It starts
from two cuts, the exact min-max chunk partition of :mod:`.solver` over ``P * v`` stages and
equal unit counts, and moves to the best neighbouring cut (one boundary moved anywhere between
its neighbours, or a short run of boundaries shifted by one unit) while it is better: a local
search, since the replay makes the objective non-separable and the exact programme does not
apply (on small cases it is checked against exhaustive search).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.schedule import (
    ChunkTimes,
    Simulation,
    chunk_sums,
    rank_sums,
    simulate,
    stage_ranks,
)
from tapered_megatron.planning.solver import InfeasibleError, Problem, solve

#: Cuts the chunk table compares: ours, the min-max chunk partition it starts from, equal counts.
CHUNK_METHODS = ("balancer", "solver", "uniform")


@dataclass(frozen=True)
class ChunkSetup:
    """What a chunk cut is scored against: the units, the schedule and the memory budget."""

    costs: tuple[costlib.UnitCost, ...]
    schedule: str
    pp: int
    v: int
    micro_batches: int
    cap: float = float("inf")
    overhead: float = 0.0
    passes: int = 3  # passes a unit runs per micro-batch (4 with full recompute)
    p2p: float = 0.0  # send time of one activation or gradient between ranks
    action: float = 0.0  # the runtime's own time per compute action (Device.schedule_overhead)
    split_backward: tuple[float, float] | None = None  # Device.split_backward


@dataclass(frozen=True)
class ChunkPlan:
    """One cut into ``P * v`` chunks and what the replayed schedule predicts for it."""

    method: str
    parts: tuple[int, ...]
    ranks: tuple[int, ...]  # rank of each chunk
    chunk_times: tuple[float, ...]
    chunk_params: tuple[int, ...]
    rank_times: tuple[float, ...]  # sum of each rank's chunks
    rank_mem: tuple[float, ...]
    sim: Simulation
    fits: bool

    def score(self, cap: float) -> tuple[float, float, float]:
        """The balancer's objective (smaller is better): overflow, makespan, spread."""
        over = max(0.0, max(self.rank_mem) - cap)
        return (over, self.sim.makespan, sum(t * t for t in self.rank_times))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (times in seconds, memory in bytes; all predicted)."""
        return {
            "parts": list(self.parts),
            "ranks": list(self.ranks),
            "chunk_times": list(self.chunk_times),
            "rank_times": list(self.rank_times),
            "rank_mem": list(self.rank_mem),
            "live": list(self.sim.live),
            "step_time": self.sim.makespan,
            "fits": self.fits,
        }


def evaluate_chunks(setup: ChunkSetup, parts: Sequence[int], method: str) -> ChunkPlan:
    """Replay ``setup.schedule`` over the chunks of ``parts``."""
    c = setup.costs
    ranks = stage_ranks(setup.schedule, setup.pp, setup.v)
    times = chunk_sums([u.time for u in c], parts)
    act = chunk_sums([u.act for u in c], parts)
    sim = simulate(
        setup.schedule,
        setup.pp,
        setup.v,
        setup.micro_batches,
        ChunkTimes.split(times, setup.passes, setup.split_backward),
        act,
        setup.p2p,
        setup.action,
    )
    static = rank_sums(chunk_sums([u.static for u in c], parts), ranks, setup.pp)
    peak = [0.0] * setup.pp
    for j, (a, b) in enumerate(itertools.pairwise(parts)):
        peak[ranks[j]] = max(peak[ranks[j]], costlib.units_transient(c[a:b]))
    after = rank_sums(chunk_sums([u.after for u in c], parts), ranks, setup.pp)
    after = [min(a, costlib.AFTER_CAP) for a in after]
    mem = [
        setup.overhead + static[r] + max(sim.peak_act[r] + peak[r], after[r])
        for r in range(setup.pp)
    ]
    return ChunkPlan(
        method=method,
        parts=tuple(int(x) for x in parts),
        ranks=ranks,
        chunk_times=tuple(times),
        chunk_params=tuple(sum(u.params for u in c[a:b]) for a, b in itertools.pairwise(parts)),
        rank_times=tuple(rank_sums(times, ranks, setup.pp)),
        rank_mem=tuple(mem),
        sim=sim,
        fits=all(m <= setup.cap * (1 + 1e-9) for m in mem),
    )


def start_cuts(setup: ChunkSetup) -> dict[str, list[int]]:
    """The two starting cuts: min-max chunk time (exact, :mod:`.solver`) and equal counts
    (DeepSpeed's ``partition_uniform`` over the units, embedding and head counting one each)."""
    from deepspeed.runtime.utils import partition_uniform

    n, k = len(setup.costs), setup.pp * setup.v
    if n < k:
        raise InfeasibleError(
            f"{n} units cannot fill {setup.pp} x {setup.v} = {k} non-empty chunks; lower "
            "parallel.virtual_stages or parallel.pp, or use --parallel.pipeline_unit sublayer"
        )
    return {
        "solver": solve(Problem.make([u.time for u in setup.costs], k)),
        "uniform": [int(x) for x in partition_uniform(num_items=n, num_parts=k)],
    }


def _neighbours(parts: Sequence[int]) -> Iterator[list[int]]:
    """Cuts one move away: one boundary anywhere between its neighbours, a run of consecutive
    boundaries shifted together by one unit (a unit passed along several chunks), or two
    neighbouring boundaries each moved by one unit."""
    k = len(parts) - 1
    for i in range(1, k):
        for x in range(parts[i - 1] + 1, parts[i + 1]):
            if x != parts[i]:
                yield [*parts[:i], x, *parts[i + 1 :]]
    moves = [
        (i, j, step, 0) for i, j in itertools.combinations(range(1, k + 1), 2) for step in (-1, 1)
    ]
    moves += [(i, i + 1, a, b) for i in range(1, k - 1) for a in (-1, 1) for b in (-1, 1)]
    for i, j, step, other in moves:
        cand = [x + step if i <= n < j else x for n, x in enumerate(parts)]
        if j < k:
            cand[j] += other
        if all(b > a for a, b in itertools.pairwise(cand)):
            yield cand


def improve(setup: ChunkSetup, parts: Sequence[int]) -> ChunkPlan:
    """Take the best neighbouring cut (:func:`_neighbours`) while it improves the objective."""
    best = evaluate_chunks(setup, parts, "balancer")
    while True:
        plans = [evaluate_chunks(setup, c, "balancer") for c in _neighbours(best.parts)]
        step = min(plans, key=lambda p: p.score(setup.cap), default=best)
        if step.score(setup.cap) >= best.score(setup.cap):
            return best
        best = step


def balance_chunks(setup: ChunkSetup) -> dict[str, ChunkPlan]:
    """Every method of :data:`CHUNK_METHODS` for ``setup``: the balancer's cut (the better of
    the local searches from both starting cuts) and the two starting cuts themselves."""
    starts = start_cuts(setup)
    out = {m: evaluate_chunks(setup, p, m) for m, p in starts.items()}
    tries = [improve(setup, p) for p in starts.values()]
    out["balancer"] = min(tries, key=lambda p: p.score(setup.cap))
    return {m: out[m] for m in CHUNK_METHODS}


def chunk_table(setup: ChunkSetup, plans: dict[str, ChunkPlan], method: str = "balancer") -> str:
    """Per-chunk and per-rank table of one cut, and the step of every cut (all predicted)."""
    r = plans[method]
    c = setup.costs
    lines = [
        f"pipeline chunks [{method}] schedule={setup.schedule} pp={setup.pp} v={setup.v} "
        f"micro_batches={setup.micro_batches} step={r.sim.makespan * 1e3:.1f} ms (predicted)",
        f"{'chunk':>5} {'rank':>4} {'units':>9} {'first..last':<28} {'params':>10} "
        f"{'time ms':>9} {'live':>4}",
    ]
    for j, (lo, hi) in enumerate(itertools.pairwise(r.parts)):
        names = f"{c[lo].name}..{c[hi - 1].name}"
        lines.append(
            f"{j:>5} {r.ranks[j]:>4} {f'{lo}:{hi}':>9} {names:<28} "
            f"{r.chunk_params[j] / 1e6:>9.1f}M {r.chunk_times[j] * 1e3:>9.2f} {r.sim.live[j]:>4}"
        )
    lines.append(f"{'rank':>5} {'chunks ms':>10} {'busy':>6} {'mem GiB':>8}")
    for k in range(setup.pp):
        lines.append(
            f"{k:>5} {r.rank_times[k] * 1e3:>10.2f} "
            f"{r.sim.rank_busy[k] / r.sim.makespan:>6.1%} {r.rank_mem[k] / costlib.GiB:>8.2f}"
        )
    lines.append(
        "predicted step: "
        + ", ".join(f"{m} {p.sim.makespan * 1e3:.1f} ms" for m, p in plans.items())
        + f" (balancer / uniform {r.sim.makespan / plans['uniform'].sim.makespan:.3f})"
    )
    return "\n".join(lines)
