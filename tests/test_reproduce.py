"""scripts/reproduce_tlm.py: experiment matrix, statistics, resumable driver, RESULTS.md numbers."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.tlm import driver, grid, prose, records, report, stats
from tapered_megatron.config import load_config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "reproduce_tlm.py"
DOCS = REPO / "docs"


# ----------------------------------------------------------------------------- statistics
def test_seed_statistics_and_paired_comparison() -> None:
    base = stats.Stat({1: 10.0, 2: 12.0, 3: 11.0})
    assert base.mean == pytest.approx(11.0) and base.std == pytest.approx(1.0)
    noisy = stats.Paired(stats.Stat({1: 9.0, 2: 11.5, 3: 10.0}), base)
    assert noisy.diffs.values == pytest.approx({1: -1.0, 2: -0.5, 3: -1.0})
    assert noisy.diffs.mean == pytest.approx(-5 / 6)
    assert noisy.diffs.std == pytest.approx(statistics.stdev([-1.0, -0.5, -1.0]))
    # |-0.83| is below the configuration's own seed std (1.26): not beyond the spread
    assert noisy.spread == pytest.approx(statistics.stdev([9.0, 11.5, 10.0]))
    assert noisy.exceeds == "no"
    shifted = stats.Paired(stats.Stat({s: v - 3 for s, v in base.values.items()}), base)
    assert shifted.diffs.std == pytest.approx(0.0) and shifted.exceeds == "yes"
    # only seeds both sides have are paired; one seed has no spread
    one = stats.Paired(stats.Stat({1: 9.0, 4: 1.0}), base)
    assert one.diffs.values == {1: -1.0} and one.exceeds == "n/a"
    assert stats.pm(base) == "11.00 ± 1.00" and stats.signed_pm(noisy.diffs) == "-0.83 ± 0.29"


def test_verdict_wording_follows_sign_and_spread() -> None:
    base = stats.Stat({1: 10.0, 2: 10.5})
    better = stats.Paired(stats.Stat({1: 8.0, 2: 8.5}), base)
    assert prose.verdict(better, expect_negative=True) == "held, beyond the seed spread"
    assert prose.verdict(better, expect_negative=False).startswith("did not hold: the opposite")
    close = stats.Paired(stats.Stat({1: 9.9, 2: 10.6}), base)
    assert "within the seed spread" in prose.verdict(close, expect_negative=True)


# ----------------------------------------------------------------------------- matrix
def test_matrix_dedupes_shared_configurations() -> None:
    runs = grid.plan_runs(grid.EXPERIMENTS, 3)
    variants = {r.variant for r in runs}
    # 4 controlled + 15 swept + 10 new in (c) (transformer uniform and cosine 1.5/0.5 shared)
    assert len(variants) == 29 and len(runs) == 87
    assert len({r.name for r in runs}) == 87
    assert [r.seed for r in runs[:29]] == [1] * 29  # seed-major: complete tables appear early
    assert grid.Variant("transformer", "cosine", (1.5, 0.5)) in grid.experiment_variants("sweep")
    assert grid.Variant("transformer", "cosine", (1.5, 0.5)) in grid.experiment_variants("archs")
    mults = {v.ratio for v in grid.experiment_variants("controlled") if v.schedule == "step"}
    assert mults == {(1.5, 0.75, 0.75), (0.75, 1.5, 0.75), (0.75, 0.75, 1.5)}
    assert len(grid.plan_runs(["controlled"], 2)) == 8


@pytest.mark.parametrize("smoke", [False, True])
def test_every_planned_run_is_a_valid_budget_preserving_config(smoke: bool) -> None:
    for v in {r.variant for r in grid.plan_runs(grid.EXPERIMENTS, 1)}:
        over = [*(grid.SMOKE_OVERRIDES if smoke else ()), *v.overrides()]
        cfg = load_config(grid.SCALES["cpu"].presets[v.arch], over)
        plan = cfg.taper_plan
        assert sum(plan.widths) == cfg.model.layers * cfg.model.d_ff, v.key
        assert cfg.model.arch == v.arch
        if v.schedule != "step":
            # monotone, mirrored when reversed
            w = plan.widths[::-1] if v.reverse else plan.widths
            assert all(a >= b for a, b in itertools.pairwise(w)), v.key


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
    ):
        p = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
            capture_output=True,
            text=True,
            env=_env(),
        )
        assert p.returncode == 2 and needle in p.stderr and len(p.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- RESULTS.md checks
def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Rows (header excluded) of each ``## (x)`` section's table."""
    out: dict[str, list[list[str]]] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:6]
        elif line.startswith("|") and not line.startswith("|---"):
            out.setdefault(section, []).append(_cells(line))
    return {k: rows[1:] for k, rows in out.items()}


def _fmt(xs: list[float], signed: bool = False, digits: int = 2) -> str:
    if not xs:
        return "—"
    m = statistics.fmean(xs)
    head = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return head if len(xs) == 1 else f"{head} ± {statistics.stdev(xs):.{digits}f}"


def _expected_row(recs: list[dict], variant: str, base: str) -> list[str]:
    """The four comparison cells, recomputed here from the records without the report module."""
    ppl = {r["seed"]: math.exp(r["final_val_loss"]) for r in recs if r["variant"] == variant}
    ref = {r["seed"]: math.exp(r["final_val_loss"]) for r in recs if r["variant"] == base}
    seeds = ", ".join(f"{ppl[s]:.2f}" for s in sorted(ppl)) or "—"
    if variant == base or not ppl:
        return [_fmt(list(ppl.values())), seeds, "—", "—"]
    d = [ppl[s] - ref[s] for s in sorted(set(ppl) & set(ref))]
    if len(d) < 2:
        beyond = "n/a"
    else:
        spread = max(statistics.stdev(ppl.values()), statistics.stdev(ref.values()))
        beyond = "yes" if abs(statistics.fmean(d)) > max(spread, statistics.stdev(d)) else "no"
    return [_fmt(list(ppl.values())), seeds, _fmt(d, signed=True), beyond]


