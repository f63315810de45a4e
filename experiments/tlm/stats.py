"""Statistics over seeds for the reproduction's tables, plots and reading.

Mean and sample standard deviation (n-1). A configuration is compared with its baseline seed by
seed (same seed = same initialisation stream and data order): the paired differences, their mean,
a 95 % Student t interval and a two-sided p value (paired t test, n-1 degrees of freedom). The
words follow the interval: "lower, interval excludes 0" or "lower in the mean, interval includes
0". Accuracies on n items carry a Wilson 95 % interval; counts over configurations a two-sided
sign test; the same comparison at two model sizes (independent runs) a Welch interval with
conservative integer degrees of freedom. The t distribution is computed here in closed form
(integer degrees of freedom), so the reproduction needs no statistics package.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from experiments.tlm import grid

# The standard normal's 97.5 % quantile (the z of a two-sided 95 % interval).
Z95 = 1.959963984540054


def perplexity(loss: float) -> float:
    """``exp(loss)`` (capped like the trainer's logger)."""
    return math.exp(min(loss, 30.0))


def t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` (>= 1) degrees of freedom.

    The closed form for integer ``df`` (Abramowitz & Stegun 26.7.3-4): with
    ``theta = atan(|t| / sqrt(df))``, ``P(|T| < |t|)`` is a finite series in ``cos(theta)``.
    """
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    term = total = 1.0
    if df % 2:
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        inside = 2 / math.pi * (theta + series)
    else:
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sin(theta) * total
    return max(0.0, 1.0 - inside)


def t_quantile_975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_two_sided_p` to float precision)."""
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > 0.05:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided_p(mid, df) > 0.05:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def wilson(p: float, n: int) -> tuple[float, float]:
    """Wilson 95 % interval of a proportion ``p`` observed on ``n`` items."""
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def sign_test_p(k: int, n: int) -> float:
    """Two-sided sign test: the chance of a split at least as uneven as ``k`` of ``n`` when
    each sign is a fair coin."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


class _TInterval:
    """The 95 % t interval and two-sided p value of an estimate whose subclass gives ``n``,
    ``mean`` and its standard error ``_se``, with ``n - 1`` degrees of freedom."""

    @property
    def interval(self) -> tuple[float, float] | None:
        """95 % t interval of the estimate (None below two values)."""
        if self.n < 2:
            return None
        half = t_quantile_975(self.n - 1) * self._se
        return self.mean - half, self.mean + half

    @property
    def p(self) -> float | None:
        """Two-sided p value of "the estimate is 0" (t test; None below two values)."""
        if self.n < 2:
            return None
        if self._se == 0:
            return 1.0 if self.mean == 0 else 0.0
        return t_two_sided_p(self.mean / self._se, self.n - 1)


@dataclass(frozen=True)
class Stat(_TInterval):
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

    @property
    def _se(self) -> float:
        return self.std / math.sqrt(self.n)


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


@dataclass(frozen=True)
class Unpaired(_TInterval):
    """The difference of two independent samples' means, ``a - b`` (different runs, e.g. the
    same comparison at two model sizes): Welch's standard error, with ``min(n_a, n_b) - 1``
    degrees of freedom, the conservative integer bound on Welch-Satterthwaite's (so the
    closed-form t above applies and the interval is never narrower than Welch's)."""

    a: Stat
    b: Stat

    @property
    def n(self) -> int:
        """The smaller sample's size (what the degrees of freedom follow)."""
        return min(self.a.n, self.b.n)

    @property
    def mean(self) -> float:
        """``mean(a) - mean(b)``."""
        return self.a.mean - self.b.mean

    @property
    def _se(self) -> float:
        return math.sqrt(self.a.std**2 / self.a.n + self.b.std**2 / self.b.n)


def excludes_zero(d: Stat | Unpaired | ItemPaired) -> bool:
    """Whether the 95 % interval of the mean of ``d`` lies on one side of 0."""
    ci = d.interval
    return ci is not None and (ci[0] > 0 or ci[1] < 0)


def direction(d: Stat | Unpaired | ItemPaired) -> str:
    """What the paired differences say, in words that follow the 95 % interval."""
    if d.n == 0:
        return "not measured"
    side = "lower" if d.mean < 0 else "higher" if d.mean > 0 else "equal"
    if d.interval is None:
        return f"{side} (one seed, no interval)"
    if excludes_zero(d):
        return f"{side}, interval excludes 0"
    return f"{side} in the mean, interval includes 0"


def pm(s: Stat | None, digits: int = 2) -> str:
    """``mean ± std`` (just the mean for one seed; an em dash for none)."""
    if s is None or s.n == 0:
        return "—"
    if s.n == 1:
        return f"{s.mean:.{digits}f}"
    return f"{s.mean:.{digits}f} ± {s.std:.{digits}f}"


def signed(x: float, digits: int = 2) -> str:
    """``x`` with an explicit sign."""
    return f"{x:+.{digits}f}"


def ci_text(s: Stat | Unpaired | ItemPaired, digits: int = 2) -> str:
    """``[lo, hi]`` of the 95 % t interval of the mean (an em dash below two values)."""
    ci = s.interval
    return "—" if ci is None else f"[{signed(ci[0], digits)}, {signed(ci[1], digits)}]"


