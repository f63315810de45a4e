"""The Reading section of RESULTS.md: sentences generated from the numbers on what held
relative to the paper, in words that follow the 95 % intervals."""

from __future__ import annotations

from typing import Any

from experiments.tlm import grid
from experiments.tlm.stats import (
    ItemPaired,
    Stat,
    ci_text,
    direction,
    excludes_zero,
    holm,
    p_text,
    pm,
    ppl_stat,
    probe_stat,
    rho_stats,
    sign_test_p,
    signed,
    wilson,
    zs_stat,
)
from experiments.tlm.tables import (
    MEMORY_WORK_NATS,
    ScaleComparison,
    items_used,
    pooled,
    ppl_diffs,
    scale_comparisons,
    sweep_tapered,
    zeroshot_tasks,
)
from experiments.tlm.verdicts import Claim, claim_zeroshot


def verdict(d: Stat, expect_negative: bool) -> str:
    """How a paper claim "config is lower (better) / higher than uniform" fared in ours, from
    the paired differences ``d``, in words that follow the 95 % interval: shown, contradicted
    (the interval excludes 0 on the other side) or not shown (it includes 0)."""
    if d.n == 0:
        return "not measured"
    agrees = d.mean != 0 and (d.mean < 0) == expect_negative
    way = "the paper's direction" if agrees else "against the paper's direction"
    if d.interval is None:
        return f"{way} in one seed, no interval"
    if excludes_zero(d):
        return (
            "shown, interval excludes 0" if agrees else f"contradicted: {way}, interval excludes 0"
        )
    side = "the paper's" if agrees else "the other"
    return f"not shown: interval includes 0 (the mean points {side} way)"


def _diff_text(d: Stat) -> str:
    """A paired difference in words: its mean, and with two seeds or more its interval."""
    if not d.n:
        return "no seed in common with the baseline yet"
    if d.n < 2:
        return f"Δ {signed(d.mean)} ppl"
    return f"Δ {signed(d.mean)} ppl, 95 % CI {ci_text(d)}, p {p_text(d.p)}"


def _controlled_reading(by: dict) -> list[str]:
    """(a): our order of the wider thirds against the paper's and each step's verdict."""
    vs = grid.experiment_variants("controlled")
    names = {v: v.label.split(" ")[0] for v in vs}
    st = {v: ppl_stat(by.get(v.key)) for v in vs}
    if not all(s.n for s in st.values()):
        return []
    ranked = sorted(vs, key=lambda v: st[v].mean)
    paper = [vs[1], vs[0], vs[2], vs[3]]  # wider-early < uniform < middle < late
    swapped = [
        f"{names[a]} / {names[b]}"
        for i, a in enumerate(paper)
        for b in paper[i + 1 :]
        if ranked.index(a) > ranked.index(b)
    ]
    out = [
        "- (a) Controlled thirds. Paper (440M): wider-early < uniform < wider-middle < "
        f"wider-late. Ours, by mean perplexity: {' < '.join(names[v] for v in ranked)}"
        + (
            f" (in the reverse of the paper's order: {', '.join(swapped)})"
            if swapped
            else " (the paper's order)"
        )
        + "; in the verdict table, no step counts unless its Holm-adjusted p is below "
        "0.05."
    ]
    for v, neg, claim in zip(
        vs[1:],
        (True, False, False),
        ("beats", "is worse than", "is worse than"),
        strict=True,
    ):
        d = ppl_diffs(by, v, grid.UNIFORM)
        out.append(f'  - "{names[v]} {claim} uniform": {verdict(d, neg)} ({_diff_text(d)}).')
    return out


def _wins_per_ratio(by: dict, tapered: list[grid.Variant]) -> dict[str, int]:
    """Per (b) schedule, at how many ratios it has the lowest mean perplexity (ratios where
    every schedule of ``tapered`` has runs)."""
    wins = {s: 0 for s in grid.SWEEP_SCHEDULES}
    for r in grid.SWEEP_RATIOS:
        row = [v for v in tapered if v.ratio == r]
        if len(row) == len(grid.SWEEP_SCHEDULES):
            wins[min(row, key=lambda v: ppl_stat(by.get(v.key)).mean).schedule] += 1
    return wins


