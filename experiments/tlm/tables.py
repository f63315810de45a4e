"""The Markdown tables (a), (b), (c), (e), (f), (g) and the pooled comparisons of RESULTS.md,
beside the paper's figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from experiments.tlm import grid
from experiments.tlm.stats import (
    ItemPaired,
    Paired,
    Stat,
    Unpaired,
    ci_text,
    direction,
    excludes_zero,
    item_outcomes,
    mcnemar_p,
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

# The paper's 440M validation perplexities (arXiv 2606.23670).
PAPER_CONTROLLED = {
    "uniform": 16.28,
    "wider-early": 15.96,
    "wider-middle": 16.61,
    "wider-late": 17.29,
}


PAPER_SWEEP = {
    (1.25, 0.75): (15.18, 15.96, 16.44),
    (1.375, 0.625): (14.59, 15.80, 16.44),
    (1.5, 0.5): (14.44, 15.96, 16.12),
    (1.625, 0.375): (14.59, 15.64, 15.96),
    (1.75, 0.25): (15.49, 16.28, 17.12),
}


# 760M, average zero-shot accuracy, uniform -> tapered (the two the spec quotes).
PAPER_ZEROSHOT = {"titans": (52.30, 53.29), "transformer": (52.25, 52.84)}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def delta_cells(d: Stat) -> list[str]:
    """Δ mean, its 95 % interval, p and the words for paired differences ``d``."""
    if d.n == 0:
        return ["—", "—", "—", "—"]
    return [signed(d.mean), ci_text(d), p_text(d.p), direction(d)]


def _compare_cells(v: grid.Variant, by: dict, base_key: str) -> list[str]:
    st = ppl_stat(by.get(v.key))
    seeds = ", ".join(f"{x:.2f}" for _, x in sorted(st.values.items())) or "—"
    if v.key == base_key or st.n == 0:
        return [pm(st), seeds, "—", "—", "—", "—"]
    return [pm(st), seeds, *delta_cells(Paired(st, ppl_stat(by.get(base_key))).diffs)]


DELTA_HEADER = ["Δ vs uniform (paired)", "95 % CI of Δ", "p", "reading"]


def compare_header(scale: str) -> list[str]:
    """Headers of the six comparison columns."""
    return [f"ours ({scale}): val ppl", "per seed", *DELTA_HEADER]


def _widths(by: dict, v: grid.Variant, planned: dict[str, list[int]]) -> str:
    runs = by.get(v.key)
    widths = next(iter(runs.values()))["widths"] if runs else planned.get(v.key)
    if not widths:
        return "—"
    groups: list[list[int]] = []
    for w in widths:
        if groups and groups[-1][0] == w:
            groups[-1][1] += 1
        else:
            groups.append([w, 1])
    return "/".join(f"{w}" if n == 1 else f"{w}×{n}" for w, n in groups)


def table_controlled(by: dict, scale: str, planned: dict[str, list[int]]) -> list[str]:
    """(a): uniform vs wider-early/middle/late (``planned``: widths by variant when not run)."""
    rows = []
    for v in grid.experiment_variants("controlled"):
        name = v.label.split(" ")[0]
        rows.append([v.label, _widths(by, v, planned), f"{PAPER_CONTROLLED[name]:.2f}"])
        rows[-1] += _compare_cells(v, by, grid.UNIFORM.key)
    head = ["configuration", f"d_ff per layer ({scale})", "paper 440M ppl"]
    return _table(head + compare_header(scale), rows)


def table_sweep(by: dict, scale: str) -> list[str]:
    """(b): schedule x ratio pair."""
    rows = [["uniform", "—", "16.28", *_compare_cells(grid.UNIFORM, by, grid.UNIFORM.key)]]
    for r in grid.SWEEP_RATIOS:
        for i, s in enumerate(grid.SWEEP_SCHEDULES):
            v = grid.Variant("transformer", s, r)
            rows.append([s, f"{r[0]:g}/{r[1]:g}", f"{PAPER_SWEEP[r][i]:.2f}"])
            rows[-1] += _compare_cells(v, by, grid.UNIFORM.key)
    return _table(["schedule", "ratio", "paper 440M ppl", *compare_header(scale)], rows)


def table_archs(by: dict, scale: str) -> list[str]:
    """(c): four architectures x {uniform, cosine 1.5/0.5, reverse}."""
    rows = []
    for v in grid.experiment_variants("archs"):
        base = grid.Variant(v.arch).key
        rows.append([v.arch, v.label, *_compare_cells(v, by, base)])
    return _table(["architecture", "configuration", *compare_header(scale)], rows)


def table_corpus(by: dict, scale: str) -> list[str]:
    """(h): the second corpus's uniform, cosine 1.5/0.5 and reverse Transformer."""
    vs = grid.experiment_variants("corpus")
    rows = [[v.arch, v.label, *_compare_cells(v, by, vs[0].key)] for v in vs]
    return _table(["architecture", "configuration", *compare_header(scale)], rows)


