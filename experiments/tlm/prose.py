"""The Reading section of RESULTS.md: sentences generated from the numbers on what held
relative to the paper, in words that follow the 95 % intervals."""

from __future__ import annotations

from typing import Any

from experiments.tlm import grid
from experiments.tlm.stats import (
    Paired,
    Stat,
    ci_text,
    direction,
    excludes_zero,
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
    items_used,
    pooled,
    ppl_diffs,
    scale_comparisons,
    sweep_tapered,
    zeroshot_tasks,
)


def verdict(d: Stat, expect_negative: bool) -> str:
    """How a paper claim "config is lower (better) / higher than uniform" fared in ours, from
    the paired differences ``d``: the claim's direction, then what the interval says."""
    if d.n == 0:
        return "not measured"
    agrees = d.mean != 0 and (d.mean < 0) == expect_negative
    return ("in the paper's direction: " if agrees else "not the paper's direction: ") + (
        direction(d)
    )


def _diff_text(d: Stat) -> str:
    if d.n < 2:
        return f"Δ {signed(d.mean)} ppl"
    return f"Δ {signed(d.mean)} ppl, 95 % CI {ci_text(d)}, p {p_text(d.p)}"


def reading(
    by: dict, records: list[dict[str, Any]], only: list[str], info: dict[str, dict[str, Any]]
) -> list[str]:
    """Plain-language sentences, generated from the numbers, on what held relative to the paper."""
    out: list[str] = []
    if "controlled" in only:
        vs = grid.experiment_variants("controlled")
        names = {v: v.label.split(" ")[0] for v in vs}
        st = {v: ppl_stat(by.get(v.key)) for v in vs}
        if all(s.n for s in st.values()):
            order = " < ".join(names[v] for v in sorted(vs, key=lambda v: st[v].mean))
            out.append(
                "- (a) Controlled thirds. Paper (440M): wider-early < uniform < wider-middle < "
                f"wider-late. Ours, by mean perplexity: {order}."
            )
            for v, neg, claim in zip(
                vs[1:],
                (True, False, False),
                ("beats", "is worse than", "is worse than"),
                strict=True,
            ):
                d = ppl_diffs(by, v, grid.UNIFORM)
                out.append(
                    f'  - "{names[v]} {claim} uniform": {verdict(d, neg)} ({_diff_text(d)}).'
                )
    if "sweep" in only:
        diffs = {v: ppl_diffs(by, v, grid.UNIFORM) for v in sweep_tapered() if by.get(v.key)}
        if diffs and by.get(grid.UNIFORM.key):
            lower = [v for v, d in diffs.items() if d.n and d.mean < 0]
            sure = [v for v, d in diffs.items() if excludes_zero(d)]
            sure_lower = [v for v in sure if diffs[v].mean < 0]
            best = min(diffs, key=lambda v: ppl_stat(by.get(v.key)).mean)
            cos = [v for v in diffs if v.schedule == "cosine"]
            wins = {s: 0 for s in grid.SWEEP_SCHEDULES}
            for r in grid.SWEEP_RATIOS:
                row = [v for v in diffs if v.ratio == r]
                if len(row) == len(grid.SWEEP_SCHEDULES):
                    wins[min(row, key=lambda v: ppl_stat(by.get(v.key)).mean).schedule] += 1
            out.append(
                "- (b) Schedule sweep. Paper (440M): every cosine point beats uniform (16.28), the "
                "best is cosine 1.5/0.5 (14.44), and cosine is the best schedule at all five "
                f"ratios. Ours: {len(lower)} of {len(diffs)} tapered configurations have a lower "
                f"mean perplexity than uniform (cosine: {sum(v in lower for v in cos)} of "
                f"{len(cos)}); one at a time, {len(sure)} have a 95 % interval that excludes 0 "
                f"({len(sure_lower)} of them lower): with "
                f"{min(d.n for d in diffs.values())} seeds a single configuration is too noisy to "
                "settle most comparisons. Our best is "
                f"{best.label} ({pm(ppl_stat(by.get(best.key)))} vs uniform "
                f"{pm(ppl_stat(by[grid.UNIFORM.key]))}). Lowest mean perplexity per ratio: "
                + ", ".join(f"{s} {n}x" for s, n in wins.items())
                + "."
            )
    if "archs" in only:
        lines = []
        for a in grid.ARCHS:
            uni, cos, rev = [v for v in grid.experiment_variants("archs") if v.arch == a]
            if by.get(uni.key) and by.get(cos.key):
                d = ppl_diffs(by, cos, uni)
                text = f"  - {a}: cosine 1.5/0.5 vs uniform {verdict(d, True)} ({_diff_text(d)})"
                if by.get(rev.key):
                    q = ppl_diffs(by, rev, uni)
                    text += f"; reverse vs uniform {verdict(q, False)} ({_diff_text(q)})"
                lines.append(text + ".")
            elif not any(by.get(v.key) for v in (uni, cos, rev)):
                lines.append(f"  - {a}: no run finished yet (its rows are dashes).")
        if lines:
            out.append(
                "- (c) Architectures (validation perplexity; the paper reports zero-shot accuracy "
                "here, tapered above uniform in 8/8 cases, and that the reverse taper hurts):"
            )
            out += lines
        out += _probe_reading(by)
    rows = pooled(by, only)
    if rows:
        out.append("- Pooled over configurations (table above):")
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
    if "archs" in only or "scale" in only:
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
                text + f"{direction(d2)}; relative to uniform {signed(p1.mean)} % / "
                f"{signed(p2.mean)} %, second minus first {signed(c.change.mean)} points: "
                f"{c.trend}."
            )
        if lines:
            out.append("- (g) Scale, Δ perplexity vs uniform at the first size / the second:")
            out += lines
    if "alignment" in only:
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
    if "archs" in only and any(r.get("zeroshot") for r in records):
        up = total = 0
        sure: dict[str, list[str]] = {"above": [], "below": []}
        for a in grid.ARCHS:
            uni, cos, _ = [v for v in grid.experiment_variants("archs") if v.arch == a]
            d = Paired(zs_stat(by.get(cos.key)), zs_stat(by.get(uni.key))).diffs
            if d.n:
                total += 1
                up += d.mean > 0
                if excludes_zero(d):
                    sure["above" if d.mean > 0 else "below"].append(a)
        tasks = [t for t in zeroshot_tasks(records) if t in info]
        near = cells = 0
        for v in grid.experiment_variants("archs"):
            for t in tasks:
                st = zs_stat(by.get(v.key), t)
                if st.n:
                    lo, hi = wilson(st.mean / 100, items_used(records, t))
                    cells += 1
                    near += lo <= info[t]["chance"] <= hi
        out.append(
            f"- (f) Zero-shot: tapered above uniform in mean average accuracy for {up} of {total} "
            f"architectures (paper: 8/8 at 760M/1.3B); the paired 95 % interval excludes 0 for "
            + " and ".join(
                f"{len(names)} {side}" + (f" ({', '.join(names)})" if names else "")
                for side, names in sure.items()
            )
            + f". {near} of {cells} per-task accuracies have a Wilson interval that includes the "
            "task's chance level (first row of (f))."
        )
    return out or ["- No finished runs yet."]


def _probe_reading(by: dict) -> list[str]:
    """The memory probe of (c)'s memory architectures against :data:`MEMORY_WORK_NATS`."""
    parts, reach = [], []
    for a in grid.MEMORY_ARCHS:
        configs = [by.get(v.key) for v in grid.experiment_variants("archs") if v.arch == a]
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
        reach.append(f"{a} in {sum(m >= MEMORY_WORK_NATS for m in means)} of {len(means)}")
    if not parts:
        return []
    return [
        "  - Memory probe ((c), the budget table): switching the in-context memory off costs, "
        f"in the configurations' means, {'; '.join(parts)}. A memory counts as doing "
        f"measurable work from {MEMORY_WORK_NATS} nats: {', '.join(reach)} configurations reach it."
    ]