def _sweep_reading(by: dict) -> list[str]:
    """(b): how many tapered configurations beat uniform, before and after Holm, our best
    against the paper's, and the best schedule per ratio."""
    diffs = {v: ppl_diffs(by, v, grid.UNIFORM) for v in sweep_tapered() if by.get(v.key)}
    if not (diffs and by.get(grid.UNIFORM.key)):
        return []
    lower = [v for v, d in diffs.items() if d.n and d.mean < 0]
    sure = [v for v, d in diffs.items() if excludes_zero(d)]
    sure_lower = [v for v in sure if diffs[v].mean < 0]
    best = min(diffs, key=lambda v: ppl_stat(by.get(v.key)).mean)
    top = grid.Variant("transformer", *grid.DEFAULT_TAPER)
    adjusted = holm([d.p for d in diffs.values()])
    held = sum(q is not None and q < 0.05 for q in adjusted)
    cos = [v for v in diffs if v.schedule == "cosine"]
    wins = _wins_per_ratio(by, list(diffs))
    return [
        "- (b) Schedule sweep. Paper (440M): every cosine point beats uniform (16.28), the "
        "best is cosine 1.5/0.5 (14.44), and cosine is the best schedule at all five "
        f"ratios. Ours: {len(lower)} of {len(diffs)} tapered configurations have a lower "
        f"mean perplexity than uniform (cosine: {sum(v in lower for v in cos)} of "
        f"{len(cos)}); one at a time, {len(sure)} have a 95 % interval that excludes 0 "
        f"({len(sure_lower)} of them lower): with "
        f"{min(d.n for d in diffs.values())} seeds a single configuration is too noisy to "
        f"settle most comparisons, and after Holm's correction over the {len(diffs)} "
        f"comparisons {held} have an adjusted p below 0.05. Our best is {best.label} "
        f"({pm(ppl_stat(by.get(best.key)))} vs uniform "
        f"{pm(ppl_stat(by[grid.UNIFORM.key]))})"
        + (
            " as in the paper"
            if best == top
            else f", not the paper's cosine 1.5/0.5 ({pm(ppl_stat(by.get(top.key)))})"
        )
        + ". Lowest mean perplexity per ratio: "
        + ", ".join(f"{s} {n}x" for s, n in wins.items())
        + f" (the paper: cosine at all {len(grid.SWEEP_RATIOS)})."
    ]


def _archs_reading(by: dict) -> list[str]:
    """(c): each architecture's taper and reverse against its uniform model in validation
    perplexity, and the memory probe."""
    lines = []
    for a in grid.ARCHS:
        uni, cos, rev = grid.arch_variants(a)
        if by.get(uni.key) and by.get(cos.key):
            d = ppl_diffs(by, cos, uni)
            text = f"  - {a}: cosine 1.5/0.5 vs uniform: {verdict(d, True)} ({_diff_text(d)})"
            if by.get(rev.key):
                q = ppl_diffs(by, rev, uni)
                text += f"; reverse vs uniform: {verdict(q, False)} ({_diff_text(q)})"
            lines.append(text + ".")
        elif not any(by.get(v.key) for v in (uni, cos, rev)):
            lines.append(f"  - {a}: no run finished yet (its rows are dashes).")
    out = []
    if lines:
        out.append(
            "- (c) Architectures. The paper's claim here is zero-shot accuracy (tapered above "
            "uniform in 8/8 cases, the reverse taper hurting), tested in (f) and its Reading "
            "line below; what follows is our validation perplexity, which the paper does not "
            "report for (c):"
        )
        out += lines
    return out + _probe_reading(by)


