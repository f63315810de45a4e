"""Exact contiguous pipeline partitioning: minimise the slowest stage under a per-stage memory cap.

The problem: ``N`` units in a fixed order (embedding, blocks or sub-blocks, head + loss), each with
a time ``t[u]``, a static memory ``s[u]`` (weights, gradients, optimizer state) and an activation
memory ``a[u]`` per micro-batch in flight, and ``P`` stages. Stage ``j`` holds a contiguous,
non-empty range ``[lo, hi)`` and needs::

    time_j = sum(t[lo:hi])
    mem_j  = fixed[j] + sum(s[lo:hi]) + inflight[j] * sum(a[lo:hi])
             + max(peak[u] - sum(a[u + 1:hi]) for u in [lo, hi))

``inflight[j]`` is the number of micro-batches whose activations stage ``j`` holds at once,
``min(P - j, M)`` under 1F1B; ``peak`` is a transient working set (one unit's activation
gradients, or its recomputed activations under checkpointing). A unit runs backward after the
units behind it on its stage, which have freed their activations of that micro-batch by then,
so its transient stands beside theirs less (:func:`stage_transient`; the head's, its loss in
forward, beside everything). Memory is therefore stage-aware: the same range costs more on an
early stage than on a late one.

:func:`solve` returns the partition minimising ``max_j time_j`` subject to ``mem_j <= cap`` and
every stage non-empty. It is exact: a dynamic programme over prefix sums, ``f[j][k]`` = the best
bottleneck for units ``[0, k)`` on stages ``0..j``, with the recurrence
``f[j][k] = min_i max(f[j-1][i], T[i, k])`` over feasible ``i`` (``O(P * N^2)``, vectorised over
``(i, k)``: 64 stages x 500 units take well under a second). Among the partitions that reach the
optimal bottleneck, a second pass of the same programme picks the one with the smallest sum of
squared stage times (the most even), so the answer is deterministic and robust to cost-model
error. Feasibility of a range is monotone (a sub-range of a feasible range is feasible), and the
tests check the result against brute force.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class InfeasibleError(ValueError):
    """No contiguous partition into non-empty stages fits the memory cap."""


@dataclass(frozen=True)
class Problem:
    """One partitioning instance (see the module docstring for the meaning of each array)."""

    times: tuple[float, ...]
    static: tuple[float, ...]
    act: tuple[float, ...]
    peak: tuple[float, ...]
    inflight: tuple[float, ...]  # one per stage
    fixed: tuple[float, ...]  # one per stage: bytes every stage j pays regardless of its units
    cap: float = float("inf")
    after: tuple[float, ...] = ()  # per unit: bytes after backward instead of the activations
    after_cap: float = float("inf")  # the most of ``after`` a stage holds at once

    @classmethod
    def make(
        cls,
        times: Sequence[float],
        stages: int,
        *,
        static: Sequence[float] | None = None,
        act: Sequence[float] | None = None,
        peak: Sequence[float] | None = None,
        inflight: Sequence[float] | None = None,
        fixed: Sequence[float] | None = None,
        cap: float | None = None,
        after: Sequence[float] | None = None,
        after_cap: float = float("inf"),
    ) -> Problem:
        """Build a problem; missing memory terms are zero, ``inflight`` defaults to 1F1B's
        ``P - j`` (callers pass ``min(P - j, M)`` when they know the micro-batch count)."""
        n = len(times)
        zeros = (0.0,) * n
        inf = tuple(float(x) for x in inflight) if inflight is not None else None
        return cls(
            times=tuple(float(x) for x in times),
            static=tuple(float(x) for x in static) if static is not None else zeros,
            act=tuple(float(x) for x in act) if act is not None else zeros,
            peak=tuple(float(x) for x in peak) if peak is not None else zeros,
            inflight=inf if inf is not None else tuple(float(stages - j) for j in range(stages)),
            fixed=tuple(float(x) for x in fixed) if fixed is not None else (0.0,) * stages,
            cap=float("inf") if cap is None else float(cap),
            after=tuple(float(x) for x in after) if after is not None else zeros,
            after_cap=float(after_cap),
        )

    @property
    def units(self) -> int:
        """Number of units ``N``."""
        return len(self.times)

    @property
    def stages(self) -> int:
        """Number of stages ``P``."""
        return len(self.inflight)

    def stage_time(self, lo: int, hi: int) -> float:
        """Time of units ``[lo, hi)``."""
        return float(sum(self.times[lo:hi]))

    def stage_memory(self, j: int, lo: int, hi: int) -> float:
        """Memory of units ``[lo, hi)`` placed on stage ``j``."""
        if hi <= lo:
            return self.fixed[j]
        working = self.inflight[j] * float(sum(self.act[lo:hi])) + stage_transient(
            self.act[lo:hi], self.peak[lo:hi]
        )
        after = min(float(sum(self.after[lo:hi])), self.after_cap)
        return self.fixed[j] + float(sum(self.static[lo:hi])) + max(working, after)


def stage_transient(act: Sequence[float], peak: Sequence[float]) -> float:
    """The most a stage's units (in order; per micro-batch ``act``, transient ``peak``) add at
    once to the activations of its micro-batches in flight: unit ``u``'s transient, less the
    activations of the units after it, which ran backward first and freed theirs."""
    after, most = 0.0, 0.0
    for a, p in zip(reversed(act), reversed(peak), strict=True):
        most = max(most, p - after)
        after += a
    return most


def _prefix(x: Sequence[float]) -> np.ndarray:
    out = np.zeros(len(x) + 1)
    out[1:] = np.cumsum(np.asarray(x, dtype=np.float64))
    return out


def _range_max(x: Sequence[float]) -> np.ndarray:
    """``R[i, k] = max(x[i:k])`` for i < k (0 elsewhere)."""
    n = len(x)
    arr = np.asarray(x, dtype=np.float64)
    out = np.zeros((n + 1, n + 1))
    for i in range(n):
        out[i, i + 1 :] = np.maximum.accumulate(arr[i:])
    return out


def solve(problem: Problem) -> list[int]:
    """Exact min-max contiguous partition; returns DeepSpeed-style ``parts`` (length ``P + 1``).

    Raises :class:`InfeasibleError` when ``N < P`` or no partition fits ``problem.cap``.
    """
    n, p = problem.units, problem.stages
    if p < 1:
        raise ValueError("need at least one stage")
    if n < p:
        raise InfeasibleError(f"{n} units cannot fill {p} non-empty stages")
    st = _prefix(problem.times)
    ss = _prefix(problem.static)
    sa = _prefix(problem.act)
    tmat = st[None, :] - st[:, None]  # T[i, k] = time of [i, k)
    smat = ss[None, :] - ss[:, None]
    amat = sa[None, :] - sa[:, None]
    sf = _prefix(problem.after or (0.0,) * n)
    fmat = np.minimum(sf[None, :] - sf[:, None], problem.after_cap)  # after its backward
    # max over u in [i, k) of peak[u] - (sa[k] - sa[u + 1]): stage_transient of every range
    pmat = _range_max(np.asarray(problem.peak) + sa[1:]) - sa[None, :] if any(problem.peak) else 0.0
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]  # non-empty ranges only
    # tolerance: the cap is a budget, not an exact number; absorb float noise of prefix sums
    cap = problem.cap * (1 + 1e-12) if np.isfinite(problem.cap) else np.inf

    feas = []
    for j in range(p):
        mem = problem.fixed[j] + smat + np.maximum(problem.inflight[j] * amat + pmat, fmat)
        feas.append(valid & (mem <= cap))

    def run(objective: str, bound: float) -> tuple[float, list[np.ndarray]]:
        inf = np.inf
        f = np.full(n + 1, inf)
        f[0] = 0.0
        choices: list[np.ndarray] = []
        tol = bound * (1 + 1e-12) + 1e-300 if np.isfinite(bound) else inf
        for j in range(p):
            ok = feas[j] & (tmat <= tol)
            if objective == "max":
                cand = np.maximum(f[:, None], tmat)
            else:
                cand = f[:, None] + tmat * tmat
            cand = np.where(ok, cand, inf)
            choice = np.argmin(cand, axis=0)
            f = cand[choice, idx]
            choices.append(choice)
        return float(f[n]), choices

    best, _ = run("max", np.inf)
    if not np.isfinite(best):
        raise InfeasibleError(
            f"no partition of {n} units into {p} stages fits the memory cap of {problem.cap:.4g}"
        )
    score, choices = run("sumsq", best)
    assert np.isfinite(score)
    parts = [n]
    for j in range(p - 1, -1, -1):
        parts.append(int(choices[j][parts[-1]]))
    parts.reverse()
    assert parts[0] == 0
    return parts


def stage_times(times: Sequence[float], parts: Sequence[int]) -> list[float]:
    """Per-stage time sums of a ``parts`` boundary list."""
    return [float(sum(times[a:b])) for a, b in itertools.pairwise(parts)]


def bottleneck_ratio(times: Sequence[float], parts: Sequence[int]) -> float:
    """Slowest stage divided by the mean stage time (1.0 is perfect balance)."""
    st = stage_times(times, parts)
    mean = sum(st) / len(st)
    return max(st) / mean if mean > 0 else 1.0
