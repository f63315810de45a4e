"""The driver of ``scripts/reproduce_tlm.py``: each run is an ordinary ``pretrain/main.py`` job.

Each run lives in ``<out>/runs/<run>/``::

    cmd.json        the launched command line (a rerun with another command is refused)
    provenance.json the code version, machine and package versions the run was trained with
                    (:mod:`experiments.tlm.provenance`; one configuration's runs share one code
                    version unless ``Settings.allow_mixed_commits``)
    metrics.jsonl   one JSON line per iteration (``--logging.metrics_file``), ``val_loss`` on
                    evaluation iterations
    checkpoints/    ``train.save_dir`` (the final checkpoint is what evaluation loads)
    train.log       the job's output
    done            written after the job exits 0 with a final ``val_loss``: the run is skipped
    alignment.json  / zeroshot/zeroshot.json / memory_probe.json (titans, hope_attention: loss
                    with the in-context memory on and off, tapered_megatron.eval.memory_probe):
                    evaluation results, skipped when present (a zero-shot result of another item
                    limit or task list, or without per-item outputs, is redone)

A killed run restarts with ``--resume auto`` (newest complete checkpoint, else a fresh start).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from experiments.tlm import corpus, provenance
from experiments.tlm.grid import SMOKE_OVERRIDES, Run, Scale, evaluation_phases, shape_overrides

REPO = Path(__file__).resolve().parents[2]
_WALL_EVERY_S = 10.0  # how often running wall times are saved (what a killed driver loses)


@dataclass
class Settings:
    """Everything a run's command line depends on."""

    out: Path
    scale: Scale
    launcher: list[str]
    data_path: str = ""
    tokenizer_model: str = ""
    vocab_size: int = 0
    smoke: bool = False
    threads: int = 0  # OMP_NUM_THREADS per job; 0: leave the environment alone
    eval_threads: int = 0  # the same for the evaluations (plain python processes)
    env: dict[str, Any] | None = None  # provenance.environment() of this checkout
    allow_mixed_commits: bool = False

    def eval_data(self) -> tuple[str, str]:
        """``(tokenizer_model, token-file prefix)`` evaluation reads: the user's data or the
        prepared sample corpus (whose tokenizer a run's config does not name)."""
        if self.data_path:
            return self.tokenizer_model, self.data_path
        from tapered_megatron import data

        return data.prepare_sample_corpus(self.out / "cache", self.scale_vocab())

    def scale_vocab(self) -> int:
        """The vocabulary size of the scale's presets (the smoke shapes included)."""
        from tapered_megatron.config import load_config

        over = [*self.scale.overrides, *(SMOKE_OVERRIDES if self.smoke else ())]
        return load_config(self.scale.presets["transformer"], over).model.vocab_size

    def second_corpus(self) -> tuple[str, str]:
        """``(tokenizer_model, token-file prefix)`` of the (h) second corpus, prepared under
        ``<out>/cache`` with the scale's vocabulary on first use."""
        return corpus.prepare_python_docs(self.out / "cache", self.scale_vocab())

    def job_env(self, evaluation: bool = False) -> dict[str, str]:
        """Environment of a training job (or with ``evaluation`` an evaluation): this checkout
        first on PYTHONPATH, the thread count pinned."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        threads = self.eval_threads if evaluation else self.threads
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        return env

    def run_dir(self, run: Run) -> Path:
        """Where ``run`` keeps its files."""
        return self.out / "runs" / run.name

    def command(self, run: Run) -> list[str]:
        """The ``pretrain/main.py`` command line of ``run`` (launcher prefix included)."""
        d = self.run_dir(run)
        args = [
            str(REPO / "pretrain" / "main.py"),
            "--config",
            self.scale.presets[run.variant.arch],
            *self.scale.overrides,
            *shape_overrides(run.variant, self.scale, self.smoke),
            *run.variant.overrides(),
            "--train.seed",
            str(1233 + run.seed),
            "--train.save_dir",
            str(d / "checkpoints"),
            "--train.keep_last",
            "1",
            "--logging.metrics_file",
            str(d / "metrics.jsonl"),
            "--data.cache_dir",
            str(self.out / "cache"),
        ]
        if run.variant.corpus:
            tok, prefix = self.second_corpus()
            args += ["--data.path", prefix, "--data.tokenizer_model", tok]
        elif self.data_path:
            args += ["--data.path", self.data_path, "--data.tokenizer_model", self.tokenizer_model]
        if self.vocab_size and not run.variant.corpus:
            args += ["--model.vocab_size", str(self.vocab_size)]
        return [*self.launcher, *args, "--resume", "auto"]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics JSONL, one per iteration (a resumed run's later record wins)."""
    by_it: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                by_it[int(rec["iteration"])] = rec
    return [by_it[k] for k in sorted(by_it)]