def table_alignment(by: dict) -> list[str]:
    """(e): per-layer rho_block and rho_mlp of the uniform and tapered Transformer."""
    uni, tap = grid.experiment_variants("alignment")
    cols = [rho_stats(by, uni, "rho_block"), rho_stats(by, tap, "rho_block")]
    cols += [rho_stats(by, uni, "rho_mlp"), rho_stats(by, tap, "rho_mlp")]
    n = max(len(c) for c in cols)
    rows = [[str(i)] + [pm(c[i], 3) if i < len(c) else "—" for c in cols] for i in range(n)]
    head = ["layer", "uniform ρ_block", "tapered ρ_block", "uniform ρ_mlp", "tapered ρ_mlp"]
    return _table(head, rows)


def zeroshot_tasks(records: list[dict[str, Any]]) -> list[str]:
    """The zero-shot task names any record has, sorted."""
    return sorted({t for r in records if r.get("zeroshot") for t in r["zeroshot"]["tasks"]})


def items_used(records: list[dict[str, Any]], task: str) -> int:
    """The fewest items of ``task`` any run's zero-shot evaluation of it used."""
    return min(
        r["zeroshot"]["tasks"][task]["n"]
        for r in records
        if task in (r.get("zeroshot") or {}).get("tasks", {})
    )


def table_zeroshot(
    by: dict, records: list[dict[str, Any]], info: dict[str, dict[str, Any]], scale: str
) -> list[str]:
    """(f): average zero-shot accuracy (percent) of the (c) models, each task's accuracy with
    its Wilson interval on the items used, and a first row with the chance levels."""
    tasks = zeroshot_tasks(records)
    n = {t: items_used(records, t) for t in tasks}
    chance = [100 * info[t]["chance"] for t in tasks if t in info]
    rows = [
        [
            "chance level",
            "—",
            "—",
            f"{sum(chance) / len(chance):.2f}" if len(chance) == len(tasks) else "—",
            *["—"] * 4,
            *(f"{100 * info[t]['chance']:.1f}" if t in info else "—" for t in tasks),
        ]
    ]
    for v in grid.experiment_variants("archs"):
        st = zs_stat(by.get(v.key))
        base = zs_stat(by.get(grid.Variant(v.arch).key))
        paper = PAPER_ZEROSHOT.get(v.arch)
        ref = "—"
        if paper and v.schedule == "uniform":
            ref = f"{paper[0]:.2f}"
        elif paper and not v.reverse:
            ref = f"{paper[1]:.2f}"
        if v.schedule == "uniform" or st.n == 0:
            delta = ["—"] * 4
        else:
            delta = delta_cells(Paired(st, base).diffs)
        per_task = []
        for t in tasks:
            ts = zs_stat(by.get(v.key), t)
            if ts.n == 0:
                per_task.append("—")
                continue
            lo, hi = wilson(ts.mean / 100, n[t])
            per_task.append(f"{pm(ts, 1)} [{100 * lo:.1f}, {100 * hi:.1f}]")
        rows.append([v.arch, v.label, ref, pm(st), *delta, *per_task])
    head = ["architecture", "configuration", "paper 760M avg acc", f"ours ({scale}) avg acc"]
    return _table([*head, *DELTA_HEADER, *(f"{t} [95 % CI]" for t in tasks)], rows)


def table_zeroshot_items(by: dict) -> list[str]:
    """(f) on the per-item outputs: tapered and reverse against uniform, per architecture, over
    every item of the tasks with saved items and the seeds both have (paired bootstrap over
    items and seeds), and per seed the exact McNemar test on the discordant items."""
    rows = []
    for v in grid.experiment_variants("archs"):
        if v.schedule == "uniform":
            continue
        d = ItemPaired(
            item_outcomes(by.get(v.key)), item_outcomes(by.get(grid.Variant(v.arch).key))
        )
        if not d.n:
            rows.append([v.arch, v.label, "—", "—", "—", "—", "—", "—"])
            continue
        tests = [(d.discordant(s), s) for s in d.seeds]
        better = sum(b > c and mcnemar_p(b, c) < 0.05 for (b, c), _ in tests)
        worse = sum(c > b and mcnemar_p(b, c) < 0.05 for (b, c), _ in tests)
        items = len(d.config[d.seeds[0]])
        rows.append(
            [
                v.arch,
                v.label,
                f"{d.n} × {items}",
                signed(d.mean),
                ci_text(d),
                p_text(d.p),
                direction(d),
                f"{better} / {worse} of {d.n}",
            ]
        )
    head = ["architecture", "configuration", "seeds × items", "Δ acc vs uniform (points)"]
    head += ["95 % CI (bootstrap)", "p (bootstrap)", "reading"]
    return _table([*head, "seeds with McNemar p < 0.05: better / worse"], rows)


