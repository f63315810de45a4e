"""scripts/reproduce_tlm.py: experiment matrix, statistics, resumable driver, RESULTS.md numbers."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments.tlm import driver, grid, prose, provenance, records, report, stats
from experiments.tlm import tables as tables_mod
from tapered_megatron.config import load_config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "reproduce_tlm.py"
DOCS = REPO / "docs"


# ----------------------------------------------------------------------------- statistics
def test_paired_interval_and_p_match_scipy() -> None:
    base = stats.Stat({1: 10.0, 2: 12.0, 3: 11.0})
    assert base.mean == pytest.approx(11.0) and base.std == pytest.approx(1.0)
    noisy = stats.Paired(stats.Stat({1: 9.0, 2: 11.5, 3: 10.0}), base)
    d = noisy.diffs
    assert d.values == pytest.approx({1: -1.0, 2: -0.5, 3: -1.0})
    ref = scipy_stats.ttest_1samp([-1.0, -0.5, -1.0], 0.0)
    lo, hi = ref.confidence_interval(0.95)
    assert d.interval == pytest.approx((lo, hi), abs=1e-9) and d.p == pytest.approx(ref.pvalue)
    for df in (1, 2, 3, 4, 7, 10, 29):
        assert stats.t_quantile_975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-9)
        for t in (0.3, 1.7, 4.0, 12.0):
            assert stats.t_two_sided_p(t, df) == pytest.approx(2 * scipy_stats.t.sf(t, df))
    # only seeds both sides have are paired; one seed has no interval
    one = stats.Paired(stats.Stat({1: 9.0, 4: 1.0}), base).diffs
    assert one.values == {1: -1.0} and one.interval is None and one.p is None
    k, n = 54, 200
    w = scipy_stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert stats.wilson(k / n, n) == pytest.approx((w.low, w.high))
    assert stats.sign_test_p(10, 12) == pytest.approx(scipy_stats.binomtest(10, 12).pvalue)
    assert stats.sign_test_p(15, 15) == pytest.approx(scipy_stats.binomtest(15, 15).pvalue)


def test_unpaired_difference_is_welch_with_conservative_df() -> None:
    a = stats.Stat({1: -0.5, 2: 0.4, 3: -1.1, 4: 0.2})
    b = stats.Stat({1: -4.0, 2: -3.5, 3: -4.4})
    d = stats.Unpaired(a, b)
    welch = scipy_stats.ttest_ind(list(a.values.values()), list(b.values.values()), equal_var=False)
    se = (d.mean - 0) / welch.statistic  # Welch's standard error, whatever its df
    assert d.mean == pytest.approx(a.mean - b.mean) and d.n == 3
    half = scipy_stats.t.ppf(0.975, 2) * se  # min(n) - 1 = 2 degrees of freedom
    assert d.interval == pytest.approx((d.mean - half, d.mean + half))
    assert d.p == pytest.approx(2 * scipy_stats.t.sf(abs(welch.statistic), 2))
    assert d.p >= welch.pvalue  # never less conservative than Welch-Satterthwaite
    assert stats.direction(d) == "higher, interval excludes 0"
    assert stats.Unpaired(a, stats.Stat({1: 1.0})).interval is None


def test_reading_words_follow_the_interval() -> None:
    base = stats.Stat({1: 10.0, 2: 10.5, 3: 10.2})
    better = stats.Paired(stats.Stat({1: 8.0, 2: 8.6, 3: 8.1}), base).diffs
    assert stats.direction(better) == "lower, interval excludes 0"
    assert prose.verdict(better, expect_negative=True) == "shown, interval excludes 0"
    assert prose.verdict(better, expect_negative=False).startswith("contradicted: against")
    # the mean is lower, and larger than every std, but the interval crosses 0
    close = stats.Paired(stats.Stat({1: 9.0, 2: 10.6, 3: 9.3}), base).diffs
    assert close.mean < 0 and close.interval[0] < 0 < close.interval[1]
    assert stats.direction(close) == "lower in the mean, interval includes 0"
    # an interval that includes 0 is "not shown", whichever way the mean points
    assert prose.verdict(close, expect_negative=True).startswith("not shown: interval includes")
    assert "the paper's way" in prose.verdict(close, expect_negative=True)
    assert "the other way" in prose.verdict(close, expect_negative=False)
    worse = stats.Paired(stats.Stat({1: 12.0, 2: 12.4, 3: 12.3}), base).diffs
    assert stats.direction(worse) == "higher, interval excludes 0"


def test_holm_adjusts_within_the_family() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4x, 3x, 2x, 1x, each at least the one before
    adj = stats.holm([0.01, 0.04, 0.03, None, 0.005])
    assert adj == pytest.approx([0.03, 0.06, 0.06, None, 0.02])
    assert adj[3] is None and stats.holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])


def test_item_level_paired_tests() -> None:
    """McNemar is the exact binomial test on the discordant items; the paired bootstrap over
    items and seeds is recomputed here draw by draw, and separates a real gap from none."""
    assert stats.mcnemar_p(9, 2) == pytest.approx(scipy_stats.binomtest(9, 11).pvalue)
    assert stats.mcnemar_p(0, 0) == 1.0
    rng = random.Random(5)
    base = {s: "".join(rng.choice("01") for _ in range(120)) for s in (1, 2, 3)}
    better = {s: "".join("1" if rng.random() < 0.3 else b for b in x) for s, x in base.items()}
    d = stats.ItemPaired(better, base)
    assert d.n == 3 and d.discordant(1) == (
        sum(a == "1" and b == "0" for a, b in zip(better[1], base[1])),
        sum(a == "0" and b == "1" for a, b in zip(better[1], base[1])),
    )
    diffs = np.array([[int(a) - int(b) for a, b in zip(better[s], base[s])] for s in (1, 2, 3)])
    assert d.mean == pytest.approx(100 * diffs.mean())
    gen = np.random.default_rng(stats.BOOTSTRAP_SEED)
    seeds = gen.integers(0, 3, (stats.BOOTSTRAP_REPS, 3))
    items = gen.integers(0, 120, (stats.BOOTSTRAP_REPS, 120))
    reps = [100 * diffs[s][:, i].mean() for s, i in zip(seeds, items, strict=True)]
    assert d.interval == pytest.approx(tuple(np.percentile(reps, [2.5, 97.5])))
    assert d.interval[0] > 0 and d.p == pytest.approx(2 / stats.BOOTSTRAP_REPS)
    same = stats.ItemPaired(base, base)
    assert same.mean == 0 and same.p == 1.0 and stats.direction(same).startswith("equal")
    # one seed still has an interval (over items)
    assert stats.ItemPaired({1: better[1]}, {1: base[1]}).interval is not None


def test_reproduction_zeroshot_tasks_are_shipped_and_stale_results_redone(tmp_path: Path) -> None:
    for task in driver.ZEROSHOT_TASKS:
        assert list((REPO / "tasks").rglob(f"{task}.yaml")), task
        assert (REPO / "tasks" / "data" / f"{task}.jsonl").is_file(), task
    f = tmp_path / "zeroshot.json"
    full = {t: {"acc": 0.5, "n": 4} for t in driver.ZEROSHOT_TASKS}
    f.write_text(json.dumps({"tasks": full, "items": {t: "0101" for t in full}, "limit": None}))
    assert not driver.zeroshot_stale(f, smoke=False) and driver.zeroshot_stale(f, smoke=True)
    f.write_text(json.dumps({"tasks": full, "limit": None}))  # no per-item outputs: redone
    assert driver.zeroshot_stale(f, smoke=False)


# ----------------------------------------------------------------------------- matrix
def test_matrix_dedupes_shared_configurations() -> None:
    runs = grid.plan_runs(grid.EXPERIMENTS, 3)
    variants = {r.variant for r in runs}
    # 4 controlled + 15 swept + 10 new in (c) (transformer uniform and cosine 1.5/0.5 shared)
    # + 6 of (g) at the second size (its first size is (c)'s) + 3 of (h) on the second corpus
    assert len(variants) == 38 and len(runs) == 114
    assert len({r.name for r in runs}) == 114
    assert [r.seed for r in runs[:38]] == [1] * 38  # seed-major: complete tables appear early
    assert sum(v.size == grid.SECOND for v in variants) == 6
    assert {v.key for v in variants if v.corpus} == {
        "transformer-uniform-pydocs",
        "transformer-cosine-1.5-0.5-pydocs",
        "transformer-cosine-1.5-0.5-rev-pydocs",
    }
    # the headline comparisons, (c) and (g), at 5 seeds; the rest (and the shared uniform and
    # cosine 1.5/0.5 Transformer at the most any of its experiments asks)
    five = grid.plan_runs(grid.EXPERIMENTS, 3, headline_seeds=5)
    seeds = {v: max(r.seed for r in five if r.variant == v) for v in variants}
    headline = {*grid.experiment_variants("archs"), *grid.experiment_variants("scale")}
    assert {v for v, n in seeds.items() if n == 5} == headline and len(headline) == 18
    assert all(n == 3 for v, n in seeds.items() if v not in headline)
    assert len(five) == 18 * 5 + 20 * 3
    # the driver's default: every configuration at 5 seeds, (a) and (b) included
    default = _script().parse_args([])
    assert (default.seeds, default.headline_seeds) == (5, 0)
    assert len(grid.plan_runs(grid.EXPERIMENTS, default.seeds)) == 38 * 5
    assert grid.Variant("transformer", "cosine", (1.5, 0.5)) in grid.experiment_variants("sweep")
    assert grid.Variant("transformer", "cosine", (1.5, 0.5)) in grid.experiment_variants("archs")
    mults = {v.ratio for v in grid.experiment_variants("controlled") if v.schedule == "step"}
    assert mults == {(1.5, 0.75, 0.75), (0.75, 1.5, 0.75), (0.75, 0.75, 1.5)}
    assert len(grid.plan_runs(["controlled"], 2)) == 8


@pytest.mark.parametrize("smoke", [False, True])
def test_every_planned_run_is_a_valid_budget_preserving_config(smoke: bool) -> None:
    scale = grid.SCALES["cpu"]
    for v in {r.variant for r in grid.plan_runs(grid.EXPERIMENTS, 1)}:
        over = grid.shape_overrides(v, scale, smoke)
        cfg = load_config(scale.presets[v.arch], [*over, *v.overrides()])
        if v.size and not smoke:  # (g): about 4x the parameters and tokens of the first size
            assert (cfg.model.d_model, cfg.model.layers) == (256, 8)
            assert cfg.model.d_ff == 768
            assert cfg.train.iters * cfg.train.micro_batch_size * cfg.model.seq_len == 1310720
        plan = cfg.taper_plan
        assert sum(plan.widths) == cfg.model.layers * cfg.model.d_ff, v.key
        assert cfg.model.arch == v.arch
        if v.schedule != "step":
            # monotone, mirrored when reversed
            w = plan.widths[::-1] if v.reverse else plan.widths
            assert all(a >= b for a, b in itertools.pairwise(w)), v.key


def test_evaluations_pin_their_threads_behind_any_launcher(tmp_path, monkeypatch) -> None:
    """A launcher that is not plain python leaves the training jobs' threads alone, but each
    evaluation (one python process beside the other jobs) gets its share of the cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    s = driver.Settings(tmp_path, grid.SCALES["cpu"], ["env", "python"], threads=0, eval_threads=1)
    assert s.job_env()["OMP_NUM_THREADS"] == "7"
    assert s.job_env(evaluation=True)["OMP_NUM_THREADS"] == "1"
    assert s.job_env(evaluation=True)["MKL_NUM_THREADS"] == "1"