def check_results(results_dir: Path) -> int:
    """Recompute RESULTS.md under ``results_dir`` from its saved files; return rows checked."""
    text = (results_dir / "RESULTS.md").read_text()
    meta = json.loads((results_dir / "results" / "meta.json").read_text())
    recs = records.load_records(results_dir / "results" / "runs")
    # 1. the whole document (tables, reading, links) is what the saved files give
    assert report.render(recs, meta) == text
    # 2. the comparison columns, recomputed independently of the report module
    tables = _tables(text)
    checked = 0
    uni = grid.UNIFORM.key
    if "controlled" in meta["only"]:
        for row, v in zip(tables["(a)"], grid.experiment_variants("controlled"), strict=True):
            assert row[0] == v.label and row[-4:] == _expected_row(recs, v.key, uni), row
            checked += 1
    if "sweep" in meta["only"]:
        for row, v in zip(tables["(b)"], grid.experiment_variants("sweep"), strict=True):
            assert row[-4:] == _expected_row(recs, v.key, uni), row
            if v.schedule != "uniform":
                assert row[:2] == [v.schedule, f"{v.ratio[0]:g}/{v.ratio[1]:g}"]
            checked += 1
    if "archs" in meta["only"]:
        for row, v in zip(tables["(c)"], grid.experiment_variants("archs"), strict=True):
            assert row[:2] == [v.arch, v.label]
            assert row[-4:] == _expected_row(recs, v.key, grid.Variant(v.arch).key), row
            checked += 1
    if "(e)" in tables:
        uni_v, tap_v = grid.experiment_variants("alignment")
        for row in tables["(e)"]:
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
    if "(f)" in tables:
        for row, v in zip(tables["(f)"], grid.experiment_variants("archs"), strict=True):
            xs = [
                100 * r["zeroshot"]["average_acc"]
                for r in recs
                if r["variant"] == v.key and r.get("zeroshot")
            ]
            assert row[3] == _fmt(xs)
            checked += 1
    return checked


def test_committed_results_are_recomputed_from_saved_metrics() -> None:
    if not (DOCS / "RESULTS.md").exists():
        pytest.skip("docs/RESULTS.md not generated yet")
    assert check_results(DOCS) > 0
    for rec in records.load_records(DOCS / "results" / "runs"):
        # every model trained past its fast drop: the last evaluation interval moved the loss by
        # less than 15% of what the first one did
        curve = [c[2] for c in rec["val_curve"]]
        assert len(curve) >= 4, rec["run"]
        assert abs(curve[-1] - curve[-2]) < 0.15 * abs(curve[0] - curve[1]), rec["run"]


# ----------------------------------------------------------------------------- real driver runs
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _driver(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=900,
    )


def _start_and_kill_after(out: Path, finished: int, *args: str) -> None:
    """Start the driver, SIGKILL it (and its jobs) once ``finished`` runs are done."""
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
            if log.exists() and log.read_text().count(" done ") >= finished:
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


def test_killed_driver_reruns_only_what_is_left(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _start_and_kill_after(out, 1, "--only", "alignment", "--jobs", "1")
    first = out / "runs" / "transformer-uniform-s1"
    assert (first / "done").exists()
    assert not (out / "runs" / "transformer-cosine-1.5-0.5-s1" / "done").exists()
    kept = (first / "metrics.jsonl").read_bytes()

    p = _driver(out, "--only", "alignment", "--jobs", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "training: 1 of 2 runs already done, 1 to go" in p.stdout
    assert (first / "metrics.jsonl").read_bytes() == kept  # the finished run was not touched
    second = driver.read_metrics(out / "runs" / "transformer-cosine-1.5-0.5-s1" / "metrics.jsonl")
    assert [r["iteration"] for r in second] == [1, 2, 3, 4]
    if importlib.util.find_spec("tapered_megatron.eval.alignment") is None:
        assert "tapered_megatron.eval.alignment is not installed" in p.stdout
        assert "Not measured" in (out / "report" / "RESULTS.md").read_text()
    else:
        assert (first / "alignment.json").exists()
    check_results(out / "report")
    tables = _table_lines(out / "report" / "RESULTS.md")

    full = {"command": "python scripts/reproduce_tlm.py --out somewhere"}  # as if run before
    (out / "command.json").write_text(json.dumps(full))
    again = _driver(out, "--only", "alignment", "--jobs", "1")
    assert "training: 2 of 2 runs already done, 0 to go" in again.stdout
    assert _table_lines(out / "report" / "RESULTS.md") == tables
    # a rerun of a subset keeps the directory's full command as what RESULTS.md shows
    assert json.loads((out / "command.json").read_text()) == full
    assert f"Command: `{full['command']}`" in (out / "report" / "RESULTS.md").read_text()


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
    assert check_results(res_a) >= 4 + 16 + 12
    for png in ("a_controlled", "b_sweep", "c_archs", "d_curves"):
        assert (res_a / "results" / f"{png}.png").stat().st_size > 1000
    _start_and_kill_after(tmp_path / "b", 10)
    b = _driver(tmp_path / "b")
    assert b.returncode == 0, b.stdout + b.stderr
    assert "runs already done" in b.stdout and "0 of 29 runs already done" not in b.stdout
    assert _table_lines(tmp_path / "b" / "report" / "RESULTS.md") == _table_lines(
        res_a / "RESULTS.md"
    )


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
