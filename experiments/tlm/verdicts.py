"""The verdict table that opens RESULTS.md: each claim of the paper, reproduced / not reproduced
/ inconclusive, generated from the tests it rests on.

A claim is a family of comparisons, each with the direction the paper predicts (e.g. tapered
minus uniform perplexity below 0 in each architecture). The family's p values get Holm's
correction; a comparison is *confirmed* when its adjusted p is below :data:`ALPHA` in the
paper's direction and *contradicted* when it is below in the other. The claim is
``reproduced`` when every comparison is confirmed, ``not reproduced`` when any is contradicted,
``inconclusive`` otherwise (including a family with a comparison not run yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

from experiments.tlm import grid
from experiments.tlm.stats import (
    ItemPaired,
    Paired,
    Stat,
    ci_text,
    holm,
    item_outcomes,
    p_text,
    rho_stats,
    signed,
    zs_stat,
)
from experiments.tlm.tables import ppl_diffs

ALPHA = 0.05


class Estimate(Protocol):
    """What a comparison's test gives: the estimate, its 95 % interval and p value."""

    @property
    def n(self) -> int:
        """How many seeds the estimate pairs."""

    @property
    def mean(self) -> float:
        """The estimate."""

    @property
    def interval(self) -> tuple[float, float] | None:
        """Its 95 % interval (None: too few values)."""

    @property
    def p(self) -> float | None:
        """Its two-sided p value (None: too few values)."""


@dataclass(frozen=True)
class Comparison:
    """One test of a claim: ``est`` of ``label`` (in ``unit``), expected below 0
    (``expect`` -1) or above (+1) by the paper."""

    label: str
    est: Estimate
    expect: int
    unit: str = "ppl"
    digits: int = 2


@dataclass(frozen=True)
class Claim:
    """A paper claim, the test it rests on, and its family of comparisons."""

    claim: str
    test: str
    comparisons: list[Comparison]

    @property
    def adjusted(self) -> list[float | None]:
        """Holm-adjusted p values of the comparisons (None: not tested)."""
        return holm([c.est.p for c in self.comparisons])

    def outcomes(self) -> list[str]:
        """Per comparison ``confirmed`` | ``contradicted`` | ``open`` | ``not run``."""
        out = []
        for c, q in zip(self.comparisons, self.adjusted, strict=True):
            if q is None:
                out.append("not run")
            elif q < ALPHA and c.est.mean * c.expect > 0:
                out.append("confirmed")
            elif q < ALPHA and c.est.mean * c.expect < 0:
                out.append("contradicted")
            else:
                out.append("open")
        return out

    @property
    def verdict(self) -> str:
        """``reproduced`` | ``not reproduced`` | ``inconclusive`` | ``not measured``."""
        got = self.outcomes()
        if all(o == "not run" for o in got):
            return "not measured"
        if "contradicted" in got:
            return "not reproduced"
        if all(o == "confirmed" for o in got):
            return "reproduced"
        return "inconclusive"

    def numbers(self) -> str:
        """The comparisons' estimates, intervals, p and Holm-adjusted p, and the counts."""
        got = self.outcomes()
        tested = sum(o != "not run" for o in got)
        head = (
            f"{got.count('confirmed')} of {len(got)} confirmed, {got.count('contradicted')} "
            f"contradicted (Holm over {tested})"
        )
        parts = []
        for c, q in zip(self.comparisons, self.adjusted, strict=True):
            if q is None:
                parts.append(f"{c.label}: not run" if not c.est.n else f"{c.label}: one seed")
                continue
            unit = f" {c.unit}" if c.unit else ""
            parts.append(
                f"{c.label} {signed(c.est.mean, c.digits)}{unit} {ci_text(c.est, c.digits)}, "
                f"p {p_text(c.est.p)}, "
                f"Holm {p_text(q)}"
            )
        return head + ": " + "; ".join(parts)


