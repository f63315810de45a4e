"""Reproduce the Tapered Language Models paper's experiments in one resumable command.

    python scripts/reproduce_tlm.py                        # cpu scale, 5 seeds, all experiments
    python scripts/reproduce_tlm.py --smoke --out /tmp/tlm # every path in a few minutes
    python scripts/reproduce_tlm.py --scale 440m --launcher "deepspeed --num_gpus 8" \\
        --data-path /data/pile_text_document --tokenizer-model /data/tok.model

Experiments (the paper's, arXiv 2606.23670): (a) ``controlled`` uniform vs
wider-early/middle/late thirds, (b) ``sweep`` cosine/linear/sigmoid x five ratio pairs,
(c) ``archs`` four architectures x {uniform, cosine 1.5/0.5, reverse}, with (d) validation
curves of all of them, (e) ``alignment`` (rho_block / rho_mlp of the uniform and tapered
Transformer) and (f) zero-shot scores of the (c) models, each item's outcome kept; (g)
``scale``: the (c) comparisons of the Transformer and Hope-attention again at a second, larger
size; and (h) ``corpus``: the Transformer's uniform / cosine 1.5/0.5 / reverse on a second corpus
of another domain, the Python documentation CPython ships ((g) and (h): cpu scale). Every
configuration gets ``--seeds`` seeds (default 5); ``--headline-seeds`` gives (c) and (g) more;
each invocation that trains also checks, once, that a short run trained twice on its machine
gives bitwise-equal losses (``<out>/rerun.json``). ``--archs`` trains and evaluates a subset of the
architectures (RESULTS.md still shows every planned row, the others as they were saved). Each run
is an ordinary ``pretrain/main.py`` job under ``--launcher``, evaluated as soon as it has trained;
finished runs and evaluations are skipped, so the command can be killed and rerun. A
configuration's runs are trained by one code version (``--allow-mixed-commits`` lets them mix).
At the end it copies each run's metrics to ``docs/results/runs/<run>/metrics.json`` (and
``driver_wall.json``, ``rerun.json`` beside them) and writes ``docs/RESULTS.md`` and the plots
under ``docs/results/`` from those files alone.

On a machine without a GPU, scales ``440m`` and up print the launch plan and its cost (GPU-hours
from the planner) and write the tables' structure instead of running.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shlex
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.tlm import driver, gpu_plan, grid, provenance, records, report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-path", default="", help="token-file prefix (default: sample corpus)")
    ap.add_argument("--tokenizer-model", default="", help="tokenizer of --data-path")
    ap.add_argument("--scale", default="cpu", choices=sorted(grid.SCALES))
    ap.add_argument("--seeds", type=int, default=5, help="seeds per configuration (default 5)")
    ap.add_argument(
        "--headline-seeds",
        type=int,
        default=0,
        help="seeds of the (c) archs and (g) scale configurations (default: --seeds)",
    )
    ap.add_argument("--out", default="runs/tlm", help="where runs live (default runs/tlm)")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated subset of " + ",".join(grid.EXPERIMENTS) + " (default: all the "
        "scale has; scale needs a second size, which the cpu scale has)",
    )
    ap.add_argument(
        "--archs",
        default="",
        help="comma-separated subset of " + ",".join(grid.ARCHS) + " whose runs to train and "
        "evaluate (default: all); the others' rows stay as they are",
    )
    ap.add_argument(
        "--allow-mixed-commits",
        action="store_true",
        help="train a configuration whose other runs were trained by other code",
    )
    ap.add_argument("--smoke", action="store_true", help="1 seed, tiny shapes, a few iterations")
    ap.add_argument(
        "--launcher",
        default="python",
        help='launcher prefix of each run (default "python"; e.g. "deepspeed --num_gpus 8")',
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="runs trained at once (default: 2 for the cpu scale with a plain python launcher "
        "on >= 2 cores, each with cores/2 threads; else 1)",
    )
    ap.add_argument(
        "--results-dir",
        default="",
        help="where RESULTS.md and results/ are written (default: the repo's docs/ for the "
        "default cpu run on the sample corpus, else <out>/report)",
    )
    ap.add_argument(
        "--no-report", action="store_true", help="train and evaluate only; write no RESULTS.md"
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="write RESULTS.md from the runs finished so far; train and evaluate nothing "
        "(safe while another invocation is running)",
    )
    return ap.parse_args(argv)


def _names(text: str) -> list[str]:
    """The names of a comma-separated option (``--only``, ``--archs``), blanks dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run (or plan) the experiments; return the exit code."""
    a = parse_args(argv)
    scale = grid.SCALES[a.scale]
    only = _names(a.only) or list(scale.experiments())
    bad = [x for x in only if x not in scale.experiments()]
    if bad:
        return _fail(
            f"--only {a.only!r}: choose from {','.join(scale.experiments())} (scale {scale.name})"
        )
    archs = _names(a.archs) or list(grid.ARCHS)
    if set(archs) - set(grid.ARCHS):
        return _fail(f"--archs {a.archs!r}: choose from {','.join(grid.ARCHS)}")
    if a.seeds < 1 or a.headline_seeds < 0:
        return _fail(f"--seeds {a.seeds} / --headline-seeds {a.headline_seeds}: need at least 1")
    if bool(a.data_path) != bool(a.tokenizer_model):
        return _fail("--data-path and --tokenizer-model go together; give both or neither")
    seeds = 1 if a.smoke else a.seeds
    headline_seeds = 1 if a.smoke else (a.headline_seeds or a.seeds)
    out = Path(a.out).resolve()
    vocab = 0
    if a.tokenizer_model:
        if not Path(a.tokenizer_model).is_file():
            return _fail(f"--tokenizer-model {a.tokenizer_model}: no such file")
        from tapered_megatron.data import load_tokenizer

        vocab = load_tokenizer(a.tokenizer_model).vocab_size
    launcher = shlex.split(a.launcher)
    if launcher and Path(launcher[-1]).name.startswith("python") and len(launcher) == 1:
        launcher = [sys.executable]
    cores = os.cpu_count() or 1
    plain = len(launcher) == 1 and "python" in Path(launcher[0]).name
    jobs = a.jobs or (2 if scale.name == "cpu" and plain and cores >= 2 else 1)
    settings = driver.Settings(
        out=out,
        scale=scale,
        launcher=launcher,
        data_path=a.data_path,
        tokenizer_model=a.tokenizer_model,
        vocab_size=vocab,
        smoke=a.smoke,
        threads=max(1, cores // jobs) if plain and scale.name == "cpu" else 0,
        # evaluations run in one python process each, beside the other jobs, on any launcher
        eval_threads=max(1, cores // jobs) if scale.name == "cpu" else 0,
        env=provenance.environment(driver.REPO),
        allow_mixed_commits=a.allow_mixed_commits,
    )
    planned = grid.plan_runs(only, seeds, headline_seeds)  # what RESULTS.md shows
    runs = [r for r in planned if r.variant.arch in archs]  # what this invocation trains
    if not a.report_only and not (scale.gpu and not _has_gpu()):
        problem = driver.mixed_code_problem(settings, runs)
        if problem:
            return _fail(problem)
    default_run = scale.name == "cpu" and not a.smoke and not a.data_path
    results = Path(a.results_dir or (driver.REPO / "docs" if default_run else out / "report"))
    meta = {
        "command": _command(argv),
        "machine": provenance.versions_label(settings.env),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "scale": scale.name,
        "seeds": seeds,
        "headline_seeds": headline_seeds,
        "second_size": _second_size(settings),
        "zeroshot_tasks": records.zeroshot_tasks_info(),
        "smoke": a.smoke,
        "only": only,
        "runs_planned": len(planned),
        "jobs": jobs,
        "missing_tools": [],
    }
    if scale.gpu and not _has_gpu():
        plan = gpu_plan.launch_plan(settings, runs)
        print(plan)
        if not a.no_report:
            meta.update(wall_s=0.0, plan=plan, note="no GPU here: launch plan only, nothing ran")
            meta["widths"] = gpu_plan.planned_widths(settings, runs)
            print(f"wrote {report.write_results(results, meta)}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    if a.report_only:
        return _report_only(settings, planned, results, meta)
    lock = open(out / ".driver.lock", "w")  # noqa: SIM115 - held for the driver's whole life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _fail(
            f"another reproduce_tlm.py is running on {out}; wait for it or use --report-only"
        )
    logf = open(out / "driver.log", "a")  # noqa: SIM115 - the driver's whole life

    def log(msg: str) -> None:
        line = f"{datetime.now().strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    t0 = time.time()
    log(f"reproduce_tlm: {_invocation(argv)} | {len(runs)} runs, {jobs} at a time | out {out}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ends the `with`: a last save
    with driver.invocation_wall(out) as walls:
        failed = driver.train_all(settings, runs, jobs, log, only)
        missing = driver.evaluate_all(settings, runs, only, log, jobs)
        if runs and not (out / "rerun.json").exists():
            driver.rerun_check(settings, runs[0], log)
    if failed:
        log(f"{failed} run(s) failed; rerun the same command to retry them")
    if not a.no_report:
        records.sync_records(settings, planned, results / "results" / "runs")
        records.keep_driver_files(out, results / "results")
        meta.update(
            wall_s=round(sum(walls), 1),
            invocations=len(walls),
            missing_tools=sorted(missing),
            rerun=records.driver_file(out, results / "results", "rerun.json"),
        )
        log(f"wrote {report.write_results(results, meta)}")
    log(f"finished in {time.time() - t0:.0f} s")
    return 1 if failed else 0


def _report_only(settings: driver.Settings, runs: list, results: Path, meta: dict) -> int:
    """RESULTS.md from the finished runs, without training or evaluating anything."""
    n = records.sync_records(settings, runs, results / "results" / "runs")
    records.keep_driver_files(settings.out, results / "results")
    walls = records.driver_file(settings.out, results / "results", "driver_wall.json") or []
    meta.update(wall_s=round(sum(walls), 1), invocations=len(walls), finished=n == len(runs))
    earlier = results / "results" / "meta.json"
    if not walls and earlier.is_file():  # no wall file anywhere: the last report's figure
        last = json.loads(earlier.read_text())
        if last.get("wall_s"):
            meta.update(wall_s=last["wall_s"], invocations=last["invocations"])
            meta["wall_source"] = last.get("wall_source") or (
                f"the report of {last['date']} (its per-invocation file was not kept then)"
            )
    meta["rerun"] = records.driver_file(settings.out, results / "results", "rerun.json")
    meta["missing_tools"] = sorted(
        phase
        for phase in grid.evaluation_phases(meta["only"])
        if importlib.util.find_spec(f"tapered_megatron.eval.{phase}") is None
    )
    if n < len(runs):
        meta["note"] = (
            f"written with --report-only while {n} of {len(runs)} runs had finished; "
            "the tables fill in as the remaining runs finish"
        )
    print(f"wrote {report.write_results(results, meta)}")
    return 0


def _invocation(argv: list[str] | None) -> str:
    """This invocation as typed (paths made repository-relative), for the driver's log."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "scripts/reproduce_tlm.py", *map(records.repo_relative, args)])