def _pooled_reading(by: dict, only: list[str]) -> list[str]:
    """The pooled rows in words: pairs below and above 0, with their sign and t tests."""
    rows = pooled(by, only)
    if not rows:
        return []
    out = ["- Pooled over configurations (table above):"]
    for e in rows:
        d = e["diffs"]
        lower = sum(x < 0 for x in d.values.values())
        higher = sum(x > 0 for x in d.values.values())
        text = f"  - {e['what']}: {lower} of {d.n} lower, {higher} higher"
        if e["test"]:
            text += (
                f" (sign test p {p_text(sign_test_p(lower, lower + higher))}); paired t over "
                f"the {e['unit']}: {direction(d)} ({_diff_text(d)})"
            )
        else:
            text += "; they share the uniform runs, so this count is not a test"
        out.append(text + ".")
    return out


def _scale_reading(by: dict) -> list[str]:
    """(g): each comparison's direction at both sizes and how its relative effect moves."""
    lines = []
    for c in scale_comparisons(by):
        d1, d2 = c.ppl
        if not (d1.n or d2.n):
            continue
        text = f"  - {c.arch}, {c.what}: {direction(d1)} / "
        if not d2.n:
            lines.append(text + "not run yet.")
            continue
        p1, p2 = c.pct
        lines.append(
            text + f"{direction(d2)}{_vanished(c)}; relative to uniform {signed(p1.mean)} % / "
            f"{signed(p2.mean)} %, second minus first {signed(c.change.mean)} points: "
            f"{c.trend}."
        )
    if not lines:
        return []
    return ["- (g) Scale, Δ perplexity vs uniform at the first size / the second:", *lines]