def test_run_command_is_a_plain_pretrain_job_behind_the_launcher(tmp_path: Path) -> None:
    s = driver.Settings(tmp_path, grid.SCALES["cpu"], ["deepspeed", "--num_gpus", "8"])
    run = grid.Run(grid.Variant("titans", "cosine", (1.5, 0.5), True), 2)
    cmd = s.command(run)
    assert cmd[:3] == ["deepspeed", "--num_gpus", "8"]
    assert cmd[3] == str(REPO / "pretrain" / "main.py")
    assert cmd[-2:] == ["--resume", "auto"]
    text = " ".join(cmd)
    assert "--model.arch titans --taper.schedule cosine --taper.ratio 1.5 0.5" in text
    assert "--taper.reverse true" in text and "--train.seed 1235" in text
    assert f"--logging.metrics_file {tmp_path}/runs/{run.name}/metrics.jsonl" in text
    assert f"--train.save_dir {tmp_path}/runs/{run.name}/checkpoints" in text
    big = s.command(grid.Run(grid.Variant("hope_attention", size=grid.SECOND), 1))
    assert "hope_attention-uniform-d256-s1" in " ".join(big)
    assert big.count("--model.d_ff") == 1 and big[big.index("--model.d_ff") + 1] == "768"


def test_second_size_budgets_match_across_architectures() -> None:
    """(g)'s architectures at the second size: parameters within 1 % of the transformer's."""
    from tapered_megatron.config import load_config
    from tapered_megatron.models import count_model

    scale = grid.SCALES["cpu"]
    params = {}
    for arch in grid.SCALE_ARCHS:
        v = grid.Variant(arch, size=grid.SECOND)
        cfg = load_config(scale.presets[arch], list(grid.shape_overrides(v, scale, False)))
        params[arch] = count_model(cfg).params_total
    for arch, n in params.items():
        assert abs(n / params["transformer"] - 1) < 0.01, (arch, n, params["transformer"])


def test_metrics_reader_keeps_the_resumed_record_and_skips_a_cut_line(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    lines = [
        {"iteration": 1, "loss": 9.0},
        {"iteration": 2, "loss": 8.0, "val_loss": 8.5},
        {"iteration": 2, "loss": 7.5, "val_loss": 7.9},  # after a resume from iteration 1
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"iteration": 3, "lo')
    recs = driver.read_metrics(f)
    assert [r["iteration"] for r in recs] == [1, 2] and recs[1]["val_loss"] == 7.9


def test_bad_arguments_fail_with_one_line(tmp_path: Path) -> None:
    for args, needle in (
        (["--only", "controlled,typo"], "--only"),
        (["--data-path", "x"], "--tokenizer-model"),
        (["--seeds", "0"], "--seeds"),
        (["--archs", "transformer,mamba"], "--archs"),
    ):
        p = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
            capture_output=True,
            text=True,
            env=_env(),
        )
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.splitlines()) == 1


def test_archs_subset_keeps_the_whole_plan_in_the_report(tmp_path: Path) -> None:
    """``--archs`` narrows what is trained, not what RESULTS.md plans: its saved records of the
    other architectures are not removed, and count as finished."""
    report = tmp_path / "report"
    kept = report / "results" / "runs" / "hope_attention-uniform-s1" / "metrics.json"
    kept.parent.mkdir(parents=True)
    saved = (DOCS / "results" / "runs" / "hope_attention-uniform-s1" / "metrics.json").read_bytes()
    kept.write_bytes(saved)
    args = ["--only", "archs", "--archs", "transformer", "--seeds", "1", "--report-only"]
    args += ["--results-dir", str(report)]
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert p.returncode == 0, p.stderr
    meta = json.loads((report / "results" / "meta.json").read_text())
    assert meta["runs_planned"] == 12 and kept.read_bytes() == saved
    assert "while 1 of 12 runs had finished" in meta["note"]  # the saved record counts
    ppl = math.exp(json.loads(saved)["final_val_loss"])
    assert f"| hope_attention | uniform | {ppl:.2f} |" in (report / "RESULTS.md").read_text()


# ----------------------------------------------------------------------------- RESULTS.md checks
def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _all_tables(text: str) -> dict[str, list[list[list[str]]]]:
    """Each ``## (x)`` section's tables in order, each its rows (header excluded)."""
    out: dict[str, list[list[list[str]]]] = {}
    section, previous = "", ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:6]
        elif line.startswith("|") and not line.startswith("|---"):
            if not previous.startswith("|"):
                out.setdefault(section, []).append([])
            out[section][-1].append(_cells(line))
        previous = line
    return {k: [rows[1:] for rows in tables] for k, tables in out.items()}


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Rows (header excluded) of each ``## (x)`` section's first table."""
    return {k: tables[0] for k, tables in _all_tables(text).items()}


def _fmt(xs: list[float], signed: bool = False, digits: int = 2) -> str:
    if not xs:
        return "—"
    m = statistics.fmean(xs)
    head = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return head if len(xs) == 1 else f"{head} ± {statistics.stdev(xs):.{digits}f}"


# Everything below recomputes RESULTS.md's numbers from the saved files with scipy and the
# standard library, without the experiments.tlm statistics, tables or prose.
def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _ttest(d: list[float]) -> tuple[float, float, float]:
    """Paired t: 95 % interval and two-sided p of the mean of ``d`` (>= 2 values)."""
    m = statistics.fmean(d)
    if statistics.stdev(d) == 0:
        return m, m, float(m == 0)
    res = scipy_stats.ttest_1samp(d, 0.0)
    ci = res.confidence_interval(0.95)
    return ci.low, ci.high, res.pvalue


def _delta(d: list[float]) -> list[str]:
    """Δ, CI, p and the reading of paired differences ``d``."""
    if not d:
        return ["—"] * 4
    m = statistics.fmean(d)
    side = "lower" if m < 0 else "higher" if m > 0 else "equal"
    if len(d) == 1:
        return [f"{m:+.2f}", "—", "—", f"{side} (one seed, no interval)"]
    lo, hi, p = _ttest(d)
    out = side != "equal" and (lo > 0 or hi < 0)
    words = f"{side}, interval excludes 0" if out else f"{side} in the mean, interval includes 0"
    return [f"{m:+.2f}", f"[{lo:+.2f}, {hi:+.2f}]", _p(p), words]


def _wilson(p: float, n: int) -> tuple[float, float]:
    z = scipy_stats.norm.ppf(0.975)
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, c - h), min(1.0, c + h)


def _per_seed(recs: list[dict], key: str, value) -> dict[int, float]:
    return {r["seed"]: value(r) for r in recs if r["variant"] == key and value(r) is not None}


def _ppl(recs: list[dict], key: str) -> dict[int, float]:
    return _per_seed(recs, key, lambda r: math.exp(r["final_val_loss"]))


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def _expected_row(recs: list[dict], variant: str, base: str) -> list[str]:
    """The six comparison cells of (a), (b) and (c)."""
    ppl, ref = _ppl(recs, variant), _ppl(recs, base)
    seeds = ", ".join(f"{ppl[s]:.2f}" for s in sorted(ppl)) or "—"
    if variant == base or not ppl:
        return [_fmt(list(ppl.values())), seeds, "—", "—", "—", "—"]
    return [_fmt(list(ppl.values())), seeds, *_delta(_paired(ppl, ref))]


def _widths(recs: list[dict], variant: str) -> str:
    w = next(r["widths"] for r in recs if r["variant"] == variant)
    runs = [(k, len(list(g))) for k, g in itertools.groupby(w)]
    return "/".join(str(k) if n == 1 else f"{k}×{n}" for k, n in runs)


def _numbers(text: str) -> list[str]:
    return re.findall(r"[+-]?\d+\.\d+(?![\w.])", text)  # not the paper's "1.3B"