def _seeds(comparisons: list[Comparison]) -> str:
    ns = sorted({c.est.n for c in comparisons if c.est.n})
    if not ns:
        return "no seeds yet"
    return f"{ns[0]}-{ns[-1]} seeds" if len(ns) > 1 else f"{ns[0]} seeds"


def _t_test(what: str, comparisons: list[Comparison]) -> str:
    return f"paired t over seeds ({_seeds(comparisons)}) of {what}; Holm within the family"


def claim_per_architecture(by: dict, second_corpus: bool = False) -> Claim:
    """(c): cosine 1.5/0.5 below uniform in each architecture (equal parameters), and with
    ``second_corpus`` also the Transformer on the (h) second corpus."""
    comps = []
    for a in grid.ARCHS:
        uni, cos, _ = grid.arch_variants(a)
        comps.append(Comparison(f"{a} Δ", ppl_diffs(by, cos, uni), -1))
    if second_corpus:
        uni, cos, _ = grid.experiment_variants("corpus")
        comps.append(
            Comparison(f"transformer on {grid.SECOND_CORPUS} Δ", ppl_diffs(by, cos, uni), -1)
        )
    where = " and on the second corpus (h)" if second_corpus else ""
    return Claim(
        "(c) Tapered (cosine 1.5/0.5) below uniform at equal parameters, in every architecture",
        _t_test(f"Δ validation ppl, tapered − uniform, per architecture{where}", comps),
        comps,
    )


def claim_three_groups(by: dict) -> Claim:
    """(a): wider-early < uniform < wider-middle < wider-late, as its three adjacent steps."""
    uni, early, middle, late = grid.experiment_variants("controlled")
    comps = [
        Comparison("early − uniform", ppl_diffs(by, early, uni), -1),
        Comparison("middle − uniform", ppl_diffs(by, middle, uni), +1),
        Comparison("late − middle", ppl_diffs(by, late, middle), +1),
    ]
    return Claim(
        "(a) Order of the three groups: wider-early < uniform < wider-middle < wider-late",
        _t_test("Δ validation ppl between neighbours in the paper's order", comps),
        comps,
    )


def claim_cosine_best(by: dict) -> Claim:
    """(b): at every ratio, cosine below linear and below sigmoid."""
    comps = []
    for r in grid.SWEEP_RATIOS:
        cos = grid.Variant("transformer", "cosine", r)
        for other in grid.SWEEP_SCHEDULES[1:]:
            d = ppl_diffs(by, cos, grid.Variant("transformer", other, r))
            comps.append(Comparison(f"{r[0]:g}/{r[1]:g} cosine − {other}", d, -1))
    return Claim(
        "(b) Cosine is the best schedule at every ratio",
        _t_test("Δ validation ppl, cosine − linear and cosine − sigmoid at each ratio", comps),
        comps,
    )


def claim_best_ratio(by: dict) -> Claim:
    """(b): cosine 1.5/0.5 below the cosine taper at each other ratio."""
    sched, best = grid.DEFAULT_TAPER
    top = grid.Variant("transformer", sched, best)
    comps = [
        Comparison(
            f"1.5/0.5 − {r[0]:g}/{r[1]:g}",
            ppl_diffs(by, top, grid.Variant("transformer", sched, r)),
            -1,
        )
        for r in grid.SWEEP_RATIOS
        if r != best
    ]
    return Claim(
        "(b) The best ratio is 1.5/0.5 (cosine)",
        _t_test("Δ validation ppl, cosine 1.5/0.5 − cosine at each other ratio", comps),
        comps,
    )