def is_done(settings: Settings, run: Run) -> bool:
    """Whether ``run`` finished (its ``done`` marker exists)."""
    return (settings.run_dir(run) / "done").exists()


def job_part(cmd: list[str]) -> list[str]:
    """``cmd`` without its launcher prefix (everything from ``pretrain/main.py`` on)."""
    return cmd[next(i for i, x in enumerate(cmd) if x.endswith("main.py")) :]


def _check_command(d: Path, cmd: list[str]) -> None:
    """Record ``cmd`` in ``d/cmd.json``; refuse a directory started with another job.

    The launcher prefix and the checkout (the path of ``main.py``) may change between reruns
    (another host, another launcher, the merged main branch); the job's arguments may not.
    """
    f = d / "cmd.json"
    if f.exists():
        old = json.loads(f.read_text())["command"]
        if job_part(old)[1:] != job_part(cmd)[1:]:
            raise SystemExit(
                f"error: {d} was started with another command ({shlex.join(old)}); "
                "use a fresh --out or delete that run directory"
            )
    d.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({"command": cmd}, indent=1))


def train_run(settings: Settings, run: Run, log: Callable[[str], None]) -> bool:
    """Train ``run`` unless done; return whether it finished now or before."""
    d = settings.run_dir(run)
    if is_done(settings, run):
        return True
    cmd = settings.command(run)
    _check_command(d, cmd)
    spent = d / "wall_s"  # seconds of every invocation of this run so far
    if not any((d / "checkpoints").glob("global_step*")):
        for stale in ("metrics.jsonl", "provenance.json", spent.name):  # a fresh start
            (d / stale).unlink(missing_ok=True)
    if settings.env is not None:
        provenance.record(d, settings.env)
    log(f"start {run.name}")
    rc = _run_job(cmd, d, settings.job_env(), spent)
    recs = read_metrics(d / "metrics.jsonl")
    final = [r for r in recs if "val_loss" in r]
    if rc != 0 or not final:
        log(f"FAILED {run.name} (exit {rc}); see {d / 'train.log'}")
        return False
    wall = float(spent.read_text())
    (d / "done").write_text(json.dumps({"val_loss": final[-1]["val_loss"], "wall_s": wall}))
    log(f"done {run.name} in {wall:.0f} s: val loss {final[-1]['val_loss']:.4f}")
    return True


def _run_job(cmd: list[str], d: Path, env: dict[str, str], spent: Path) -> int:
    """Run one training job in ``d``; return its exit code. Its wall time is added to ``spent``
    every few seconds, so the time of an invocation that was killed counts when the run
    resumes."""
    before = float(spent.read_text()) if spent.exists() else 0.0
    t0 = time.time()
    with open(d / "train.log", "a") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(d))
        try:
            while True:
                try:
                    rc = p.wait(timeout=_WALL_EVERY_S)
                except subprocess.TimeoutExpired:
                    rc = None
                _replace(spent, f"{before + time.time() - t0:.1f}")
                if rc is not None:
                    return rc
        except BaseException:  # the driver stops (SIGTERM, Ctrl-C): so does its job
            p.kill()
            p.wait()
            raise


def _replace(f: Path, text: str) -> None:
    """Write ``f`` whole through a temporary file, so a reader (or a kill) never sees half."""
    tmp = f.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, f)


def invocation_walls(out: Path) -> list[float]:
    """Wall seconds of each invocation of the driver on ``out`` so far (``driver_wall.json``)."""
    f = out / "driver_wall.json"
    return json.loads(f.read_text()) if f.exists() else []


@contextmanager
def invocation_wall(out: Path) -> Iterator[list[float]]:
    """Count this invocation's wall seconds in ``<out>/driver_wall.json`` (a list, one entry per
    invocation of the driver on ``out``). The entry is saved every few seconds while the
    invocation runs and once more when it ends, so an invocation killed outright (SIGKILL, its
    machine gone) still counts up to its last save. Yields the list; after the ``with`` block
    its sum is the time of every invocation so far."""
    f = out / "driver_wall.json"
    walls = [*invocation_walls(out), 0.0]
    t0 = time.time()
    stop = threading.Event()

    def save() -> None:
        walls[-1] = round(time.time() - t0, 1)
        _replace(f, json.dumps(walls))

    def keep_saving() -> None:
        while not stop.wait(_WALL_EVERY_S):
            save()

    saver = threading.Thread(target=keep_saving, daemon=True)
    save()
    saver.start()
    try:
        yield walls
    finally:
        stop.set()
        saver.join()
        save()


# The same-machine rerun check: how many iterations its short run trains (one evaluation at
# the end), twice from scratch.
RERUN_ITERS = 40


def _with(cmd: list[str], key: str, value: str) -> list[str]:
    """``cmd`` with ``key``'s value set to ``value`` (replaced where given, else appended)."""
    if key in cmd:
        i = cmd.index(key)
        return [*cmd[: i + 1], value, *cmd[i + 2 :]]
    return [*cmd, key, value]