def _task_chance() -> dict[str, tuple[int, float]]:
    """Items and chance level of each shipped task, read from its data file here."""
    out = {}
    for f in sorted((REPO / "tasks" / "data").glob("*.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        if "choices" in rows[0]:
            chance = statistics.fmean(1 / len(r["choices"]) for r in rows)
        else:
            targets = [r["target"] for r in rows]
            chance = max(targets.count(t) for t in set(targets)) / len(rows)
        out[f.stem] = (len(rows), chance)
    return out


def _check_budget_table(rows: list[list[str]], recs: list[dict], archs: list[list[str]]) -> int:
    """(c)'s budget and memory-probe table: parameters and training FLOPs per token (with the
    ratio to the transformer of the same configuration), perplexity as in (c)'s first table,
    the memory probe's gaps (mean ± std over seeds) for the memory architectures."""
    checked = 0
    variants = grid.experiment_variants("archs")
    for row, first, v in zip(rows, archs, variants, strict=True):
        runs = sorted((r for r in recs if r["variant"] == v.key), key=lambda r: r["seed"])
        twin = grid.Variant("transformer", v.schedule, v.ratio, v.reverse).key
        ref = min((r for r in recs if r["variant"] == twin), key=lambda r: r["seed"], default=None)
        assert row[:2] == [v.arch, v.label] and row[4] == first[2], row
        if runs and "params" in runs[0]:
            r = runs[0]
            for col, key, scale, digits in (
                (2, "params", 1e6, 3),
                (3, "train_flops_per_token", 1e6, 1),
            ):
                ratio = f" ({r[key] / ref[key]:.2f}x)" if ref and key in ref else ""
                assert row[col] == f"{r[key] / scale:.{digits}f}M{ratio}", (row, key)
        for col, i in ((5, 0), (6, 1)):
            gaps = [r["memory_probe"][i]["gap"] for r in runs if r.get("memory_probe")]
            assert row[col] == (_fmt(gaps, digits=3) if v.arch in grid.MEMORY_ARCHS else "—"), row
        checked += 5
    return checked


def _check_training_length(text: str, recs: list[dict], base: list[dict]) -> None:
    """The setup line's model, each architecture's own dimensions, and how far from converged
    the first size, the second corpus and the second size stopped."""
    r0 = next((r for r in base if r["arch"] == "transformer"), base[0])
    m0 = r0["model"]
    assert f"d_model {m0['d_model']}, {m0['layers']} layers, baseline d_ff {m0['d_ff']}" in text
    assert f"{r0['iterations'] * r0['tokens_per_iteration']:,} training tokens" in text
    for r in base:  # each architecture's own dimensions are named in the setup line
        m = r["model"]
        if m["d_ff"] != m0["d_ff"]:
            assert f"{r['arch']}: d_ff {m['d_ff']}" in text, r["arch"]
        if m["seq_len"] != m0["seq_len"]:
            assert f"sequence {m['seq_len']}" in text.split(f"{r['arch']}: ")[1], r["arch"]
    moved = "the last evaluation interval still moved the validation loss "
    late = _late_drop_range(base)
    if late:
        assert f"not at convergence: {moved}{late} of the largest" in text
    else:
        assert "- Training length" not in text
    on_corpus = _late_drop_range([r for r in recs if r.get("corpus")])
    if on_corpus:
        corpus_line = f"on this corpus: not at convergence: {moved}{on_corpus} of the largest"
        assert corpus_line in text
    large = [r for r in recs if r.get("size")]
    if large:  # the (g) intro: the second size's LR and how far from converged it stopped
        intro = next(x for x in text.splitlines() if x.startswith("The (c) comparisons of"))
        assert {r["lr"] for r in large} == {large[0]["lr"]}
        assert f"training tokens per run, peak LR {large[0]['lr']:g})" in intro
        late = _late_drop_range(large)
        assert (f"At this size too, {moved}{late} of the largest" in intro) == bool(late)


def _check_wall_and_rerun(text: str, recs: list[dict], meta: dict, results_dir: Path) -> None:
    """The Runs line's counts and mean wall time (undercounted resumed runs left out), the
    driver's summed wall time, the rerun check, the runs trained on two machines and the
    uniform seed spread."""
    by_config: dict[str, list[float]] = {}
    for r in recs:
        by_config.setdefault(r["variant"], []).append(r["wall_s"])
    short = [  # a resumed run whose earlier invocations were not counted
        r["run"]
        for r in recs
        if len(by_config[r["variant"]]) > 2
        and r["wall_s"] < 0.5 * statistics.median(by_config[r["variant"]])
    ]
    walls = statistics.fmean(r["wall_s"] for r in recs if r["run"] not in short)
    assert f"Runs: {len(recs)} finished of {meta['runs_planned']} planned" in text
    assert f"; {walls:.0f} s wall per training run" in text
    assert (f"leaving out {', '.join(short)}: under half" in text) == bool(short)
    kept = results_dir / "results" / "driver_wall.json"
    if kept.is_file():  # the driver's wall file, committed with the records, gives the sum
        assert round(sum(json.loads(kept.read_text())), 1) == meta["wall_s"]
    assert f"{meta['wall_s'] / 60:.1f} min over {meta['invocations']} invocation" in text
    rerun = results_dir / "results" / "rerun.json"
    if rerun.is_file():
        r = json.loads(rerun.read_text())
        assert meta["rerun"] == r
        said = f"{r['run']} trained twice from scratch for {r['iterations']} iterations gave "
        assert said + ("bitwise-equal" if r["bitwise_equal"] else "losses up to") in text
        assert r["cpu"] in text
    cross = meta.get("cross_machine") or []
    by_run = {r["run"]: r for r in recs}
    for e in cross:  # the second training of each is the record
        rec = by_run[e["run"]]
        assert rec["final_val_loss"] == e["val_loss"][1]
        assert provenance.cpu_label(rec["provenance"][0]) == e["cpu"][1]
        assert rec["provenance"][0]["commit"].startswith(e["commit"])
    if cross:
        gaps = [abs(math.exp(e["val_loss"][1]) - math.exp(e["val_loss"][0])) for e in cross]
        assert (
            f"final perplexities differ by a median of {statistics.median(gaps):.2f} ppl (at most "
            f"{max(gaps):.2f})"
        ) in text
    uni_ppl = list(_ppl(recs, grid.UNIFORM.key).values())
    if len(uni_ppl) > 1:
        assert f"seed-to-seed std: {statistics.stdev(uni_ppl):.2f} ppl" in text
    else:
        assert "seed-to-seed std" not in text


def _check_provenance(text: str, recs: list[dict]) -> None:
    """Every run's CPU, commit and torch version are named, and the runs without them counted."""
    cpus = [[e.get("cpu") for e in (r.get("provenance") or [{}])] for r in recs]
    none = sum(c == [None] for c in cpus)  # runs trained before the CPU was recorded
    assert (f"CPU not recorded ({none} runs)" in text) == (none > 0)
    for c in filter(None, itertools.chain(*cpus)):
        assert f"{c['model']}, torch kernels {c['torch_kernels']}" in text
    unrecorded = sum(not r.get("provenance") for r in recs)
    assert (f"not recorded ({unrecorded} runs)" in text) == (unrecorded > 0)
    for r in recs:
        for e in r.get("provenance") or []:
            assert e["commit"][:12] in text and f"torch {e['torch']}" in text


def _check_seed_counts(text: str, recs: list[dict]) -> None:
    """Per experiment its fewest seeds, as run: in the Runs line and with its t quantile."""
    groups: dict[int, list[str]] = {}
    for e in grid.EXPERIMENTS:
        ns = [len(_ppl(recs, v.key)) for v in grid.experiment_variants(e) if _ppl(recs, v.key)]
        if ns:
            groups.setdefault(min(ns), []).append(grid.TAGS[e])
    for n, tags in groups.items():
        where = "" if len(groups) == 1 else f" ({', '.join(tags)})"
        t = scipy_stats.t.ppf(0.975, n - 1) if n > 1 else 0
        said = f"With {n} seeds{where} t({n - 1}) = {t:.2f}: the interval reaches {t / n**0.5:.2f}"
        assert (said in text) == (n > 1), said
        if n > 1:
            assert f"{n} seeds{where}" in text.split("- Runs:")[1].split("\n")[0], n


def _check_comparisons(
    text: str, tables: dict[str, list[list[str]]], recs: list[dict], only: list[str]
) -> int:
    """The comparison tables of (a), (b), (c) with its budget table, and (h); (c)'s
    architectures without runs named as such in the Reading."""
    checked = 0
    uni = grid.UNIFORM.key
    if "controlled" in only:
        for row, v in zip(tables["(a)"], grid.experiment_variants("controlled"), strict=True):
            assert row[0] == v.label and row[1] == _widths(recs, v.key), row
            assert row[-6:] == _expected_row(recs, v.key, uni), row
            checked += 7
    if "sweep" in only:
        for row, v in zip(tables["(b)"], grid.experiment_variants("sweep"), strict=True):
            assert row[-6:] == _expected_row(recs, v.key, uni), row
            if v.schedule != "uniform":
                assert row[:2] == [v.schedule, f"{v.ratio[0]:g}/{v.ratio[1]:g}"]
            checked += 6
    if "archs" in only:
        for row, v in zip(tables["(c)"], grid.experiment_variants("archs"), strict=True):
            assert row[:2] == [v.arch, v.label]
            assert row[-6:] == _expected_row(recs, v.key, grid.Variant(v.arch).key), row
            checked += 6
        if any("params" in r for r in recs):
            checked += _check_budget_table(_all_tables(text)["(c)"][1], recs, tables["(c)"])
        for a in grid.ARCHS:  # an architecture without runs is named as such in the Reading
            none = not any(r["arch"] == a and not r.get("size") for r in recs)
            assert (f"  - {a}: no run finished yet" in text) == none, a
    if "corpus" in only:
        vs = grid.experiment_variants("corpus")
        for row, v in zip(tables["(h)"], vs, strict=True):
            assert row[:2] == [v.arch, v.label]
            assert row[-6:] == _expected_row(recs, v.key, vs[0].key), row
            checked += 6
    return checked


def _check_alignment(text: str, rows: list[list[str]], recs: list[dict]) -> int:
    """(e): the seeds per configuration and each layer's ρ cells."""
    uni_v, tap_v = grid.experiment_variants("alignment")
    seeds = [
        sum(1 for r in recs if r["variant"] == v.key and r.get("alignment")) for v in (uni_v, tap_v)
    ]
    assert f"mean ± std over seeds (uniform {seeds[0]}, tapered {seeds[1]})" in text
    checked = 0
    for row in rows:
        layer = int(row[0])
        for cell, v, key in zip(
            row[1:],
            (uni_v, tap_v, uni_v, tap_v),
            ("rho_block", "rho_block", "rho_mlp", "rho_mlp"),
            strict=True,
        ):
            xs = [
                r["alignment"]["layers"][layer][key]
                for r in recs
                if r["variant"] == v.key and r.get("alignment")
            ]
            assert cell == _fmt(xs, digits=3)
            checked += 1
    return checked


def check_results(results_dir: Path) -> int:
    """Recompute RESULTS.md under ``results_dir`` from its saved files; return cells checked."""
    text = (results_dir / "RESULTS.md").read_text()
    meta = json.loads((results_dir / "results" / "meta.json").read_text())
    recs = records.load_records(results_dir / "results" / "runs")
    # 1. the whole document (tables, reading, links) is what the saved files give
    assert report.render(recs, meta) == text
    # 2. every number, recomputed independently of the report's code
    tables = _tables(text)
    checked = 0
    base = [r for r in recs if not r.get("size") and not r.get("corpus")]
    if base:
        _check_training_length(text, recs, base)
        _check_wall_and_rerun(text, recs, meta, results_dir)
        _check_provenance(text, recs)
        checked += 4
    _check_seed_counts(text, recs)
    checked += _check_comparisons(text, tables, recs, meta["only"])
    if "(e)" in tables:
        checked += _check_alignment(text, tables["(e)"], recs)
    if "(f)" in tables:
        checked += _check_zeroshot(text, tables["(f)"], recs, meta)
        checked += _check_zeroshot_items(text, recs)
    if "(g)" in tables:
        checked += _check_scale(_all_tables(text)["(g)"], recs, text)
    if "Poo" in tables:
        checked += _check_pooled(tables["Poo"], recs, meta["only"])
    checked += _check_reading(text, tables, recs, meta["only"])
    checked += _check_verdicts(text, recs, meta["only"])
    checked += _check_claim_words(text, recs, meta["only"])
    return checked


def _acc(task: str | None):
    def get(r: dict) -> float | None:
        z = r.get("zeroshot")
        if not z or (task is not None and task not in z["tasks"]):
            return None
        return 100 * (z["average_acc"] if task is None else z["tasks"][task]["acc"])

    return get


def _check_zeroshot_items(text: str, recs: list[dict]) -> int:
    """(f)'s item-level table: the paired bootstrap over items and seeds and the per-seed
    McNemar counts, recomputed; or, without per-item outputs, the sentence saying so."""
    if not any((r.get("zeroshot") or {}).get("items") for r in recs):
        assert "Item-level tests: these runs were evaluated before" in text
        return 0
    rows = _all_tables(text)["(f)"][1]
    variants = [v for v in grid.experiment_variants("archs") if v.schedule != "uniform"]
    for row, v in zip(rows, variants, strict=True):
        mine, ref = _items(recs, v.key), _items(recs, grid.Variant(v.arch).key)
        boot = _bootstrap(mine, ref)
        assert row[:2] == [v.arch, v.label]
        if boot is None:
            assert row[2:] == ["—"] * 6, row
            continue
        m, lo, hi, p = boot
        seeds = sorted(set(mine) & set(ref))
        better = worse = 0
        for s in seeds:
            b = sum(x == "1" and y == "0" for x, y in zip(mine[s], ref[s]))
            c = sum(x == "0" and y == "1" for x, y in zip(mine[s], ref[s]))
            sig = b + c > 0 and scipy_stats.binomtest(b, b + c).pvalue < 0.05
            better += sig and b > c
            worse += sig and c > b
        side = "lower" if m < 0 else "higher" if m > 0 else "equal"
        words = "interval excludes 0" if lo > 0 or hi < 0 else "in the mean, interval includes 0"
        assert row[2:] == [
            f"{len(seeds)} × {len(mine[seeds[0]])}",
            f"{m:+.2f}",
            f"[{lo:+.2f}, {hi:+.2f}]",
            _p(p),
            f"{side}, {words}" if lo > 0 or hi < 0 else f"{side} {words}",
            f"{better} / {worse} of {len(seeds)}",
        ], row
    return 6 * len(rows)


def _check_zeroshot(text: str, rows: list[list[str]], recs: list[dict], meta: dict) -> int:
    tasks = sorted({t for r in recs if r.get("zeroshot") for t in r["zeroshot"]["tasks"]})
    evaluated = [r["zeroshot"]["tasks"] for r in recs if r.get("zeroshot")]
    used = {t: min(z[t]["n"] for z in evaluated if t in z) for t in tasks}
    shipped = _task_chance()
    if meta["zeroshot_tasks"]:  # what the report was given agrees with the task files
        assert {t: (i["items"], i["chance"]) for t, i in meta["zeroshot_tasks"].items()} == shipped
    for t in tasks:
        assert f"{t} {used[t]} of {shipped[t][0]}" in text
    chance = [100 * shipped[t][1] for t in tasks]
    assert rows[0] == ["chance level", "—", "—", f"{statistics.fmean(chance):.2f}", *["—"] * 4] + [
        f"{c:.1f}" for c in chance
    ]
    for row, v in zip(rows[1:], grid.experiment_variants("archs"), strict=True):
        avg = _per_seed(recs, v.key, _acc(None))
        ref = _per_seed(recs, grid.Variant(v.arch).key, _acc(None))
        assert row[:2] == [v.arch, v.label] and row[3] == _fmt(list(avg.values()))
        delta = ["—"] * 4 if v.schedule == "uniform" or not avg else _delta(_paired(avg, ref))
        assert row[4:8] == delta, row
        for cell, t in zip(row[8:], tasks, strict=True):
            xs = list(_per_seed(recs, v.key, _acc(t)).values())
            if not xs:  # no run of this configuration evaluated yet
                assert cell == "—", (cell, t)
                continue
            lo, hi = _wilson(statistics.fmean(xs) / 100, used[t])
            assert cell == f"{_fmt(xs, digits=1)} [{100 * lo:.1f}, {100 * hi:.1f}]", (cell, t)
    return len(rows) * len(rows[0])


def _welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """95 % interval and two-sided p of ``mean(a) - mean(b)``: Welch's standard error with
    min(n) - 1 degrees of freedom (>= 2 values each)."""
    m = statistics.fmean(a) - statistics.fmean(b)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    df = min(len(a), len(b)) - 1
    if se == 0:
        return m, m, float(m == 0)
    half = scipy_stats.t.ppf(0.975, df) * se
    return m - half, m + half, 2 * scipy_stats.t.sf(abs(m) / se, df)


def _summary(d: list[float]) -> str:
    """A (g) cell: mean, interval, p and seeds of paired differences ``d``."""
    if not d:
        return "not run yet"
    if len(d) == 1:
        return f"{d[0]:+.2f} (1 seed)"
    lo, hi, p = _ttest(d)
    return f"{statistics.fmean(d):+.2f} [{lo:+.2f}, {hi:+.2f}], p {_p(p)} ({len(d)} seeds)"


def _scale_expected(recs: list[dict]) -> list[tuple[list[str], list[str], str]]:
    """Each (g) comparison's row of the Δ ppl table, of the relative table, and its Reading
    line, recomputed from the records."""
    sched, ratio = grid.DEFAULT_TAPER
    out = []
    for a in grid.SCALE_ARCHS:
        for what, v in (
            ("cosine 1.5/0.5", grid.Variant(a, sched, ratio)),
            ("reverse", grid.Variant(a, sched, ratio, True)),
        ):
            ppl, pct = [], []
            for size in (False, True):
                mine = [r for r in recs if bool(r.get("size")) == size]
                key = v.key + (f"-{grid.SECOND}" if size else "")
                ukey = grid.Variant(a).key + (f"-{grid.SECOND}" if size else "")
                t, u = _ppl(mine, key), _ppl(mine, ukey)
                ppl.append(_paired(t, u))
                pct.append([100 * (t[s] / u[s] - 1) for s in sorted(set(t) & set(u))])
            n = min(len(pct[0]), len(pct[1]))
            change, trend = "not run yet", "—"
            if n:
                m = statistics.fmean(pct[1]) - statistics.fmean(pct[0])
                change, trend = f"{m:+.2f} (1 seed at a size)", "one seed at a size, no interval"
            if n >= 2:
                lo, hi, p = _welch(pct[1], pct[0])
                change = f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}], p {_p(p)}"
                m0, m1 = statistics.fmean(pct[0]), statistics.fmean(pct[1])
                word = (
                    "changes sign"
                    if (m0 < 0) != (m1 < 0)
                    else "grows"
                    if abs(m1) > abs(m0)
                    else "shrinks"
                )
                trend = f"the effect {word}" + (
                    ", interval of the change excludes 0"
                    if lo > 0 or hi < 0
                    else " in the mean, interval of the change includes 0"
                )
            line = ""
            if ppl[0] and ppl[1]:
                line = (
                    f"relative to uniform {statistics.fmean(pct[0]):+.2f} % / "
                    f"{statistics.fmean(pct[1]):+.2f} %, second minus first {m:+.2f} points: "
                    f"{trend}."
                )
            out.append(
                (
                    [a, f"{what} vs uniform", *map(_summary, ppl)],
                    [a, f"{what} vs uniform", *map(_summary, pct), change, trend],
                    f"  - {a}, {what}: " + line if line else "",
                )
            )
    return out