def claim_zeroshot(by: dict) -> Claim:
    """(f): tapered above uniform in average zero-shot accuracy in every architecture; on the
    per-item outputs where the runs saved them (paired bootstrap over items and seeds), else
    over seeds."""
    comps, items = [], True
    for a in grid.ARCHS:
        uni, cos, _ = grid.arch_variants(a)
        est: Estimate = ItemPaired(item_outcomes(by.get(cos.key)), item_outcomes(by.get(uni.key)))
        if not est.n:
            items = False
            est = Paired(zs_stat(by.get(cos.key)), zs_stat(by.get(uni.key))).diffs
        comps.append(Comparison(f"{a} Δ", est, +1, "points"))
    what = "Δ average accuracy (points), tapered − uniform, per architecture"
    test = (
        f"paired bootstrap over items and seeds ({_seeds(comps)}) of {what}; Holm within the family"
        if items
        else _t_test(what, comps) + "; all seeds answer the same items, which this test "
        "ignores (no per-item outputs saved; chance levels in (f))"
    )
    return Claim("(f) Zero-shot accuracy gains in every architecture", test, comps)


def rise(runs: list[Stat]) -> Stat:
    """Per seed, the mean ρ over the last third of the layers minus the mean over the first two
    thirds (``runs``: one :class:`Stat` per layer)."""
    if len(runs) < 3:
        return Stat({})
    cut = len(runs) * 2 // 3
    seeds = set.intersection(*(set(s.values) for s in runs))
    return Stat(
        {
            s: sum(x.values[s] for x in runs[cut:]) / (len(runs) - cut)
            - sum(x.values[s] for x in runs[:cut]) / cut
            for s in sorted(seeds)
        }
    )


def claim_alignment(by: dict) -> Claim:
    """(e): ρ_block rises in the late layers (last third above the first two thirds)."""
    comps = [
        Comparison(f"{v.label} rise", rise(rho_stats(by, v, "rho_block")), +1, "", 3)
        for v in grid.experiment_variants("alignment")
    ]
    return Claim(
        "(e) Late layers align with the residual stream (ρ_block rises in the last third)",
        _t_test(
            "ρ_block (mean over the last third of the layers − mean over the first two "
            "thirds), uniform and tapered Transformer",
            comps,
        ),
        comps,
    )


def claim_scale(by: dict) -> Claim:
    """(g): tapered below uniform at the second size, in each (g) architecture."""
    comps = []
    for a in grid.SCALE_ARCHS:
        uni, cos, _ = [v for v in grid.scale_variants(grid.SECOND) if v.arch == a]
        comps.append(Comparison(f"{a} Δ", ppl_diffs(by, cos, uni), -1))
    return Claim(
        "(g) The gain holds with scale: tapered below uniform at the second size",
        _t_test("Δ validation ppl, tapered − uniform at the second size, per architecture", comps),
        comps,
    )


def claims(by: dict, only: list[str]) -> list[Claim]:
    """The claims whose experiments ``only`` runs, in the paper's order."""
    builders = (
        ("archs", partial(claim_per_architecture, second_corpus="corpus" in only)),
        ("controlled", claim_three_groups),
        ("sweep", claim_cosine_best),
        ("sweep", claim_best_ratio),
        ("archs", claim_zeroshot),
        ("alignment", claim_alignment),
        ("scale", claim_scale),
    )
    return [build(by) for experiment, build in builders if experiment in only]


def verdict_section(by: dict, only: list[str]) -> list[str]:
    """The verdict table and the rule its words follow."""
    rows = [f"| {c.claim} | **{c.verdict}** | {c.test} | {c.numbers()} |" for c in claims(by, only)]
    if not rows:
        return []
    return [
        "## Verdicts",
        "",
        "Each claim of the paper is a family of paired comparisons, each with the direction the "
        "paper predicts; Δ is ours minus the reference, with its 95 % interval, p and the p "
        f"after Holm's correction within the family. A comparison is confirmed when its "
        f"adjusted p is below {ALPHA} in the paper's direction, contradicted when it is below "
        f"{ALPHA} in the other. The claim is reproduced when all its comparisons are confirmed, "
        "not reproduced when any is contradicted, inconclusive otherwise (also when a comparison "
        "is not run yet). At our scale inconclusive means the data cannot tell, not that the "
        "claim fails.",
        "",
        "| claim of the paper | verdict | test | our numbers |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
