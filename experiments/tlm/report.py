"""``docs/RESULTS.md`` for ``scripts/reproduce_tlm.py``.

Everything in RESULTS.md is computed by :func:`render` from two kinds of saved files only:
``docs/results/runs/<run>/metrics.json`` (one per finished run, see
:mod:`experiments.tlm.records`) and ``docs/results/meta.json`` (command, wall time, machine,
date, setup). So the document can be regenerated, and checked, without the checkpoints.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from experiments.tlm import corpus, driver, grid, provenance
from experiments.tlm.plots import PLOTS, plot_all, plot_keys
from experiments.tlm.prose import reading
from experiments.tlm.records import load_records
from experiments.tlm.stats import (
    BOOTSTRAP_REPS,
    by_variant,
    late_drop_ratio,
    ppl_stat,
    rho_stats,
    t_quantile_975,
)
from experiments.tlm.tables import (
    ARCH_NOTES,
    have_items,
    items_used,
    scale_size_names,
    table_alignment,
    table_archs,
    table_budget_and_memory,
    table_controlled,
    table_corpus,
    table_pooled,
    table_scale,
    table_scale_relative,
    table_sweep,
    table_zeroshot,
    table_zeroshot_items,
    zeroshot_tasks,
)
from experiments.tlm.verdicts import verdict_section


def _counted(labels: list[str]) -> str:
    """``label (n runs)`` for each distinct label, most runs first."""
    return "; ".join(f"{k} ({n} runs)" for k, n in Counter(labels).most_common())


def wall_text(meta: dict[str, Any]) -> str:
    """The driver's wall time in words: the sum over its invocations (the driver's
    ``driver_wall.json``, kept with the records), "so far" while runs are missing."""
    if meta.get("plan"):
        return "none (plan only)"
    if not meta["wall_s"]:
        return "in progress (not recorded yet)"
    text = (
        f"{meta['wall_s'] / 60:.1f} min over {meta['invocations']} invocation(s) of the driver "
        "(one killed outright, e.g. with its machine, counts up to its last save)"
    )
    if meta.get("wall_source"):
        text += f", from {meta['wall_source']}"
    return text + ("" if meta.get("finished", True) else ", so far: runs are still missing")


# A run whose recorded wall time is under this share of its configuration's median counts as
# undercounted (a resume whose earlier invocations the record lacks).
UNDERCOUNT = 0.5


def undercounted(records: list[dict[str, Any]]) -> list[str]:
    """Runs whose wall time is under :data:`UNDERCOUNT` of their configuration's median."""
    walls: dict[str, list[float]] = {}
    for r in records:
        walls.setdefault(r["variant"], []).append(r["wall_s"])
    return [
        r["run"]
        for r in records
        if len(walls[r["variant"]]) > 2
        and r["wall_s"] < UNDERCOUNT * statistics.median(walls[r["variant"]])
    ]


def mean_wall(records: list[dict[str, Any]]) -> float:
    """Mean wall seconds per run, the :func:`undercounted` runs left out."""
    short = set(undercounted(records))
    kept = [r["wall_s"] for r in records if r["run"] not in short]
    return sum(kept) / len(kept)


def rerun_text(meta: dict[str, Any], by: dict) -> str:
    """The rerun gap beside the seed spread: the same-machine bitwise check (the driver's
    ``rerun.json``) and what was measured before on another machine."""
    uni = ppl_stat(by.get(grid.UNIFORM.key))
    spread = (
        f" (the uniform Transformer's seed-to-seed std: {uni.std:.2f} ppl)" if uni.n > 1 else ""
    )
    r = meta.get("rerun")
    if r:
        same = (
            f"Rerun gap{spread}: on one machine ({r['cpu']}), {r['run']} trained twice from "
            f"scratch for {r['iterations']} iterations gave "
            + (
                f"bitwise-equal losses ({r['losses_compared']} compared)"
                if r["bitwise_equal"]
                else f"losses up to {r['max_abs_loss_diff']:.3g} apart"
            )
            + "."
        )
    else:
        same = (
            f"Rerun gap{spread}: the same-machine check (the driver's rerun.json) is not in "
            "these records yet."
        )
    return " ".join(
        filter(None, [same, cross_machine_text(meta.get("cross_machine")), OTHER_MACHINE])
    )