def _late_drop_range(runs: list[dict]) -> str:
    """'by lo-hi% (median m%)': the last evaluation interval's loss change over the largest."""
    late = []
    for r in runs:
        c = [p[2] for p in r["val_curve"]]
        drops = [abs(c[i + 1] - c[i]) for i in range(len(c) - 1)]
        if len(c) >= 3 and max(drops) > 0:
            late.append(drops[-1] / max(drops))
    if not late:
        return ""
    lo, hi, med = min(late), max(late), statistics.median(late)
    return f"by {100 * lo:.0f}-{100 * hi:.0f}% (median {100 * med:.0f}%)"


def _check_scale(tables: list[list[list[str]]], recs: list[dict], text: str) -> int:
    expected = _scale_expected(recs)
    assert tables[0] == [e[0] for e in expected]
    assert tables[1] == [e[1] for e in expected]
    for _, _, line in expected:  # the Reading's relative effect and its trend at both sizes
        if line:
            head, tail = line.split(": ", 1)
            assert any(x.startswith(head) and x.endswith(tail) for x in text.splitlines()), line
    return 2 * len(tables[0]) + 4 * len(tables[1])


def _check_pooled(rows: list[list[str]], recs: list[dict], only: list[str]) -> int:
    uni = _ppl(recs, grid.UNIFORM.key)
    sweep = [v.key for v in grid.experiment_variants("sweep")[1:]]
    sweep = [k for k in sweep if _ppl(recs, k)]
    means = [
        statistics.fmean(_ppl(recs, k).values()) - statistics.fmean(uni.values()) for k in sweep
    ]
    expected = []
    if "sweep" in only and sweep and uni:
        below = sum(m < 0 for m in means)
        expected.append([f"{len(means)} (configurations)", f"{below} / {len(means) - below}"])
        expected[-1] += ["—", f"{statistics.fmean(means):+.2f}", "—", "—", "—"]
        seeds = sorted(set(uni).intersection(*(_ppl(recs, k).keys() for k in sweep)))
        per_seed = [statistics.fmean(_ppl(recs, k)[s] for k in sweep) - uni[s] for s in seeds]
        expected.append(_pooled_cells(per_seed, "seeds"))
    for i in (1, 2) if "archs" in only else ():
        d = []
        for a in grid.ARCHS:
            vs = grid.arch_variants(a)
            d += _paired(_ppl(recs, vs[i].key), _ppl(recs, vs[0].key))
        if d:
            expected.append(_pooled_cells(d, "architecture × seed"))
    sched, ratio = grid.DEFAULT_TAPER
    for rev in (False, True) if "scale" in only else ():
        d = []
        for a in grid.SCALE_ARCHS:
            key = grid.Variant(a, sched, ratio, rev).key + f"-{grid.SECOND}"
            d += _paired(_ppl(recs, key), _ppl(recs, grid.Variant(a).key + f"-{grid.SECOND}"))
        if d:
            expected.append(_pooled_cells(d, "architecture × seed"))
    assert [row[1:8] for row in rows] == expected
    return 7 * len(rows)