def p_text(p: float | None) -> str:
    """A p value to three decimals (``<0.001`` below that; an em dash for none)."""
    if p is None:
        return "—"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


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
    largest interval's drop (0: flat at the end; a run that starts on a plateau is measured
    against its fast drop, not its first interval). None with < 3 points."""
    c = [p[2] for p in rec["val_curve"]]
    steps = [abs(b - a) for a, b in itertools.pairwise(c)]
    if len(c) < 3 or not max(steps):
        return None
    return steps[-1] / max(steps)


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
    """Zero-shot accuracy per seed in percent (``task=None``: the average over tasks; seeds
    whose evaluation lacks ``task`` left out)."""
    vals = {}
    for s, r in (runs or {}).items():
        z = r.get("zeroshot")
        if z and (task is None or task in z["tasks"]):
            vals[s] = 100.0 * (z["average_acc"] if task is None else z["tasks"][task]["acc"])
    return Stat(vals)


def item_outcomes(runs: dict[int, dict[str, Any]] | None) -> dict[int, str]:
    """Per seed, the per-item outcomes of every task with saved items, tasks in name order
    (``"0110..."``; seeds without saved items left out)."""
    out = {}
    for s, r in (runs or {}).items():
        items = (r.get("zeroshot") or {}).get("items")
        if items:
            out[s] = "".join(items[t] for t in sorted(items))
    return out


def probe_stat(runs: dict[int, dict[str, Any]] | None, i: int) -> Stat:
    """The memory probe's gap (memory off minus on, nats) over seeds: ``i`` 0 at the training
    length, 1 at 4x it."""
    return Stat(
        {s: r["memory_probe"][i]["gap"] for s, r in (runs or {}).items() if r.get("memory_probe")}
    )


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p values of one family of tests, in the input order (None:
    not tested, left out of the family). Adjusted ``p_(i) = max_{j <= i} min(1, (m - j + 1)
    p_(j))`` over the tested p values sorted ascending (``m`` of them)."""
    tested = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        out[i] = running
    return out


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar test of one paired set of right/wrong outcomes: ``b`` items right
    only under one model, ``c`` right only under the other (the sign test on the discordant
    pairs; 1 when there are none)."""
    return sign_test_p(b, b + c) if b + c else 1.0


# Replicates and generator seed of the paired bootstrap over items and seeds (fixed: a rerun of
# the report gives the same interval).
BOOTSTRAP_REPS = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class ItemPaired:
    """Per-item outcomes (1 right, 0 wrong) of a configuration and its baseline on the same
    items, seed by seed: the accuracy difference ``config - base`` in percentage points, with a
    95 % percentile interval and a two-sided p value from a paired bootstrap that resamples the
    seeds and the items (both with replacement; the generator draws every replicate's seeds,
    then every replicate's items), so that the items all seeds share count as a source of
    variance."""

    config: dict[int, str]
    base: dict[int, str]

    @property
    def seeds(self) -> list[int]:
        """The seeds both sides have, with outcomes on the same number of items."""
        common = sorted(set(self.config) & set(self.base))
        return [s for s in common if len(self.config[s]) == len(self.base[s])]

    @property
    def n(self) -> int:
        """Number of paired seeds."""
        return len(self.seeds)

    @cached_property
    def _diffs(self) -> Any:
        import numpy as np

        def bits(x: str) -> Any:
            return np.frombuffer(x.encode(), dtype=np.uint8) - ord("0")

        return np.array(
            [bits(self.config[s]).astype(float) - bits(self.base[s]) for s in self.seeds]
        )

    @property
    def mean(self) -> float:
        """Mean accuracy difference over seeds and items, in percentage points."""
        return 100.0 * float(self._diffs.mean())

    @cached_property
    def _replicates(self) -> Any:
        import numpy as np

        d = self._diffs
        n_seeds, n_items = d.shape
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        seeds = rng.integers(0, n_seeds, (BOOTSTRAP_REPS, n_seeds))
        items = rng.integers(0, n_items, (BOOTSTRAP_REPS, n_items))

        def counts(draws: Any, n: int) -> Any:  # per replicate, how often each index is drawn
            flat = draws + n * np.arange(BOOTSTRAP_REPS)[:, None]
            return np.bincount(flat.ravel(), minlength=BOOTSTRAP_REPS * n).reshape(-1, n)

        # a replicate's mean over its drawn seeds x drawn items
        weighted = (counts(seeds, n_seeds) @ d) * counts(items, n_items)
        return 100.0 * weighted.sum(axis=1) / (n_seeds * n_items)

    @property
    def interval(self) -> tuple[float, float] | None:
        """95 % percentile interval of the bootstrap replicates (None without items)."""
        if not self.n:
            return None
        import numpy as np

        lo, hi = np.percentile(self._replicates, [2.5, 97.5])
        return float(lo), float(hi)

    @property
    def p(self) -> float | None:
        """Two-sided bootstrap p value of "no difference": twice the smaller share of
        replicates on either side of 0 (at least one replicate's worth), capped at 1."""
        if not self.n:
            return None
        r = self._replicates
        tail = min((r <= 0).sum(), (r >= 0).sum())
        return min(1.0, 2 * max(int(tail), 1) / BOOTSTRAP_REPS)

    def discordant(self, seed: int) -> tuple[int, int]:
        """``(b, c)`` of one seed: items right only under the configuration, only under the
        baseline (McNemar's discordant pairs)."""
        pairs = list(zip(self.config[seed], self.base[seed], strict=True))
        return pairs.count(("1", "0")), pairs.count(("0", "1"))