def _alignment_reading(by: dict) -> list[str]:
    """(e): whether ρ_block rises in the last layer above the first two thirds' range."""
    out = []
    for v in grid.experiment_variants("alignment"):
        rb = rho_stats(by, v, "rho_block")
        if len(rb) >= 3:
            early = [s.mean for s in rb[: len(rb) * 2 // 3]]
            late = rb[-1].mean
            rises = late > max(early)
            out.append(
                f"- (e) Alignment, {v.label} Transformer: ρ_block over the first two thirds of "
                f"the layers ranges {min(early):.3f}..{max(early):.3f}, last layer {late:.3f}: "
                + (
                    "the late rise the paper describes is there."
                    if rises
                    else "the paper's late rise is not there."
                )
            )
    return out


def _zeroshot_gains(claim: Claim) -> tuple[int, int, dict[str, list[str]]]:
    """(f): the architectures whose taper is above uniform in mean average accuracy, those
    with an average, and those whose paired interval excludes 0 on each side, from the
    verdict's comparisons (over items and seeds where the runs saved per-item outputs)."""
    up = total = 0
    sure: dict[str, list[str]] = {"above": [], "below": []}
    for a, c in zip(grid.ARCHS, claim.comparisons, strict=True):
        if c.est.n:
            total += 1
            up += c.est.mean > 0
            if excludes_zero(c.est):
                sure["above" if c.est.mean > 0 else "below"].append(a)
    return up, total, sure


def _near_chance(
    by: dict, records: list[dict[str, Any]], info: dict[str, dict[str, Any]]
) -> tuple[int, int]:
    """(f): how many per-task accuracies have a Wilson interval that includes the task's
    chance level, of how many measured."""
    tasks = [t for t in zeroshot_tasks(records) if t in info]
    near = cells = 0
    for v in grid.experiment_variants("archs"):
        for t in tasks:
            st = zs_stat(by.get(v.key), t)
            if st.n:
                lo, hi = wilson(st.mean / 100, items_used(records, t))
                cells += 1
                near += lo <= info[t]["chance"] <= hi
    return near, cells


def _zeroshot_reading(
    by: dict, records: list[dict[str, Any]], info: dict[str, dict[str, Any]]
) -> list[str]:
    """(f): tapered against uniform in zero-shot accuracy, accuracies near chance, and the
    verdict table's outcome."""
    claim = claim_zeroshot(by)
    up, total, sure = _zeroshot_gains(claim)
    near, cells = _near_chance(by, records, info)
    items = all(isinstance(c.est, ItemPaired) for c in claim.comparisons)
    over = "items and seeds" if items else "seeds"
    return [
        f"- (f) Zero-shot: tapered above uniform in mean average accuracy for {up} of {total} "
        f"architectures (paper: 8/8 at 760M/1.3B); the paired 95 % interval over {over} "
        "excludes 0 for "
        + " and ".join(
            f"{len(names)} {side}" + (f" ({', '.join(names)})" if names else "")
            for side, names in sure.items()
        )
        + f". {near} of {cells} per-task accuracies have a Wilson interval that includes the "
        "task's chance level (first row of (f)). " + _claim_sentence(claim)
    ]


def reading(
    by: dict, records: list[dict[str, Any]], only: list[str], info: dict[str, dict[str, Any]]
) -> list[str]:
    """Plain-language sentences, generated from the numbers, on what held relative to the paper."""
    out: list[str] = []
    if "controlled" in only:
        out += _controlled_reading(by)
    if "sweep" in only:
        out += _sweep_reading(by)
    if "archs" in only:
        out += _archs_reading(by)
    out += _pooled_reading(by, only)
    if "archs" in only or "scale" in only:
        out += _scale_reading(by)
    if "alignment" in only:
        out += _alignment_reading(by)
    if "archs" in only and any(r.get("zeroshot") for r in records):
        out += _zeroshot_reading(by, records, info)
    return out or ["- No finished runs yet."]


def _claim_sentence(c: Claim) -> str:
    """The verdict table's outcome of claim ``c`` in one sentence."""
    got = c.outcomes()
    return (
        f"With Holm's correction over its {len(got)} comparisons (the verdict table): "
        f"{got.count('confirmed')} confirmed, {got.count('contradicted')} contradicted, so "
        f"{c.verdict}."
    )


def _vanished(c: ScaleComparison) -> str:
    """`` (shown at the first size, not at the second: ...)`` where the first size's interval
    excludes 0 and the second's does not, with whether the second size's relative interval
    excludes the first size's relative effect ("" otherwise)."""
    (d1, d2), (p1, p2) = c.ppl, c.pct
    if not (excludes_zero(d1) and d2.interval is not None and not excludes_zero(d2)):
        return ""
    lo, hi = p2.interval or (p2.mean, p2.mean)
    outside = not lo <= p1.mean <= hi
    return (
        f" (shown at the first size, not at the second: Δ {signed(d2.mean)} ppl {ci_text(d2)}; "
        f"the second size's relative interval {ci_text(p2)} % "
        + ("excludes" if outside else "includes")
        + f" the first size's {signed(p1.mean)} %)"
    )


def _probe_reading(by: dict) -> list[str]:
    """The memory probe of (c)'s memory architectures against :data:`MEMORY_WORK_NATS`."""
    parts, reach = [], []
    for a in grid.MEMORY_ARCHS:
        configs = [by.get(v.key) for v in grid.arch_variants(a)]
        short = [s for s in (probe_stat(c, 0) for c in configs) if s.n]
        if not short:
            continue
        runs = [x for s in short for x in s.values.values()]
        means = sorted(s.mean for s in short)
        far = sorted(s.mean for s in (probe_stat(c, 1) for c in configs) if s.n)
        parts.append(
            f"{a} {means[0]:.3f}-{means[-1]:.3f} nats at the training length "
            f"({sum(x > 0 for x in runs)} of {len(runs)} runs above 0) and "
            f"{far[0]:.3f}-{far[-1]:.3f} at 4x it"
        )
        reach.append(
            f"{a} in {sum(m >= MEMORY_WORK_NATS for m in means)} of {len(means)} "
            f"configurations ({sum(x >= MEMORY_WORK_NATS for x in runs)} of {len(runs)} runs)"
        )
    if not parts:
        return []
    return [
        "  - Memory probe ((c), the budget table): switching the in-context memory off costs, "
        f"in the configurations' means, {'; '.join(parts)}. A memory counts as doing "
        f"measurable work from {MEMORY_WORK_NATS} nats: {', '.join(reach)} reach it."
    ]