def _pooled_cells(d: list[float], unit: str) -> list[str]:
    below, above = sum(x < 0 for x in d), sum(x > 0 for x in d)
    sign = scipy_stats.binomtest(below, below + above).pvalue
    return [f"{len(d)} ({unit})", f"{below} / {above}", _p(sign), *_delta(d)]


def _check_reading(
    text: str, tables: dict[str, list[list[str]]], recs: list[dict], only: list[str]
) -> int:
    """Every decimal in the Reading is a number of the tables; its counts are recomputed."""
    reading = text[text.index("## Reading") :]
    reading = _check_probe_reading(reading, recs)
    every = [row for ts in _all_tables(text).values() for rows in ts for row in rows]
    cells = {x for row in every for c in row for x in _numbers(c)}
    found = [x for x in _numbers(reading) if not x.startswith(("16.28", "14.44"))]  # the paper's
    assert set(found) <= cells | {"1.5", "0.5"}, set(found) - cells
    uni = _ppl(recs, grid.UNIFORM.key)
    sweep = [v for v in grid.experiment_variants("sweep")[1:] if _ppl(recs, v.key)]
    if "sweep" in only and sweep and uni:
        lower = [v for v in sweep if statistics.fmean(_paired(_ppl(recs, v.key), uni)) < 0]
        cos = [v for v in sweep if v.schedule == "cosine"]
        assert (
            f"Ours: {len(lower)} of {len(sweep)} tapered configurations have a lower mean "
            f"perplexity than uniform (cosine: {sum(v in lower for v in cos)} of {len(cos)})"
        ) in reading
    if "(f)" in tables:
        near = total = 0
        chance = _task_chance()
        tasks = sorted({t for r in recs if r.get("zeroshot") for t in r["zeroshot"]["tasks"]})
        for row in tables["(f)"][1:]:
            for cell, t in zip(row[8:], tasks, strict=True):
                if cell == "—":  # not evaluated yet
                    continue
                lo, hi = map(float, re.findall(r"\[(\S+), (\S+)\]", cell)[0])
                total += 1
                near += lo <= 100 * chance[t][1] <= hi
        assert f"{near} of {total} per-task accuracies have a Wilson interval" in reading
        # the verdict's estimates: the item-level table's where every architecture has
        # per-item outputs (Δ and reading in columns 3 and 6), else the seed-paired (f) table's
        item_rows = _all_tables(text)["(f)"][1] if len(_all_tables(text)["(f)"]) > 1 else []
        tapered = [r for r in item_rows if r[1] == "cosine 1.5/0.5"]
        if tapered and all(r[3] != "—" for r in tapered):
            over, rows, delta, words = "items and seeds", tapered, 3, 6
        else:
            over, delta, words = "seeds", 4, 7
            rows = [r for r in tables["(f)"][1:] if r[1] == "cosine 1.5/0.5"]
        up, sure = 0, {"above": [], "below": []}
        for row in rows:
            if row[delta] != "—":
                up += float(row[delta]) > 0
                if "excludes 0" in row[words]:
                    sure["above" if float(row[delta]) > 0 else "below"].append(row[0])
        n = sum(row[delta] != "—" for row in rows)
        sides = " and ".join(
            f"{len(v)} {k}" + (f" ({', '.join(v)})" if v else "") for k, v in sure.items()
        )
        assert (
            f"tapered above uniform in mean average accuracy for {up} of {n} architectures "
            f"(paper: 8/8 at 760M/1.3B); the paired 95 % interval over {over} excludes 0 for "
            f"{sides}."
        ) in reading
    return len(found)


def _check_probe_reading(reading: str, recs: list[dict]) -> str:
    """The Reading's memory-probe sentence recomputed from the records (configuration means of
    the gaps, runs above 0, configurations and runs at the bar); returns the Reading without
    it."""
    parts, reach = [], []
    bar = tables_mod.MEMORY_WORK_NATS
    for a in grid.MEMORY_ARCHS:
        gaps: dict[str, list[list[float]]] = {}
        for r in recs:
            if r["arch"] == a and not r.get("size") and r.get("memory_probe"):
                gaps.setdefault(r["variant"], []).append([p["gap"] for p in r["memory_probe"]])
        if not gaps:
            continue
        means = sorted(statistics.fmean(g[0] for g in v) for v in gaps.values())
        far = sorted(statistics.fmean(g[1] for g in v) for v in gaps.values())
        runs = [g[0] for v in gaps.values() for g in v]
        parts.append(
            f"{a} {means[0]:.3f}-{means[-1]:.3f} nats at the training length "
            f"({sum(x > 0 for x in runs)} of {len(runs)} runs above 0) and "
            f"{far[0]:.3f}-{far[-1]:.3f} at 4x it"
        )
        reach.append(
            f"{a} in {sum(m >= bar for m in means)} of {len(means)} configurations "
            f"({sum(x >= bar for x in runs)} of {len(runs)} runs)"
        )
    if not parts:
        assert "Memory probe" not in reading
        return reading
    line = (
        "  - Memory probe ((c), the budget table): switching the in-context memory off costs, in "
        f"the configurations' means, {'; '.join(parts)}. A memory counts as doing measurable work "
        f"from {bar} nats: {', '.join(reach)} reach it.\n"
    )
    assert line in reading
    return reading.replace(line, "")


def _holm(ps: list[float | None]) -> list[float | None]:
    order = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    out: list[float | None] = [None] * len(ps)
    floor = 0.0
    for rank, i in enumerate(order):
        floor = max(floor, min(1.0, (len(order) - rank) * ps[i]))
        out[i] = floor
    return out


