"""Statistics over seeds for the reproduction's tables, plots and reading.

Mean and sample standard deviation (n-1). A configuration is compared with uniform seed by seed
(same seed = same initialisation stream and data order): the paired difference per seed, its
mean and standard deviation. A difference "exceeds the seed-to-seed spread" when its magnitude is
larger than the largest of the configuration's std, the uniform std and the paired differences'
std (with one seed there is no spread and the answer is n/a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from experiments.tlm import grid


def perplexity(loss: float) -> float:
    """``exp(loss)`` (capped like the trainer's logger)."""
    return math.exp(min(loss, 30.0))


@dataclass(frozen=True)
class Stat:
    """Mean and sample std of per-seed values."""

    values: dict[int, float]

    @property
    def n(self) -> int:
        """Number of seeds."""
        return len(self.values)

    @property
    def mean(self) -> float:
        """Mean over seeds."""
        return sum(self.values.values()) / self.n

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (0 for one seed)."""
        if self.n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values.values()) / (self.n - 1))


@dataclass(frozen=True)
class Paired:
    """A configuration against the baseline, seed by seed."""

    config: Stat
    base: Stat

    @property
    def diffs(self) -> Stat:
        """Per-seed differences ``config - base`` over the seeds both have."""
        common = sorted(set(self.config.values) & set(self.base.values))
        return Stat({s: self.config.values[s] - self.base.values[s] for s in common})

    @property
    def spread(self) -> float:
        """The seed-to-seed spread a difference must beat."""
        return max(self.config.std, self.base.std, self.diffs.std)

    @property
    def exceeds(self) -> str:
        """``yes`` / ``no`` / ``n/a`` (fewer than two paired seeds)."""
        d = self.diffs
        if d.n < 2:
            return "n/a"
        return "yes" if abs(d.mean) > self.spread else "no"


def pm(s: Stat | None, digits: int = 2) -> str:
    """``mean ± std`` (just the mean for one seed; an em dash for none)."""
    if s is None or s.n == 0:
        return "—"
    if s.n == 1:
        return f"{s.mean:.{digits}f}"
    return f"{s.mean:.{digits}f} ± {s.std:.{digits}f}"


def signed_pm(s: Stat, digits: int = 2) -> str:
    """Like :func:`pm` with an explicit sign on the mean."""
    if s.n == 0:
        return "—"
    if s.n == 1:
        return f"{s.mean:+.{digits}f}"
    return f"{s.mean:+.{digits}f} ± {s.std:.{digits}f}"


def by_variant(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Run records keyed by variant key, then by seed."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["variant"], {})[r["seed"]] = r
    return out


def ppl_stat(runs: dict[int, dict[str, Any]] | None) -> Stat:
    """Final validation perplexity per seed."""
    return Stat({s: perplexity(r["final_val_loss"]) for s, r in (runs or {}).items()})


def late_drop_ratio(rec: dict[str, Any]) -> float | None:
    """How much the last evaluation interval moved the validation loss, as a fraction of the
    first interval's drop (small: the run is past its fast phase). None with < 3 points."""
    c = [p[2] for p in rec["val_curve"]]
    if len(c) < 3 or c[0] == c[1]:
        return None
    return abs(c[-1] - c[-2]) / abs(c[0] - c[1])


def rho_stats(by: dict, v: grid.Variant, key: str) -> list[Stat]:
    """Per-layer ``key`` (``rho_block`` | ``rho_mlp``) over the seeds of ``v`` that measured it."""
    runs = {s: r for s, r in (by.get(v.key) or {}).items() if r.get("alignment")}
    if not runs:
        return []
    layers = len(next(iter(runs.values()))["alignment"]["layers"])
    return [
        Stat({s: r["alignment"]["layers"][i][key] for s, r in runs.items()}) for i in range(layers)
    ]


def zs_stat(runs: dict[int, dict[str, Any]] | None, task: str | None = None) -> Stat:
    """Zero-shot accuracy per seed in percent (``task=None``: the average over tasks)."""
    vals = {}
    for s, r in (runs or {}).items():
        z = r.get("zeroshot")
        if z:
            acc = z["average_acc"] if task is None else z["tasks"][task]["acc"]
            vals[s] = 100.0 * acc
    return Stat(vals)