def rerun_check(settings: Settings, run: Run, log: Callable[[str], None]) -> dict[str, Any] | None:
    """Train ``run`` for :data:`RERUN_ITERS` iterations twice from scratch on this machine
    (``<out>/rerun/{a,b}``) and compare every logged loss bit for bit; the result (also saved as
    ``<out>/rerun.json``) names the run, the machine and CPU, whether all losses are equal and the
    largest difference. None (logged, nothing saved: the next invocation tries again) when a
    training fails."""
    losses = []
    for part in ("a", "b"):
        d = settings.out / "rerun" / part
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        cmd = settings.command(run)
        for key, value in (
            ("--train.save_dir", str(d / "checkpoints")),
            ("--logging.metrics_file", str(d / "metrics.jsonl")),
            ("--train.iters", str(RERUN_ITERS)),
            ("--eval.interval", str(RERUN_ITERS)),
            ("--train.save_interval", str(RERUN_ITERS)),
        ):
            cmd = _with(cmd, key, value)
        log(f"rerun check {run.name} ({part}): {RERUN_ITERS} iterations")
        with open(d / "train.log", "w") as f:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=settings.job_env()
            ).returncode
        if rc != 0:
            log(f"FAILED rerun check {run.name} ({part}, exit {rc}); see {d / 'train.log'}")
            return None
        recs = read_metrics(d / "metrics.jsonl")
        losses.append([r.get(k) for r in recs for k in ("loss", "val_loss") if k in r])
    a, b = losses
    diff = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    env = settings.env or {}
    result = {
        "run": run.name,
        "iterations": RERUN_ITERS,
        "losses_compared": len(a),
        "bitwise_equal": a == b,
        "max_abs_loss_diff": diff,
        "machine": provenance.versions_label(env) if env else provenance.machine(),
        "cpu": provenance.cpu_label(env)
        if env
        else provenance.cpu_label({"cpu": provenance.cpu()}),
        "code": provenance.code_label(env) if env else "not recorded",
    }
    _replace(settings.out / "rerun.json", json.dumps(result, indent=1) + "\n")
    return result


def _recorded_code(run_dir: Path) -> list[dict[str, Any] | None]:
    """Code versions a run directory's training used (None: trained, but nothing recorded)."""
    seen = provenance.read(run_dir)
    started = (run_dir / "done").exists() or any((run_dir / "checkpoints").glob("global_step*"))
    if not started:
        return []
    keys = ("commit", "clean", "changes")
    return [{k: e[k] for k in keys} for e in seen] if seen else [None]


def mixed_code_problem(settings: Settings, runs: list[Run]) -> str | None:
    """Why training ``runs`` now would mix code versions within one configuration (its other
    seeds, or this run's own earlier part, trained by another checkout); None when it would not.
    """
    if settings.env is None or settings.allow_mixed_commits:
        return None
    now = {k: settings.env[k] for k in ("commit", "clean", "changes")}
    root = settings.out / "runs"
    for key in sorted({r.variant.key for r in runs if not is_done(settings, r)}):
        pattern = re.compile(re.escape(key) + r"-s\d+")
        dirs = [d for d in root.iterdir() if pattern.fullmatch(d.name)] if root.is_dir() else []
        other = {provenance.code_label(c) for d in dirs for c in _recorded_code(d)}
        other.discard(provenance.code_label(now))
        if other:
            return (
                f"{key} has runs trained by code {', '.join(sorted(other))}, and this checkout "
                f"is {provenance.code_label(now)}; train it from that code, use a fresh --out, "
                "or pass --allow-mixed-commits"
            )
    return None


def train_all(
    settings: Settings,
    runs: list[Run],
    jobs: int,
    log: Callable[[str], None],
    experiments: Iterable[str] = (),
) -> int:
    """Train every unfinished run, ``jobs`` at a time, each evaluated (the phases
    ``experiments`` ask of it) as soon as it has trained, so that a killed invocation leaves every
    finished run evaluated and its checkpoints no longer needed; return the number that failed.
    ``evaluate_all`` afterwards catches what is left and reports missing tools."""
    todo = [r for r in runs if not is_done(settings, r)]
    log(f"training: {len(runs) - len(todo)} of {len(runs)} runs already done, {len(todo)} to go")
    phases = evaluation_phases(experiments)
    if phases:
        settings.eval_data()  # the sample corpus prepared once, before the jobs read it

    def train_and_evaluate(run: Run) -> bool:
        if not train_run(settings, run, log):
            return False
        for phase, variants in phases.items():
            if run.variant in variants:
                evaluate_run(settings, run, phase, log)
        return True

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        ok = list(pool.map(train_and_evaluate, todo))
    return ok.count(False)