def have_items(records: list[dict[str, Any]]) -> bool:
    """Whether any run saved per-item zero-shot outputs."""
    return any((r.get("zeroshot") or {}).get("items") for r in records)


# (c)'s architectures as implemented here: what each adds to or changes from its paper, one line.
ARCH_NOTES = {
    "transformer": "Transformer++ (RMSNorm, SwiGLU, RoPE), as the paper.",
    "gated_attention": "G1 sigmoid output gate per head (Qiu et al. 2025); the MLP width shrunk "
    "to give the gate's parameters back.",
    "titans": "MAG: sliding-window attention with 4 persistent tokens, the memory rule re-derived "
    "from the paper's equations; ours: chunk-start (mini-batch) gradients, each token's memory "
    "step normalised by the memory's curvature along its error (NLMS, no per-token clip), the "
    "step size capped at 0.1 and the outer gradient cut every 16 chunks (64 tokens) at the cpu "
    "scale, forgetting half-lives spread over heads; the MLP width shrunk to give the memory "
    "branch's parameters back.",
    "hope_attention": "attention + a Continuum Memory System of SwiGLU levels splitting the MLP "
    "width; ours: updates inside the sequence at period boundaries, every level taught by the "
    "final layer's error signal (teach; not each level's own), normalised, clipped steps; "
    "1.7-2.1x the transformer's training FLOPs per token at equal parameters.",
}


def _against(r: dict, ref: dict | None, key: str) -> str:
    """`` (1.02x)``: ``r[key]`` over the transformer's ``ref[key]`` where that was recorded."""
    return f" ({r[key] / ref[key]:.2f}x)" if ref and key in ref else ""


# The memory probe's gap (nats) from which an in-context memory counts as doing measurable work.
MEMORY_WORK_NATS = 0.02


def _probe(runs: dict | None, i: int) -> str:
    return pm(probe_stat(runs, i), 3)


def table_budget_and_memory(by: dict, scale: str) -> list[str]:
    """(c)'s budgets and memory probe: per configuration its parameters and training FLOPs per
    token (as run, and against the transformer's of the same configuration), its validation
    perplexity and, for the memory architectures, what switching the in-context memory off at
    evaluation costs (nats; at the training length and at 4x it)."""
    rows = []
    for v in grid.experiment_variants("archs"):
        runs = by.get(v.key)
        ref = by.get(grid.Variant("transformer", v.schedule, v.ratio, v.reverse).key)
        r = next(iter(runs.values())) if runs else None
        r0 = next(iter(ref.values())) if ref else None
        if r is None or "params" not in r:
            rows.append([v.arch, v.label, "—", "—", pm(ppl_stat(runs)), "—", "—"])
            continue
        mem, flops = v.arch in grid.MEMORY_ARCHS, "train_flops_per_token"
        rows.append(
            [
                v.arch,
                v.label,
                f"{r['params'] / 1e6:.3f}M{_against(r, r0, 'params')}",
                f"{r[flops] / 1e6:.1f}M{_against(r, r0, flops)}",
                pm(ppl_stat(runs)),
                _probe(runs, 0) if mem else "—",
                _probe(runs, 1) if mem else "—",
            ]
        )
    head = ["architecture", "configuration", "params", "train FLOPs/token"]
    head += [f"val ppl ({scale})", "memory off − on (nats)", "at 4x the sequence"]
    return _table(head, rows)


def _delta_summary(d: Stat) -> str:
    if d.n == 0:
        return "not run yet"
    if d.n == 1:
        return f"{signed(d.mean)} (1 seed)"
    return f"{signed(d.mean)} {ci_text(d)}, p {p_text(d.p)} ({d.n} seeds)"