def cross_machine_text(entries: list[dict[str, Any]] | None) -> str:
    """The gap between two machines at one commit: runs trained on both (``meta``'s
    ``cross_machine``: per run its commit, the two CPUs and the two final validation losses;
    the records hold the second)."""
    if not entries:
        return ""
    gaps = sorted(abs(math.exp(e["val_loss"][1]) - math.exp(e["val_loss"][0])) for e in entries)
    commits = sorted({e["commit"] for e in entries})
    cpus = entries[0]["cpu"]
    return (
        f"Across machines at one commit ({', '.join(commits)}): {len(entries)} runs "
        f"({', '.join(e['run'] for e in entries)}) trained on {cpus[0]} and again on {cpus[1]} "
        f"(the records are the second): final perplexities differ by a median of "
        f"{statistics.median(gaps):.2f} ppl (at most {gaps[-1]:.2f})."
    )


# Measured before these records were regenerated, by hand, not recomputed from these files.
OTHER_MACHINE = (
    "On another 2-core machine (measured before, by hand, not from these files), retraining two "
    "then-recorded runs at their recorded commits matched the first iterations to about 1e-7 and "
    "then drifted: final perplexities 0.8 apart; that retrain at a later main was bitwise equal "
    "to the one at the recorded commit."
)


def provenance_lines(records: list[dict[str, Any]]) -> list[str]:
    """The code versions, machines, package versions and CPUs the runs were trained with, and
    the configurations whose runs mix code versions."""
    code, env, cpus = [], [], []
    mixed: dict[str, set[str]] = {}
    for r in records:
        entries = r.get("provenance") or [None]
        labels = sorted({provenance.code_label(e) for e in entries})
        code.append(" + ".join(labels))
        env.append(" + ".join(sorted({provenance.versions_label(e) for e in entries})))
        cpus.append(" + ".join(sorted({provenance.cpu_label(e) for e in entries})))
        mixed.setdefault(r["variant"], set()).update(labels)
    mixing = sorted(k for k, v in mixed.items() if len(v) > 1)
    return [
        f"- Code (commit the runs were trained at): {_counted(code)}; configurations mixing "
        f"code versions: {', '.join(mixing) if mixing else 'none'}.",
        f"- Trained on: {_counted(env)}.",
        f"- CPU: {_counted(cpus)}.",
    ]


def arch_setup(base: list[dict[str, Any]], ref: dict[str, Any]) -> str:
    """``; titans: d_ff 208, sequence 512`` for each architecture whose model dimensions differ
    from the reference run's ("" where none does)."""
    parts = []
    for arch in dict.fromkeys(r["arch"] for r in base):
        m = next(r["model"] for r in base if r["arch"] == arch)
        own = [
            f"{'sequence' if k == 'seq_len' else k} {v}"
            for k, v in m.items()
            if v != ref["model"][k]
        ]
        if own:
            parts.append(f"{arch}: {', '.join(own)}")
    if not parts:
        return ""
    same = all(r["tokens_per_iteration"] == ref["tokens_per_iteration"] for r in base)
    return "; " + "; ".join(parts) + (" (the same tokens per iteration)" if same else "")


def seed_counts(by: dict) -> list[tuple[int, str]]:
    """The seed counts the finished runs have: per experiment the fewest seeds of its
    configurations with runs, as ``(seeds, " ((a), (b))")`` naming the experiments where the
    counts differ (``""`` where all have one count); counts of one seed (no interval) left out."""
    groups: dict[int, list[str]] = {}
    for e in grid.EXPERIMENTS:
        ns = [len(by[v.key]) for v in grid.experiment_variants(e) if by.get(v.key)]
        if ns:
            groups.setdefault(min(ns), []).append(grid.TAGS[e])
    one = len(groups) == 1
    return [
        (n, "" if one else f" ({', '.join(tags)})") for n, tags in sorted(groups.items()) if n > 1
    ]