def last_json_line(text: str) -> dict[str, Any]:
    """The last line of ``text`` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON line in the tool's output")


def _tool_missing(output: str) -> bool:
    return "No module named" in output or "ImportError" in output


# The zero-shot tasks of (f): the two default local tasks, and two built for the reproduction
# on which its small models score clearly above chance (tasks/reproduction/).
ZEROSHOT_TASKS = (
    "tm_shakespeare_lastword",
    "tm_shakespeare_nextline",
    "tm_shakespeare_lastchoice",
    "tm_shakespeare_wordswap",
)


def zeroshot_stale(result: Path, smoke: bool) -> bool:
    """Whether a saved zero-shot result must be redone: evaluated on another item limit, on
    other tasks, or without the per-item outputs the item-level tests need."""
    saved = json.loads(result.read_text())
    items = saved.get("items") or {}
    return (
        saved.get("limit") != (8 if smoke else None)
        or set(saved["tasks"]) != set(ZEROSHOT_TASKS)
        or set(items) != set(ZEROSHOT_TASKS)
    )


def evaluate_run(settings: Settings, run: Run, phase: str, log: Callable[[str], None]) -> str:
    """Run one evaluation ``phase`` (``alignment`` | ``zeroshot`` | ``memory_probe``) on a
    trained run.

    Returns ``"ok"``, ``"skipped"`` (result already there), ``"missing"`` (the tool's module is
    not installed) or ``"failed"``.
    """
    d = settings.run_dir(run)
    ckpt = str(d / "checkpoints")
    if phase == "alignment":
        target = d / "alignment.json"
        args = ["-m", "tapered_megatron.eval.alignment", "--checkpoint", ckpt]
        args += ["--data-path", settings.eval_data()[1], "--tokens"]
        args += [str(256 if settings.smoke else settings.scale.alignment_tokens), "--json"]
    elif phase == "memory_probe":  # the validation tokens alignment reads, at 1x and 4x seq_len
        target = d / "memory_probe.json"
        args = ["-m", "tapered_megatron.eval.memory_probe", "--checkpoint", ckpt]
        args += ["--data-path", settings.eval_data()[1], "--max-tokens"]
        args += [str(256 if settings.smoke else settings.scale.alignment_tokens), "--json"]
    elif phase == "zeroshot":
        target = d / "zeroshot" / "zeroshot.json"
        args = ["-m", "tapered_megatron.eval.zeroshot", "--checkpoint", ckpt]
        args += ["--tokenizer-model", settings.eval_data()[0], "--tasks", ",".join(ZEROSHOT_TASKS)]
        args += (["--limit", "8"] if settings.smoke else []) + ["--output", str(d / "zeroshot")]
    else:
        raise ValueError(f"unknown evaluation phase {phase!r}")
    if phase == "zeroshot" and target.exists() and zeroshot_stale(target, settings.smoke):
        target.unlink()
    if target.exists():
        return "skipped"
    env = settings.job_env(evaluation=True)
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=str(d))
    out = p.stdout + p.stderr
    (d / f"{phase}.log").write_text(out)
    if p.returncode != 0:
        if _tool_missing(out):
            return "missing"
        log(f"FAILED {phase} on {run.name} (exit {p.returncode}); see {d / f'{phase}.log'}")
        return "failed"
    if phase in ("alignment", "memory_probe"):
        try:
            result = last_json_line(p.stdout)
        except ValueError:
            log(f"FAILED {phase} on {run.name}: no JSON line; see {d / f'{phase}.log'}")
            return "failed"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(target)
    elif not target.exists():
        log(f"FAILED {phase} on {run.name}: {target} not written")
        return "failed"
    return "ok"


def evaluate_all(
    settings: Settings,
    runs: list[Run],
    experiments: Iterable[str],
    log: Callable[[str], None],
    jobs: int = 1,
) -> set[str]:
    """Run the evaluation phases on every finished run, ``jobs`` at a time; return the phases
    whose tool is missing (its module, or one it imports, is not installed: reported once, the
    phase's table left out)."""
    missing: set[str] = set()
    phases = evaluation_phases(experiments)
    if phases:
        settings.eval_data()  # the sample corpus prepared once, before the jobs read it
    for phase, variants in phases.items():
        todo = [r for r in runs if r.variant in variants and is_done(settings, r)]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            statuses = list(pool.map(partial(evaluate_run, settings, phase=phase, log=log), todo))
        if "missing" in statuses:
            log(
                f"{phase}: tapered_megatron.eval.{phase} is not installed (No module named "
                f"...); its table is left out. Rerun this command once it is."
            )
            missing.add(phase)
            continue
        log(
            f"{phase}: {statuses.count('ok')} evaluated, {statuses.count('skipped')} already "
            f"done, {statuses.count('failed')} failed"
        )
    return missing