@dataclass(frozen=True)
class ScaleComparison:
    """One (g) comparison of an architecture's taper against its uniform model at both sizes:
    the paired per-seed differences in perplexity and in percent of the uniform perplexity."""

    arch: str
    what: str
    ppl: tuple[Stat, Stat]
    pct: tuple[Stat, Stat]

    @property
    def change(self) -> Unpaired:
        """The relative effect at the second size minus at the first, in percentage points."""
        return Unpaired(self.pct[1], self.pct[0])

    @property
    def trend(self) -> str:
        """How the relative effect moves from the first size to the second, in words that
        follow the interval of the change."""
        first, second = self.pct
        if min(first.n, second.n) < 2:
            return "one seed at a size, no interval"
        if (first.mean < 0) != (second.mean < 0):
            word = "changes sign"
        else:
            word = "grows" if abs(second.mean) > abs(first.mean) else "shrinks"
        if excludes_zero(self.change):
            return f"the effect {word}, interval of the change excludes 0"
        return f"the effect {word} in the mean, interval of the change includes 0"


def scale_size_names(records: list[dict[str, Any]]) -> tuple[str, str]:
    """The (g) sizes in words (``d_model 128, 6 layers``), first and second, from the runs of
    the (g) architectures ("first size" / "second size" before any has finished)."""
    names = []
    for big, fallback in ((False, "first size"), (True, "second size")):
        rec = next(
            (
                r
                for r in records
                if bool(r.get("size")) == big
                and r["arch"] in grid.SCALE_ARCHS
                and not r.get("corpus")
            ),
            None,
        )
        m = rec["model"] if rec else None
        names.append(f"d_model {m['d_model']}, {m['layers']} layers" if m else fallback)
    return names[0], names[1]


def scale_comparisons(by: dict) -> list[ScaleComparison]:
    """(g): cosine 1.5/0.5 and reverse vs uniform for each (g) architecture, at both sizes."""
    out = []
    for a in grid.SCALE_ARCHS:
        small = [v for v in grid.scale_variants("") if v.arch == a]
        large = [v for v in grid.scale_variants(grid.SECOND) if v.arch == a]
        for i, what in ((1, "cosine 1.5/0.5"), (2, "reverse")):
            ppl = tuple(ppl_diffs(by, vs[i], vs[0]) for vs in (small, large))
            pct = tuple(ppl_change_pct(by, vs[i], vs[0]) for vs in (small, large))
            out.append(ScaleComparison(a, what, ppl, pct))
    return out


def table_scale(by: dict, sizes: tuple[str, str]) -> list[str]:
    """(g): the paired Δ perplexity of cosine 1.5/0.5 and reverse vs uniform, each (g)
    architecture at both sizes side by side (``sizes``: the two column names)."""
    rows = [
        [c.arch, f"{c.what} vs uniform", *map(_delta_summary, c.ppl)] for c in scale_comparisons(by)
    ]
    head = ["architecture", "comparison"]
    return _table([*head, *(f"Δ val ppl, {s}: mean [95 % CI], p" for s in sizes)], rows)


def table_scale_relative(by: dict, sizes: tuple[str, str]) -> list[str]:
    """(g): the same comparisons in percent of the uniform model's perplexity at each size, and
    the change of that relative effect from the first size to the second (Welch interval)."""
    rows = []
    for c in scale_comparisons(by):
        ch = c.change
        if ch.n == 0:
            change = "not run yet"
        elif ch.n == 1:
            change = f"{signed(ch.mean)} (1 seed at a size)"
        else:
            change = f"{signed(ch.mean)} {ci_text(ch)}, p {p_text(ch.p)}"
        trend = c.trend if ch.n else "—"
        rows.append([c.arch, f"{c.what} vs uniform", *map(_delta_summary, c.pct), change, trend])
    head = ["architecture", "comparison"]
    head += [f"Δ % of uniform ppl, {s}: mean [95 % CI], p" for s in sizes]
    head += ["second − first (points): mean [95 % CI], p", "reading"]
    return _table(head, rows)


def ppl_diffs(by: dict, v: grid.Variant, base: grid.Variant) -> Stat:
    """Per-seed perplexity differences ``v - base``."""
    return Paired(ppl_stat(by.get(v.key)), ppl_stat(by.get(base.key))).diffs


def ppl_change_pct(by: dict, v: grid.Variant, base: grid.Variant) -> Stat:
    """Per-seed perplexity of ``v`` relative to ``base``, in percent: ``100 (ppl_v / ppl_base -
    1)``, comparable across model sizes whose perplexities differ."""
    mine, ref = ppl_stat(by.get(v.key)).values, ppl_stat(by.get(base.key)).values
    return Stat({s: 100 * (mine[s] / ref[s] - 1) for s in sorted(set(mine) & set(ref))})