def _bootstrap(a: dict[int, str], b: dict[int, str]) -> tuple[float, float, float, float] | None:
    """Mean, 95 % percentile interval and p of the paired bootstrap over seeds and items."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = np.array([[int(x) - int(y) for x, y in zip(a[s], b[s])] for s in seeds], dtype=float)
    gen = np.random.default_rng(stats.BOOTSTRAP_SEED)
    draws = (
        gen.integers(0, d.shape[0], (stats.BOOTSTRAP_REPS, d.shape[0])),
        gen.integers(0, d.shape[1], (stats.BOOTSTRAP_REPS, d.shape[1])),
    )
    reps = np.array([100 * d[s][:, i].mean() for s, i in zip(*draws, strict=True)])
    lo, hi = np.percentile(reps, [2.5, 97.5])
    tail = max(1, min(int((reps <= 0).sum()), int((reps >= 0).sum())))
    return 100 * d.mean(), lo, hi, min(1.0, 2 * tail / stats.BOOTSTRAP_REPS)


def _items(recs: list[dict], key: str) -> dict[int, str]:
    out = {}
    for r in recs:
        items = (r.get("zeroshot") or {}).get("items") if r["variant"] == key else None
        if items:
            out[r["seed"]] = "".join(items[t] for t in sorted(items))
    return out


def _rise(recs: list[dict], key: str) -> list[float]:
    out = []
    for r in sorted(recs, key=lambda r: r["seed"]):
        if r["variant"] == key and r.get("alignment"):
            rho = [x["rho_block"] for x in r["alignment"]["layers"]]
            cut = len(rho) * 2 // 3
            out.append(statistics.fmean(rho[cut:]) - statistics.fmean(rho[:cut]))
    return out


def _estimate(d: list[float]) -> tuple | int:
    """``(mean, lo, hi, p)`` of the paired t over ``d``; below two values, how many there are."""
    return (statistics.fmean(d), *_ttest(d)) if len(d) >= 2 else len(d)


def _ppl_estimate(recs: list[dict], a: str, b: str) -> tuple | int:
    """:func:`_estimate` of the per-seed perplexity differences of variant ``a`` minus ``b``."""
    return _estimate(_paired(_ppl(recs, a), _ppl(recs, b)))


def _family_archs(recs: list[dict], corpus: bool) -> tuple[str, list[tuple]]:
    """(c): cosine 1.5/0.5 minus uniform per architecture, with ``corpus`` also the
    Transformer's on the second corpus."""
    archs = grid.experiment_variants("archs")
    comps = [
        (f"{v.arch} Δ", _ppl_estimate(recs, v.key, archs[i - 1].key), -1, "ppl", 2)
        for i, v in enumerate(archs)
        if i % 3 == 1
    ]
    if corpus:  # the first claim holds the second corpus's comparison too
        u, c, _ = (v.key for v in grid.experiment_variants("corpus"))
        comps.append(
            (f"transformer on {grid.SECOND_CORPUS} Δ", _ppl_estimate(recs, c, u), -1, "ppl", 2)
        )
    return "(c)", comps


def _family_controlled(recs: list[dict]) -> tuple[str, list[tuple]]:
    """(a): the three adjacent steps of the paper's order."""
    u, e, m, late = (v.key for v in grid.experiment_variants("controlled"))
    return "(a)", [
        ("early − uniform", _ppl_estimate(recs, e, u), -1, "ppl", 2),
        ("middle − uniform", _ppl_estimate(recs, m, u), 1, "ppl", 2),
        ("late − middle", _ppl_estimate(recs, late, m), 1, "ppl", 2),
    ]


def _families_sweep(recs: list[dict]) -> list[tuple[str, list[tuple]]]:
    """(b)'s two claims: cosine below linear and sigmoid at each ratio, and cosine 1.5/0.5
    below cosine at each other ratio."""
    key = "transformer-{}-{:g}-{:g}".format
    best = [
        (
            f"{a:g}/{b:g} cosine − {o}",
            _ppl_estimate(recs, key("cosine", a, b), key(o, a, b)),
            -1,
            "ppl",
            2,
        )
        for a, b in grid.SWEEP_RATIOS
        for o in ("linear", "sigmoid")
    ]
    ratio = [
        (
            f"1.5/0.5 − {a:g}/{b:g}",
            _ppl_estimate(recs, key("cosine", 1.5, 0.5), key("cosine", a, b)),
            -1,
            "ppl",
            2,
        )
        for a, b in grid.SWEEP_RATIOS
        if (a, b) != (1.5, 0.5)
    ]
    return [("(b)", best), ("(b)", ratio)]


def _family_zeroshot(recs: list[dict]) -> tuple[str, list[tuple]]:
    """(f): average accuracy of cosine 1.5/0.5 minus uniform per architecture, by the paired
    bootstrap over items and seeds where the runs saved items, else the paired t over seeds."""
    archs = grid.experiment_variants("archs")
    comps = []
    for i in range(1, len(archs), 3):
        v, u = archs[i], archs[i - 1]
        boot: tuple | int | None = _bootstrap(_items(recs, v.key), _items(recs, u.key))
        if boot is None:
            boot = _estimate(
                _paired(_per_seed(recs, v.key, _acc(None)), _per_seed(recs, u.key, _acc(None)))
            )
        comps.append((f"{v.arch} Δ", boot, 1, "points", 2))
    return "(f)", comps


def _family_alignment(recs: list[dict]) -> tuple[str, list[tuple]]:
    """(e): ρ_block's late rise in the uniform and the tapered Transformer."""
    return "(e)", [
        (f"{v.label} rise", _estimate(_rise(recs, v.key)), 1, "", 3)
        for v in grid.experiment_variants("alignment")
    ]


def _family_scale(recs: list[dict]) -> tuple[str, list[tuple]]:
    """(g): cosine 1.5/0.5 minus uniform per (g) architecture at the second size."""
    big = grid.scale_variants(grid.SECOND)
    return "(g)", [
        (f"{v.arch} Δ", _ppl_estimate(recs, v.key, big[i - 1].key), -1, "ppl", 2)
        for i, v in enumerate(big)
        if i % 3 == 1
    ]


def _families(recs: list[dict], only: list[str]) -> list[tuple[str, list[tuple]]]:
    """Each claim's comparisons, recomputed: ``(label, (mean, lo, hi, p) or None, expected
    sign, unit, digits)``."""
    fams: list[tuple[str, list[tuple]]] = []
    if "archs" in only:
        fams.append(_family_archs(recs, "corpus" in only))
    if "controlled" in only:
        fams.append(_family_controlled(recs))
    if "sweep" in only:
        fams += _families_sweep(recs)
    if "archs" in only:
        fams.append(_family_zeroshot(recs))
    if "alignment" in only:
        fams.append(_family_alignment(recs))
    if "scale" in only:
        fams.append(_family_scale(recs))
    return fams


def _check_claim_words(text: str, recs: list[dict], only: list[str]) -> int:
    """The Reading says what the numbers say: a claim is "shown" only where its interval
    excludes 0, the best schedule is named against the paper's, (c)'s perplexity is not passed
    off as the paper's zero-shot claim, and a first-size effect missing at the second size is
    said to be missing."""
    reading = text[text.index("## Reading") :]
    lines = reading.splitlines()
    if "controlled" in only:
        for v in grid.experiment_variants("controlled")[1:]:
            d = _paired(_ppl(recs, v.key), _ppl(recs, grid.UNIFORM.key))
            line = next(x for x in lines if x.startswith(f'  - "{v.label.split()[0]} '))
            assert "paper's direction:" not in line
            if len(d) < 2:
                assert "no interval" in line, line
                continue
            shown = _ttest(d)[0] > 0 or _ttest(d)[1] < 0
            assert ("interval includes 0" in line) == (not shown), line
    if "sweep" in only:
        sweep = [v for v in grid.experiment_variants("sweep")[1:] if _ppl(recs, v.key)]
        best = min(sweep, key=lambda v: statistics.fmean(_ppl(recs, v.key).values()))
        paper = best.key == grid.Variant("transformer", *grid.DEFAULT_TAPER).key
        said = f"Our best is {best.label} "
        assert said in reading and ("as in the paper" in reading) == paper
    if "archs" in only:
        assert "The paper's claim here is zero-shot accuracy" in reading
    sched, ratio = grid.DEFAULT_TAPER
    for a in grid.SCALE_ARCHS if "scale" in only else ():
        d = [
            _paired(
                _ppl(recs, grid.Variant(a, sched, ratio).key + sfx),
                _ppl(recs, a + "-uniform" + sfx),
            )
            for sfx in ("", f"-{grid.SECOND}")
        ]
        if min(map(len, d)) < 2:
            continue
        (lo1, hi1, _), (lo2, hi2, _) = map(_ttest, d)
        gone = (lo1 > 0 or hi1 < 0) and lo2 <= 0 <= hi2
        line = next(x for x in lines if x.startswith(f"  - {a}, cosine 1.5/0.5: "))
        m2 = statistics.fmean(d[1])
        said = "(shown at the first size, not at the second: "
        said += f"Δ {m2:+.2f} ppl [{lo2:+.2f}, {hi2:+.2f}];"
        assert (said in line) == gone, line
    return 1


def _check_verdicts(text: str, recs: list[dict], only: list[str]) -> int:
    """The verdict table: each claim's numbers and verdict word, recomputed (Holm within each
    family; confirmed / contradicted at adjusted p < 0.05)."""
    rows = _all_tables(text)["Ver"][0]
    fams = _families(recs, only)
    assert text.index("## Verdicts") < text.index("- Command:")  # RESULTS opens with it
    assert [r[0][:3] for r in rows] == [f for f, _ in fams]
    for row, (_, comps) in zip(rows, fams, strict=True):
        adj = _holm([c[1][3] if isinstance(c[1], tuple) else None for c in comps])
        outcome, parts = [], []
        for (label, est, sign, unit, digits), q in zip(comps, adj, strict=True):
            if not isinstance(est, tuple):
                outcome.append("not run")
                parts.append(f"{label}: {'one seed' if est else 'not run'}")
                continue
            m, lo, hi, p = est
            outcome.append("open" if q >= 0.05 else "confirmed" if m * sign > 0 else "contradicted")
            u = f" {unit}" if unit else ""
            parts.append(
                f"{label} {m:+.{digits}f}{u} [{lo:+.{digits}f}, {hi:+.{digits}f}], p {_p(p)}, "
                f"Holm {_p(q)}"
            )
        tested = sum(o != "not run" for o in outcome)
        numbers = (
            f"{outcome.count('confirmed')} of {len(comps)} confirmed, "
            f"{outcome.count('contradicted')} contradicted (Holm over {tested}): "
            + "; ".join(parts)
        )
        word = (
            "not measured"
            if not tested
            else "not reproduced"
            if "contradicted" in outcome
            else "reproduced"
            if outcome.count("confirmed") == len(comps)
            else "inconclusive"
        )
        assert row[1] == f"**{word}**" and row[3] == numbers, (row, numbers)
    return sum(len(c) for _, c in fams)