def _figure(key: str) -> list[str]:
    """The Markdown link to plot ``key`` and the blank line after it."""
    return [f"![{key}](results/{PLOTS[key]})", ""]


def _wall_per_run(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The Runs line's mean training wall time and the undercounted runs it leaves out."""
    short = undercounted(records)
    return (
        f"; {mean_wall(records):.0f} s wall per training run on average "
        f"({meta.get('jobs', 1)} at a time)"
        + (
            f", leaving out {', '.join(short)}: under half their configuration's median "
            "wall time, resumed runs whose earlier invocations were not counted (trained "
            "before the driver summed a run's invocations)"
            if short
            else ""
        )
    )


def _runs_line(records: list[dict[str, Any]], meta: dict[str, Any], by: dict) -> str:
    """The Runs line: finished and planned runs, seeds, mean wall time, missing tools."""
    seeds = seed_counts(by)
    return (
        f"- Runs: {len(records)} finished of {meta['runs_planned']} planned ("
        + ("; ".join(f"{n} seeds{where}" for n, where in seeds) + " finished, " if seeds else "")
        + f"{meta['seeds']} planned per configuration"
        + (
            f", {meta['headline_seeds']} for (c) and (g)"
            if meta.get("headline_seeds", meta["seeds"]) != meta["seeds"]
            else ""
        )
        + ")"
        + (_wall_per_run(records, meta) if records else "")
        + (
            f"; evaluation tools missing: {', '.join(meta['missing_tools'])}"
            if meta["missing_tools"]
            else ""
        )
    )


def _setup_lines(base: list[dict[str, Any]]) -> list[str]:
    """The Setup line (model, budget, LR, evaluation tokens) of the first-size runs ``base``
    and, where their curves show it, how far from converged they stopped."""
    r0 = next((r for r in base if r["arch"] == "transformer"), base[0])
    m = r0["model"]
    lines = [
        f"- Setup: d_model {m['d_model']}, {m['layers']} layers, baseline d_ff {m['d_ff']}, "
        f"vocabulary {m['vocab_size']}, sequence {m['seq_len']}; {r0['iterations']} iterations "
        f"x {r0['tokens_per_iteration']} tokens = "
        f"{r0['iterations'] * r0['tokens_per_iteration']:,} "
        f"training tokens per run, peak LR {r0['lr']:g} (cosine decay); validation perplexity "
        f"over the same {r0['eval_tokens']:,} held-out tokens for every run"
        + arch_setup(base, r0)
        + ".",
    ]
    moved = late_drop_text(base)
    if moved:
        lines.append(
            "- Training length: every comparison is at this fixed, short budget, not at "
            f"convergence: {moved} (curves in (d))."
        )
    return lines


def _run_facts(records: list[dict[str, Any]], meta: dict[str, Any], by: dict) -> list[str]:
    """The bullet list under the verdicts: command, wall time, runs, note, provenance, setup."""
    lines = [
        f"- Command: `{meta['command']}`",
        "- Wall time: " + wall_text(meta) + f"; machine: {meta['machine']}; date: {meta['date']}",
        _runs_line(records, meta, by),
    ]
    if meta.get("note"):
        lines.append(f"- Note: {meta['note']}")
    if records:
        lines += provenance_lines(records)
    base = [r for r in records if not r.get("size") and not r.get("corpus")]
    if base:
        lines += _setup_lines(base)
    return lines


def _statistics_text(meta: dict[str, Any], by: dict) -> str:
    """The Statistics paragraph: Δ, its interval and p, the reading's words, the t quantile
    at each seed count and the rerun gap."""
    seeds = seed_counts(by)
    return (
        "Statistics: mean ± sample std over seeds. Δ = the configuration minus its uniform "
        "baseline for the same seed (same initialisation stream and data order), averaged over "
        "the seeds both have"
        + (
            " (the uniform runs shared with (c) have more seeds than the (a) and (b) "
            "configurations, so Δ is not the difference of the two means shown)"
            if len(seeds) > 1
            else ""
        )
        + "; its 95 % CI is the Student t interval of the paired differences and p the "
        "two-sided paired t test (n - 1 degrees of freedom). The reading follows the interval: "
        "`lower, interval excludes 0` or `lower in the mean, interval includes 0` (likewise "
        "higher)."
        + "".join(
            f" With {n} seeds{where} t({n - 1}) = {t_quantile_975(n - 1):.2f}: the interval "
            f"reaches {t_quantile_975(n - 1) / math.sqrt(n):.2f} times the std of the "
            "differences on each side of Δ."
            for n, where in seeds
        )
        + " "
        + rerun_text(meta, by)
    )


def _archs_extra(by: dict, scale: str) -> list[str]:
    """(c)'s notes on each architecture and its budget and memory-probe table."""
    return [
        "The architectures as run here, each one line on what is ours:",
        "",
        *(f"- {a}: {note}" for a, note in ARCH_NOTES.items()),
        "",
        "Budgets and the memory probe: parameters and training FLOPs per token of each "
        "configuration (against the transformer's), and what switching the in-context "
        "memory off at evaluation costs (validation tokens; mean ± std over seeds; about "
        "0 means the trained model does not use its memory, a static network).",
        "",
        *table_budget_and_memory(by, scale),
        "",
    ]


def _comparison_sections(
    by: dict, records: list[dict[str, Any]], meta: dict[str, Any], scale: str, keys: list[str]
) -> list[str]:
    """(a), (b) and (c): each run experiment's table, (c)'s extras, and each one's plot."""
    only = meta["only"]
    sections = [
        (
            "controlled",
            "(a) Controlled experiment: which third gets the width",
            table_controlled(by, scale, meta.get("widths", {})) if "controlled" in only else None,
        ),
        ("sweep", "(b) Schedule sweep", table_sweep(by, scale) if "sweep" in only else None),
        ("archs", "(c) Four architectures", table_archs(by, scale) if "archs" in only else None),
    ]
    lines: list[str] = []
    for key, title, table in sections:
        if table is None:
            continue
        lines += [f"## {title}", "", *table, ""]
        if key == "archs" and any("params" in r for r in records):  # runs of these settings
            lines += _archs_extra(by, scale)
        if key in keys:
            lines += _figure(key)
    return lines


def _curves_section() -> list[str]:
    """(d): the validation curves' plot."""
    return [
        "## (d) Validation curves",
        "",
        "Validation perplexity against training tokens, mean over seeds.",
        "",
        *_figure("curves"),
    ]


def _alignment_section(by: dict, keys: list[str]) -> list[str]:
    """(e): ρ_block and ρ_mlp per layer, or that they were not measured."""
    lines = ["## (e) Alignment with the residual stream", ""]
    if "alignment" not in keys:
        return [
            *lines,
            "Not measured (the alignment tool was not available or no run finished).",
            "",
        ]
    uni, tap = (rho_stats(by, v, "rho_block") for v in grid.experiment_variants("alignment"))
    return [
        *lines,
        "ρ_block(l) = cos(h_{l+1} - h_l, h_l), ρ_mlp(l) = cos(F_l(z_l), h_l), averaged "
        f"over tokens; mean ± std over seeds (uniform {uni[0].n if uni else 0}, tapered "
        f"{tap[0].n if tap else 0}). Paper: near 0 in early and middle layers, rising in "
        "late layers.",
        "",
        *table_alignment(by),
        "",
        *_figure("alignment"),
    ]


def _zeroshot_section(
    by: dict,
    records: list[dict[str, Any]],
    info: dict[str, dict[str, Any]],
    scale: str,
    keys: list[str],
) -> list[str]:
    """(f): zero-shot accuracy with items used and chance levels, or that it was not measured."""
    lines = ["## (f) Zero-shot accuracy", ""]
    if "zeroshot" not in keys:
        return [
            *lines,
            "Not measured (the zero-shot tool was not available or no run finished).",
            "",
        ]
    tasks = zeroshot_tasks(records)
    used = ", ".join(
        f"{t} {items_used(records, t)} of {info[t]['items']}"
        if t in info
        else f"{t} {items_used(records, t)}"
        for t in tasks
    )
    levels = ", ".join(
        f"{t} {100 * info[t]['chance']:.1f}% ({info[t]['chance_rule']})" for t in tasks if t in info
    )
    return [
        *lines,
        "Accuracy in percent on the shipped local tasks, mean ± std over seeds; Δ, CI, p "
        "and reading as above (average accuracy). [95 % CI] of a task: the Wilson "
        "interval of an accuracy of that size on the items used (item sampling; the "
        f"seeds share the items). Items used (the first ones of each task): {used}. "
        f"Chance level: {levels}.",
        "",
        *table_zeroshot(by, records, info, scale),
        "",
        *zeroshot_items_text(by, records),
        *_figure("zeroshot"),
    ]


def _pooled_section(by: dict, only: list[str]) -> list[str]:
    """The pooled comparisons' section."""
    return [
        "## Pooled over configurations",
        "",
        "Single configurations with few seeds are too noisy to settle most comparisons; "
        "these rows pool them where the data allows. A pair is one unit of the `pairs` "
        "column; the sign test counts pairs below and above 0 (two-sided, a fair coin "
        "each); Δ, CI and p are the paired t over the pairs.",
        "",
        *table_pooled(by, only),
        "",
    ]


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The whole RESULTS.md text from saved run records and the driver's metadata."""
    only = meta["only"]
    scale = meta["scale"] + (" smoke" if meta["smoke"] else "")
    info = meta.get("zeroshot_tasks", {})
    by = by_variant(records)
    keys = plot_keys(by, records, only)
    lines = [
        "# Reproducing Tapered Language Models",
        "",
        "Generated by `scripts/reproduce_tlm.py` from `docs/results/runs/*/metrics.json` and "
        "`docs/results/meta.json` (every number below is recomputed from those files by "
        "`tests/test_reproduce.py`). Paper figures are from the paper (arXiv 2606.23670), "
        "at the paper's "
        f"scale (440M / 760M); ours are at the `{scale}` scale.",
        "",
        *verdict_section(by, only),
        *_run_facts(records, meta, by),
        "",
        _statistics_text(meta, by),
        "",
        *_comparison_sections(by, records, meta, scale, keys),
    ]
    if "curves" in keys:
        lines += _curves_section()
    if "alignment" in only:
        lines += _alignment_section(by, keys)
    if "archs" in only:
        lines += _zeroshot_section(by, records, info, scale, keys)
    if "archs" in only or "scale" in only:
        lines += scale_section(by, records, meta)
        if "scale" in keys:
            lines += _figure("scale")
    if "corpus" in only:
        lines += corpus_section(by, scale)
    if {"sweep", "archs", "scale"} & set(only) and records:
        lines += _pooled_section(by, only)
    if meta.get("plan"):
        lines += ["## Launch plan", "", "```", *meta["plan"].splitlines(), "```", ""]
    lines += ["## Reading", "", *reading(by, records, only, info), ""]
    return "\n".join(lines)


def zeroshot_items_text(by: dict, records: list[dict[str, Any]]) -> list[str]:
    """(f)'s item-level paired tests where the runs saved per-item outputs, else what is
    missing and which run produces it."""
    tasks = ", ".join(driver.ZEROSHOT_TASKS)
    if not have_items(records):
        return [
            "Item-level tests: these runs were evaluated before the evaluation kept per-item "
            "outputs, so (f) is tested over seeds only, although all seeds answer the same "
            "items. The next full run of the command above re-evaluates every (c) model on "
            f"{tasks} (the last two built so that models of this size score clearly above "
            "chance) and keeps each item's outcome; this section then gives the paired "
            "bootstrap over items and seeds and the per-seed McNemar tests.",
            "",
        ]
    return [
        "Item-level paired tests over every item of the tasks with saved outputs (the "
        "configuration and its uniform model answer the same items): Δ accuracy in points, its "
        "95 % percentile interval and p from a paired bootstrap that resamples seeds and items "
        f"({BOOTSTRAP_REPS} replicates, fixed generator), and per seed the exact McNemar test "
        "on the items only one of the two answers right.",
        "",
        *table_zeroshot_items(by),
        "",
    ]


def late_drop_text(records: list[dict[str, Any]]) -> str:
    """How far from converged ``records`` stopped: the range and median of
    :func:`late_drop_ratio` in words ("" where no run has enough evaluations)."""
    ratios = [x for x in map(late_drop_ratio, records) if x is not None]
    if not ratios:
        return ""
    return (
        "the last evaluation interval still moved the validation loss by "
        f"{100 * min(ratios):.0f}-{100 * max(ratios):.0f}% (median "
        f"{100 * statistics.median(ratios):.0f}%) of the largest interval's drop"
    )


def scale_section(by: dict, records: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """(g): the (c) comparisons of the (g) architectures at both sizes, or what is not run yet."""
    large = [r for r in records if r.get("size")]
    names = scale_size_names(records)
    lines = ["## (g) Scale", ""]
    if large:
        r = large[0]
        moved = late_drop_text(large)
        lines.append(
            f"The (c) comparisons of {' and '.join(grid.SCALE_ARCHS)} at a second size "
            f"({names[1]}, baseline d_ff {r['model']['d_ff']}, "
            f"{r['iterations'] * r['tokens_per_iteration']:,} training tokens per run, peak LR "
            f"{r['lr']:g}) beside the first (the (c) runs): paired Δ validation perplexity vs the "
            "same architecture's uniform model." + (f" At this size too, {moved}." if moved else "")
        )
    else:
        planned = meta.get("second_size") or "not planned at this scale"
        lines.append(
            f"The second size ({planned}) is not run yet: its column fills in as its runs "
            "finish. The first size's column is from the (c) runs."
        )
    relative = (
        "Relative to the uniform model's perplexity at each size (the sizes' perplexities "
        "differ, so Δ ppl is not comparable across them): per seed 100 (ppl / uniform ppl - 1); "
        "the last columns give how that relative effect moves from the first size to the second "
        "(different runs: Welch's standard error with min(n) - 1 degrees of freedom, a "
        "conservative interval)."
    )
    return [
        *lines,
        "",
        *table_scale(by, names),
        "",
        relative,
        "",
        *table_scale_relative(by, names),
        "",
    ]


def corpus_section(by: dict, scale: str) -> list[str]:
    """(h): the Transformer's uniform / cosine 1.5/0.5 / reverse on the second corpus."""
    return [
        "## (h) A second corpus",
        "",
        f"The Transformer's (c) comparisons on a corpus of another domain: the {corpus.LABEL} "
        "(its topic pages and the standard library's docstrings, with its own tokenizer of the "
        "same vocabulary size; the same model, budget and recipe as the first corpus). The "
        "verdict table's first row includes this comparison, so that claim does not rest on "
        "one corpus."
        + (
            ""
            if any(by.get(v.key) for v in grid.experiment_variants("corpus"))
            else " Not run yet: its rows fill in when the command above runs them."
        ),
        "",
        *table_corpus(by, scale),
        "",
        *corpus_length(by),
    ]


def corpus_length(by: dict) -> list[str]:
    """(h)'s distance from convergence at the first corpus's budget ("" before its runs)."""
    runs = [r for v in grid.experiment_variants("corpus") for r in (by.get(v.key) or {}).values()]
    moved = late_drop_text(runs)
    return [f"Training length on this corpus: not at convergence: {moved}.", ""] if moved else []


def write_results(results_dir: Path, meta: dict[str, Any]) -> Path:
    """Write ``meta.json``, the plots and ``RESULTS.md`` under ``results_dir`` from saved files."""
    res = results_dir / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    records = load_records(res / "runs")
    by = by_variant(records)
    keys = plot_keys(by, records, meta["only"])
    for name in PLOTS.values():
        (res / name).unlink(missing_ok=True)
    plot_all(by, keys, res)
    out = results_dir / "RESULTS.md"
    out.write_text(render(records, meta))
    return out