def sweep_tapered() -> list[grid.Variant]:
    """The 15 tapered configurations of (b)."""
    return [
        grid.Variant("transformer", s, r) for r in grid.SWEEP_RATIOS for s in grid.SWEEP_SCHEDULES
    ]


def pooled(by: dict, only: list[str]) -> list[dict[str, Any]]:
    """The comparisons pooled over configurations that the data supports.

    Each entry: ``what``, ``unit`` (what one pair is), ``diffs`` (a :class:`Stat` of the pooled
    paired differences, keyed by pair), ``test`` (whether the pairs are independent enough for
    the sign and t tests), ``note``. (b): the 15 tapered schedules share the three
    uniform runs, so they are not 15 independent comparisons: per seed, the mean over the 15
    minus uniform is the paired test; the count of configuration means below uniform is given
    with that caveat. (c), and (g) at its second size: over (architecture, seed) pairs, each
    with its own uniform run. Only the experiments in ``only`` are pooled.
    """
    out: list[dict[str, Any]] = []
    uni = ppl_stat(by.get(grid.UNIFORM.key))
    tapered = [v for v in sweep_tapered() if by.get(v.key)]
    if "sweep" in only and uni.n and tapered:
        means = {i: ppl_stat(by.get(v.key)).mean - uni.mean for i, v in enumerate(tapered)}
        out.append(
            {
                "what": f"(b) {len(tapered)} tapered schedules vs uniform, by configuration mean",
                "unit": "configurations",
                "diffs": Stat(means),
                "test": False,
                "note": "a count, not a test: all share the same uniform runs, so the 15 are "
                "not independent; the row below is the test",
            }
        )
        stats = [ppl_stat(by.get(v.key)) for v in tapered]
        common = set(uni.values).intersection(*(set(st.values) for st in stats))
        per_seed = {
            s: sum(st.values[s] for st in stats) / len(stats) - uni.values[s]
            for s in sorted(common)
        }
        out.append(
            {
                "what": f"(b) mean of the {len(tapered)} tapered schedules vs uniform, per seed",
                "unit": "seeds",
                "diffs": Stat(per_seed),
                "test": True,
                "note": "paired over seeds; the shared uniform run is in each pair once",
            }
        )
    over_archs = (  # (experiment, its (uniform, cosine, reverse) variants, label, note)
        (
            "archs",
            grid.experiment_variants("archs"),
            "(c) {what} vs uniform, {archs} architectures x seeds",
            "each pair has its own uniform run; the architectures are pooled as one population",
        ),
        (
            "scale",
            grid.scale_variants(grid.SECOND),
            "(g) {what} vs uniform at the second size, {archs} architectures x seeds",
            "as (c), at the second size",
        ),
    )
    for experiment, variants, label, note in over_archs:
        for i, what in ((1, "cosine 1.5/0.5"), (2, "reverse")) if experiment in only else ():
            diffs: dict[Any, float] = {}
            for a in dict.fromkeys(v.arch for v in variants):
                vs = [v for v in variants if v.arch == a]
                for s, d in ppl_diffs(by, vs[i], vs[0]).values.items():
                    diffs[(a, s)] = d
            if diffs:
                archs = len({a for a, _ in diffs})
                out.append(
                    {
                        "what": label.format(what=what, archs=archs),
                        "unit": "architecture × seed",
                        "diffs": Stat(diffs),
                        "test": True,
                        "note": note,
                    }
                )
    return out


def table_pooled(by: dict, only: list[str]) -> list[str]:
    """The pooled comparisons (:func:`pooled`): sign counts, sign test, paired t interval."""
    rows = []
    for e in pooled(by, only):
        d = e["diffs"]
        lower = sum(x < 0 for x in d.values.values())
        higher = sum(x > 0 for x in d.values.values())
        tested = e["test"] and lower + higher > 0
        rows.append(
            [
                e["what"],
                f"{d.n} ({e['unit']})",
                f"{lower} / {higher}",
                p_text(sign_test_p(lower, lower + higher)) if tested else "—",
                *(delta_cells(d) if e["test"] else [signed(d.mean), "—", "—", "—"]),
                e["note"],
            ]
        )
    head = ["comparison", "pairs", "lower / higher", "sign test p"]
    return _table([*head, "Δ val ppl (mean)", "95 % CI", "p (t)", "reading", "note"], rows)