def test_committed_results_are_recomputed_from_saved_metrics() -> None:
    assert check_results(DOCS) > 300
    for rec in records.load_records(DOCS / "results" / "runs"):
        # every model trained past its fast drop: the last evaluation interval moved the loss by
        # less than a fifth of the largest one (RESULTS' "Training length" gives the range)
        curve = [c[2] for c in rec["val_curve"]]
        assert len(curve) >= 4, rec["run"]
        drops = [abs(b - a) for a, b in itertools.pairwise(curve)]
        assert drops[-1] < 0.2 * max(drops), rec["run"]


def test_a_configuration_without_a_seed_in_common_with_its_baseline_is_reported() -> None:
    """A report written while runs are missing (``--report-only``) where a configuration and
    its uniform baseline have finished different seeds: said in words, no crash."""
    recs = records.load_records(DOCS / "results" / "runs")
    first = {r["seed"] for r in recs if r["arch"] == "titans"}
    early = set(sorted(first)[:3])
    kept = [
        r
        for r in recs
        if r["arch"] != "titans" or (r["seed"] in early) == (r["schedule"] == "uniform")
    ]
    meta = json.loads((DOCS / "results" / "meta.json").read_text())
    text = report.render(kept, meta)
    assert "titans: cosine 1.5/0.5 vs uniform: not measured (no seed in common" in text


def test_zeroshot_items_give_item_level_tests_and_the_verdict(tmp_path: Path) -> None:
    """Runs with per-item zero-shot outputs: (f)'s paired bootstrap over items and seeds and
    McNemar counts, and the verdict table's (f) row resting on them, rendered and recomputed
    (the committed runs predate per-item outputs: outcomes drawn here stand in for them)."""
    runs = tmp_path / "results" / "runs"
    shutil.copytree(DOCS / "results" / "runs", runs)
    rng = random.Random(3)
    shared = [rng.random() < 0.6 for _ in range(200)]  # what every model gets right
    for rec in records.load_records(runs):
        if rec.get("zeroshot") and not rec.get("size"):
            seed = random.Random(rec["run"])  # a few flips of the model's own
            bits = [x != (seed.random() < 0.05) for x in shared]
            if rec["schedule"] != "uniform":  # tapered: 20 items better (titans: worse)
                wrong = rec["arch"] == "titans"
                for i in [i for i, x in enumerate(bits) if x == wrong][:20]:
                    bits[i] = not wrong
            text = "".join("1" if x else "0" for x in bits)
            tasks = ("tm_shakespeare_lastchoice", "tm_shakespeare_wordswap")
            rec["zeroshot"]["items"] = {
                t: text[i * 100 : i * 100 + 100] for i, t in enumerate(tasks)
            }
            (runs / rec["run"] / "metrics.json").write_text(json.dumps(rec))
    meta = json.loads((DOCS / "results" / "meta.json").read_text())
    text = report.render(records.load_records(runs), meta)
    (tmp_path / "results" / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "RESULTS.md").write_text(text)
    assert check_results(tmp_path) > 300
    assert "paired bootstrap over items and seeds (5 seeds)" in text
    verdicts = {row[0][:3]: row for row in _all_tables(text)["Ver"][0]}
    assert "titans Δ -" in verdicts["(f)"][3] and verdicts["(f)"][1] == "**not reproduced**"


def test_scale_change_with_seeds_at_both_sizes_is_recomputed(tmp_path: Path) -> None:
    """(g) with several seeds at the second size: the relative table's Welch column and the
    Reading's trend words, rendered and recomputed (the committed runs may have one seed)."""
    runs = tmp_path / "results" / "runs"
    shutil.copytree(DOCS / "results" / "runs", runs)
    large = [r for r in records.load_records(runs) if r.get("size")]
    for r in large:  # the saved second-size runs of seed 1 stand in for seeds 2-4
        if r["seed"] != 1:
            shutil.rmtree(runs / r["run"])
    base = [r for r in large if r["seed"] == 1]
    assert base, "no (g) run at the second size saved"
    for seed, shift in ((2, 0.03), (3, -0.02), (4, 0.05)):
        for r in base:
            taper = r["schedule"] != "uniform"
            rec = dict(r, seed=seed, run=r["run"][: -len("s1")] + f"s{seed}")
            rec["final_val_loss"] = r["final_val_loss"] + shift * (1 + taper * seed / 4)
            (runs / rec["run"]).mkdir()
            (runs / rec["run"] / "metrics.json").write_text(json.dumps(rec))
    meta = json.loads((DOCS / "results" / "meta.json").read_text())
    report.write_results(tmp_path, meta)
    assert check_results(tmp_path) > 300
    g = _all_tables((tmp_path / "RESULTS.md").read_text())["(g)"][1]
    assert any("(4 seeds)" in row[3] and ", p " in row[4] for row in g), g
    assert "![scale](results/g_scale.png)" in (tmp_path / "RESULTS.md").read_text()
    assert (tmp_path / "results" / "g_scale.png").stat().st_size > 1000


def test_committed_results_carry_no_absolute_path() -> None:
    def strings(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif isinstance(x, str):
            yield x

    files = sorted((DOCS / "results").rglob("*.json"))
    assert len(files) > 80
    for f in files:
        bad = [x for x in strings(json.loads(f.read_text())) if os.path.isabs(x) or "\\" in x]
        assert not bad, (f.name, bad)
    assert not re.search(
        r"[\s`(\"']/(home|work|tmp|root|Users|mnt|data|opt)\b", (DOCS / "RESULTS.md").read_text()
    )


# ----------------------------------------------------------------------------- real driver runs
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _driver(out: Path, *args: str) -> subprocess.CompletedProcess:
    # the whole smoke plan (38 tiny runs, their evaluations, the second corpus and the rerun
    # check) takes well over 900 s on a loaded 2-core machine
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=2400,
    )


def _script() -> types.ModuleType:
    """scripts/reproduce_tlm.py loaded as a module."""
    spec = importlib.util.spec_from_file_location("reproduce_tlm", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_results_command_is_the_whole_plans_not_a_subset_rerun() -> None:
    """RESULTS.md shows the one command that reproduces the report, whichever resumed or partial
    invocation (``--archs``, ``--jobs``, ``--report-only``) wrote it."""
    cmd = _script()._command
    assert (
        cmd(["--out", "../r", "--only", "archs", "--archs", "titans", "--headline-seeds", "5",
             "--jobs", "1", "--no-report", "--allow-mixed-commits"])
        == "python scripts/reproduce_tlm.py --out ../r --only archs --headline-seeds 5"
    )  # fmt: skip
    assert (
        cmd(["--headline-seeds", "5", "--archs=transformer", "--report-only", "--results-dir", "x"])
        == "python scripts/reproduce_tlm.py --headline-seeds 5"
    )


def _start_and_kill_after(out: Path, finished: int, *args: str, until: Path | None = None) -> None:
    """Start the driver, SIGKILL it (and its jobs) once ``finished`` runs are done (and the file
    ``until``, if given, exists)."""
    p = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,
    )
    log = out / "driver.log"
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            done = log.exists() and log.read_text().count(" done ") >= finished
            if done and (until is None or until.exists()):
                break
            assert p.poll() is None, "driver ended before it could be killed"
            time.sleep(0.2)
        else:
            raise AssertionError("driver made no progress")
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _table_lines(path: Path) -> list[str]:
    text = path.read_text()
    return [ln for ln in text.splitlines() if ln.startswith(("|", "- (", "  - "))]


@pytest.mark.slow
def test_killed_driver_reruns_only_what_is_left(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = out / "runs" / "transformer-uniform-s1"
    evaluated = importlib.util.find_spec("tapered_megatron.eval.alignment") is not None
    until = first / "alignment.json" if evaluated else None
    _start_and_kill_after(out, 1, "--only", "alignment", "--jobs", "1", until=until)
    assert (first / "done").exists()  # trained and, where the tool is there, evaluated at once
    assert not (out / "runs" / "transformer-cosine-1.5-0.5-s1" / "done").exists()
    kept = (first / "metrics.jsonl").read_bytes()

    p = _driver(out, "--only", "alignment", "--jobs", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "training: 1 of 2 runs already done, 1 to go" in p.stdout
    assert (first / "metrics.jsonl").read_bytes() == kept  # the finished run was not touched
    second = driver.read_metrics(out / "runs" / "transformer-cosine-1.5-0.5-s1" / "metrics.jsonl")
    assert [r["iteration"] for r in second] == [1, 2, 3, 4]
    if not evaluated:
        assert "tapered_megatron.eval.alignment is not installed" in p.stdout
        assert "Not measured" in (out / "report" / "RESULTS.md").read_text()
    else:
        assert (first / "alignment.json").exists()
    check_results(out / "report")
    saved = records.load_records(out / "report" / "results" / "runs")
    assert [r["provenance"][0]["commit"] for r in saved] == [_git_head()] * 2
    assert _git_head()[:12] in (out / "report" / "RESULTS.md").read_text()
    tables = _table_lines(out / "report" / "RESULTS.md")

    again = _driver(out, "--only", "alignment", "--jobs", "1", "--archs", "transformer")
    assert "training: 2 of 2 runs already done, 0 to go" in again.stdout
    assert _table_lines(out / "report" / "RESULTS.md") == tables
    # RESULTS.md names the command that reproduces the whole plan, not this subset rerun
    rel = records.repo_relative(str(out))
    full = f"Command: `python scripts/reproduce_tlm.py --smoke --out {rel} --only alignment`"
    assert full in (out / "report" / "RESULTS.md").read_text()


def test_a_resumed_runs_wall_time_counts_its_earlier_invocations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's wall time is saved while it runs (what a killed driver would have lost) and is
    added to what earlier invocations of the run spent."""
    monkeypatch.setattr(driver, "_WALL_EVERY_S", 0.05)
    spent = tmp_path / "wall_s"
    spent.write_text("100.0")  # an earlier, killed invocation
    peek = "import time; time.sleep(0.6); print(open('wall_s').read())"  # the job reads it
    rc = driver._run_job([sys.executable, "-c", peek], tmp_path, dict(os.environ), spent)
    assert rc == 0
    assert 100.3 < float((tmp_path / "train.log").read_text()) <= float(spent.read_text()) < 130


def test_a_killed_invocations_wall_time_is_saved_while_it_runs(tmp_path: Path) -> None:
    """The driver's own time is saved every few seconds: an invocation SIGKILLed (its machine
    gone) still counts up to its last save, beside the earlier invocations'."""
    walls = tmp_path / "driver_wall.json"
    walls.write_text("[100.0]")  # an earlier invocation
    code = (
        "import sys, time; from pathlib import Path; from experiments.tlm import driver\n"
        "driver._WALL_EVERY_S = 0.05\n"
        "with driver.invocation_wall(Path(sys.argv[1])):\n"
        "    time.sleep(60)\n"
    )
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=_env())
    try:
        while time.time() - t0 < 60:
            assert p.poll() is None, "the invocation ended before it was killed"
            saved = json.loads(walls.read_text())
            if len(saved) == 2 and saved[1] >= 0.5:
                break
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait()
    killed_after = time.time() - t0
    before, this = json.loads(walls.read_text())
    assert before == 100.0
    assert 0.5 <= this <= killed_after  # counted up to its last save, no further