# Options that pick which of the planned runs an invocation trains, or what it writes, but not
# what the finished report holds: RESULTS.md's command leaves them out.
_SUBSET_FLAGS = ("--no-report", "--report-only", "--allow-mixed-commits")
_SUBSET_OPTIONS = ("--archs", "--jobs", "--results-dir")


def _command(argv: list[str] | None) -> str:
    """The command that trains, evaluates and reports every run of the report's plan, as
    RESULTS.md shows it: this invocation without the options that only select a subset of the
    runs or the output (``--archs``, ``--jobs``, ``--report-only``, ...), so a report assembled
    from several resumed or partial invocations names the one command that reproduces it."""
    args = sys.argv[1:] if argv is None else argv
    kept: list[str] = []
    skip = False
    for x in args:
        if skip:
            skip = False
        elif x in _SUBSET_FLAGS or x.split("=")[0] in _SUBSET_OPTIONS:
            skip = x in _SUBSET_OPTIONS  # its value is the next word
        else:
            kept.append(records.repo_relative(x))
    return shlex.join(["python", "scripts/reproduce_tlm.py", *kept])


def _second_size(settings: driver.Settings) -> str:
    """The (g) second size in words, from its resolved config ("" where the scale has none)."""
    if not settings.scale.second_size:
        return ""
    from tapered_megatron.config import load_config

    v = grid.Variant(size=grid.SECOND)
    over = [*settings.scale.overrides, *grid.shape_overrides(v, settings.scale, settings.smoke)]
    cfg = load_config(settings.scale.presets["transformer"], over)
    batch = cfg.train.global_batch_size or cfg.train.micro_batch_size
    tokens = cfg.train.iters * batch * cfg.model.seq_len
    return (
        f"d_model {cfg.model.d_model}, {cfg.model.layers} layers, {cfg.model.heads} heads, "
        f"baseline d_ff {cfg.model.d_ff}; {cfg.train.iters} iterations = {tokens:,} tokens "
        "per run"
    )


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