def test_an_invocation_that_ends_adds_its_whole_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver, "_WALL_EVERY_S", 0.05)
    (tmp_path / "driver_wall.json").write_text("[100.0, 20.0]")
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt), driver.invocation_wall(tmp_path) as walls:
        time.sleep(0.3)
        raise KeyboardInterrupt  # Ctrl-C (SIGTERM exits the same way)
    spent = time.time() - t0
    assert json.loads((tmp_path / "driver_wall.json").read_text()) == walls
    assert walls[:2] == [100.0, 20.0] and 0.3 <= walls[2] <= spent + 0.05


def test_rerun_from_another_checkout_or_launcher_is_accepted(tmp_path: Path) -> None:
    s = driver.Settings(tmp_path, grid.SCALES["cpu"], ["python"])
    run = grid.Run(grid.UNIFORM, 1)
    cmd = s.command(run)
    d = s.run_dir(run)
    moved = [
        "deepspeed",
        "--num_gpus",
        "1",
        "/elsewhere/pretrain/main.py",
        *driver.job_part(cmd)[1:],
    ]
    driver._check_command(d, moved)
    driver._check_command(d, cmd)  # same job arguments: accepted
    with pytest.raises(SystemExit, match="another command"):
        driver._check_command(d, [*cmd[:-2], "--train.iters", "5", "--resume", "auto"])


def _git_head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def _trained_by(d: Path, commit: str | None, done: bool = True, env: dict | None = None) -> None:
    """Make ``d`` look like a run trained (``done``, else started) by ``commit`` from a clean
    tree, or by the code of ``env``; by a driver that recorded nothing when both are None."""
    (d / "checkpoints" / "global_step2").mkdir(parents=True)
    if done:
        (d / "done").write_text("{}")
    entry = {"commit": commit, "clean": True, "changes": None} if commit else env
    if entry:
        (d / "provenance.json").write_text(json.dumps([entry]))


def test_provenance_is_recorded_and_mixed_code_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from importlib import metadata

    env = provenance.environment(REPO)
    assert env["commit"] == _git_head() and isinstance(env["clean"], bool)
    assert env["torch"] == metadata.version("torch")
    assert env["deepspeed"] == metadata.version("deepspeed")
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    s = driver.Settings(tmp_path, grid.SCALES["cpu"], ["python"], env=env)
    seed2 = [grid.Run(grid.UNIFORM, 2)]
    _trained_by(s.run_dir(grid.Run(grid.UNIFORM, 1)), None, env=env)  # this very code
    _trained_by(tmp_path / "runs" / "transformer-uniform-rev-s1", "0" * 40)  # another config
    assert driver.mixed_code_problem(s, seed2) is None
    other = s.run_dir(grid.Run(grid.UNIFORM, 3))
    _trained_by(other, "0" * 40)
    problem = driver.mixed_code_problem(s, seed2)
    assert problem.startswith("transformer-uniform has runs trained by code 000000000000 (clean),")
    assert "--allow-mixed-commits" in problem and "\n" not in problem
    s_mixed = driver.Settings(tmp_path, s.scale, s.launcher, env=env, allow_mixed_commits=True)
    assert driver.mixed_code_problem(s_mixed, seed2) is None
    # a run of the old driver (nothing recorded) counts as another code version
    (other / "provenance.json").unlink()
    assert "code not recorded," in driver.mixed_code_problem(s, seed2)
    # a run whose checkpoints another code wrote is not resumed by this one
    cos = grid.Run(grid.Variant("transformer", "cosine", (1.5, 0.5)), 1)
    _trained_by(s.run_dir(cos), "1" * 40, done=False)
    assert "111111111111" in driver.mixed_code_problem(s, [cos])
    # the driver's command line: one line, before anything is trained
    script = _script()
    assert script.main(["--smoke", "--out", str(tmp_path), "--only", "alignment"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--allow-mixed-commits" in err and "111111111111" in err
    assert not (tmp_path / "driver.log").exists()


def test_a_run_dir_of_another_command_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "runs" / "transformer-uniform-s1"
    d.mkdir(parents=True)
    (d / "cmd.json").write_text(json.dumps({"command": ["python", "pretrain/main.py", "--x"]}))
    p = _driver(tmp_path, "--only", "alignment", "--jobs", "1")
    assert p.returncode != 0 and "was started with another command" in p.stdout + p.stderr


@pytest.mark.slow
def test_smoke_every_path_and_kill_rerun_gives_the_same_tables(tmp_path: Path) -> None:
    """All experiments once through; then killed mid-way and rerun: identical tables."""
    a = _driver(tmp_path / "a")
    assert a.returncode == 0, a.stdout + a.stderr
    res_a = tmp_path / "a" / "report"
    assert check_results(res_a) >= 7 * 4 + 6 * 16 + 6 * 12
    # (g) at both sizes, one seed each: a number in every cell, no "not run yet"
    g = _tables((res_a / "RESULTS.md").read_text())["(g)"]
    assert len(g) == 4 and all("(1 seed)" in c for row in g for c in row[2:]), g
    for png in ("a_controlled", "b_sweep", "c_archs", "d_curves", "g_scale"):
        assert (res_a / "results" / f"{png}.png").stat().st_size > 1000
    _start_and_kill_after(tmp_path / "b", 10)
    b = _driver(tmp_path / "b")
    assert b.returncode == 0, b.stdout + b.stderr
    assert "runs already done" in b.stdout and "training: 0 of 38 runs" not in b.stdout
    assert _table_lines(tmp_path / "b" / "report" / "RESULTS.md") == _table_lines(
        res_a / "RESULTS.md"
    )


@pytest.mark.slow
def test_reproduction_tasks_keep_per_item_outputs(tmp_path: Path) -> None:
    """The zero-shot evaluation of the reproduction's four tasks, on a tiny model, saves each
    item's outcome, and they give the accuracy the harness reports."""
    from tiny_export import tiny_export, tiny_tokenizer

    from tapered_megatron.eval.zeroshot import main as zeroshot

    out, _ = tiny_export(tmp_path / "model", "transformer", tiny_tokenizer(tmp_path))
    args = ["--model", str(out), "--tasks", ",".join(driver.ZEROSHOT_TASKS), "--limit", "8"]
    assert zeroshot([*args, "--output", str(tmp_path / "zs")]) == 0
    got = json.loads((tmp_path / "zs" / "zeroshot.json").read_text())
    assert set(got["items"]) == set(driver.ZEROSHOT_TASKS) == set(got["tasks"])
    for task, bits in got["items"].items():
        assert len(bits) == 8 and set(bits) <= {"0", "1"}
        assert bits.count("1") / 8 == pytest.approx(got["tasks"][task]["acc"]), task
    assert not driver.zeroshot_stale(tmp_path / "zs" / "zeroshot.json", smoke=True)


@pytest.mark.slow
def test_second_corpus_is_the_python_docs_with_its_own_tokenizer(tmp_path: Path) -> None:
    from experiments.tlm import corpus
    from tapered_megatron.data import IndexedDataset, load_tokenizer

    docs = corpus.python_docs()
    assert len(docs) > 200 and sum(map(len, docs)) > 10**6
    settings = driver.Settings(tmp_path, grid.SCALES["cpu"], ["python"])
    tok, prefix = settings.second_corpus()
    tokens = IndexedDataset(prefix)
    assert tokens.num_documents == len(docs) and tokens.num_tokens > 300_000
    first = load_tokenizer(tok).decode(int(x) for x in tokens.document(0))
    assert first.split()[:5] == docs[0].split()[:5]
    cmd = settings.command(grid.Run(grid.experiment_variants("corpus")[1], 2))
    assert cmd[cmd.index("--data.path") + 1] == prefix
    assert cmd[cmd.index("--data.tokenizer_model") + 1] == tok


@pytest.mark.slow
def test_gpu_scale_without_gpu_prints_the_plan(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the driver would train")
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--scale",
            "440m",
            "--only",
            "controlled",
            "--out",
            str(tmp_path),
            "--launcher",
            "deepspeed --num_gpus 8",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )
    assert p.returncode == 0, p.stderr
    assert "GPU-hours per run" in p.stdout and "deepspeed --num_gpus 8" in p.stdout
    text = (tmp_path / "report" / "RESULTS.md").read_text()
    assert "## Launch plan" in text and "5376×8/2688×16" in text
    assert not (tmp_path / "runs").exists()
