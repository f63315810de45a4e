"""Does a GPU preset's Titans memory train stably at its sequence length? Trained on the CPU at
reduced width: the ``titans_cpu`` model and recipe (d_model 128 -> ``--d-model``, ``--layers``
layers, the sample corpus, peak LR 3e-3 after 30 warm-up iterations) with the sequence length and
every ``model.titans`` setting of the GPU preset (``--preset``, e.g. ``titans_440m``: 4096 tokens,
chunks of 8, a 1024-token window), one sequence per step.

Stability (the criteria Titans is held to): no non-finite gradient (a skipped step), no gradient
norm above ``MAX_NORM`` anywhere, none after the first 10 % of iterations above ``LATE_FACTOR``
times the run's median, no loss spike flagged by the trainer, and the per-token memory clip (when
active) scaling down a minority of token-heads. Prints one JSON line: the largest gradient norm
and its iteration, the largest after the first 10 %, the median, the iterations whose gradient
was not finite, the loss over the first and last 10 iterations, the clip's largest logged share,
seconds per iteration (median), and ``stable``.

Usage::

    python scripts/bench_titans_stability.py [--preset titans_440m] [--iters 300]
        [--d-model 256] [--layers 2] [--out DIR] [-- --model.titans.memory_clip 1 ...]

Anything after ``--`` overrides the run (e.g. another memory rule to compare with the preset's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import ROOT, emit, stamp

from tapered_megatron.config import load_config

MAX_NORM = 100.0  # no gradient norm above this anywhere
LATE_FACTOR = 10.0  # after the first 10 % of iterations, none above this times the median


def run_flags(preset: str, iters: int, d_model: int, out: Path, extra: list[str]) -> list[str]:
    """``pretrain/main.py``'s flags: ``titans_cpu`` at ``d_model`` with the GPU preset's sequence
    length and every ``model.titans`` setting, those that ``extra`` (``--key value...``) names
    replaced by its values."""
    model = load_config(preset).model
    flags = {
        "--config": ["titans_cpu"], "--model.seq_len": [str(model.seq_len)],
        "--model.d_model": [str(d_model)], "--model.d_ff": [str(d_model * 208 // 128)],
        "--train.micro_batch_size": ["1"], "--train.iters": [str(iters)],
        "--train.save_interval": ["0"], "--eval.interval": ["0"], "--logging.interval": ["1"],
        "--logging.metrics_file": [str(out / "metrics.jsonl")],
        "--train.save_dir": [str(out / "checkpoints")], "--data.cache_dir": [str(out / "cache")],
    }  # fmt: skip
    for f in dataclasses.fields(model.titans):
        value = getattr(model.titans, f.name)
        words = value if isinstance(value, tuple) else (value,)
        flags[f"--model.titans.{f.name}"] = [str(w).lower() for w in words]
    for word in extra:
        if word.startswith("--"):
            key = word
            flags[key] = []
        else:
            flags[key].append(word)
    return [w for key, values in flags.items() for w in (key, *values)]


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The stability figures of one run's per-iteration metrics (``pretrain/main.py``'s metrics
    file at ``logging.interval 1``)."""
    iters = len(records)
    nonfinite = [r["iteration"] for r in records if not math.isfinite(r["grad_norm"])]
    norms = [(r["iteration"], r["grad_norm"]) for r in records if math.isfinite(r["grad_norm"])]
    median = statistics.median(n for _, n in norms)
    top_it, top = max(norms, key=lambda p: p[1])
    late = [(it, n) for it, n in norms if it > iters / 10]
    late_it, late_top = max(late, key=lambda p: p[1])
    losses = [r["loss"] for r in records]
    spikes = [r["iteration"] for r in records if r.get("loss_spike")]
    clip = max((r.get("memory_clip", 0.0) for r in records), default=0.0)
    return {
        "iterations": iters,
        "nonfinite_grad_norm": nonfinite,
        "max_grad_norm": top,
        "max_grad_norm_iteration": top_it,
        "max_grad_norm_after_10pct": late_top,
        "max_after_10pct_iteration": late_it,
        "median_grad_norm": median,
        "loss_first10": statistics.mean(losses[:10]),
        "loss_last10": statistics.mean(losses[-10:]),
        "loss_spikes": spikes,
        "max_memory_clip_share": clip,
        "s_per_iteration": statistics.median(r["step_s"] for r in records),
        "stable": not nonfinite and top <= MAX_NORM and late_top <= LATE_FACTOR * median
        and not spikes and clip < 0.5,
    }  # fmt: skip


def train(preset: str, iters: int, d_model: int, layers: int, out: Path, extra: list[str]) -> int:
    """Train the reduced-width model with the preset's Titans settings; the trainer's exit code."""
    flags = run_flags(preset, iters, d_model, out, ["--model.layers", str(layers), *extra])
    main = ROOT / "pretrain" / "main.py"
    return subprocess.run(
        [sys.executable, str(main), *flags], cwd=out, stdout=subprocess.DEVNULL
    ).returncode


def main() -> None:
    """Train, then print the run's stability figures as one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="titans_440m")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default="", help="run folder (default: a temporary one)")
    p.add_argument("extra", nargs="*", help="overrides after --")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        code = train(a.preset, a.iters, a.d_model, a.layers, out, a.extra)
        lines = (out / "metrics.jsonl").read_text().splitlines()
        result = summarise([json.loads(line) for line in lines])
    emit({
        "bench": "titans_stability", "preset": a.preset, "d_model": a.d_model,
        "layers": a.layers, "overrides": " ".join(a.extra), "exit_code": code, **result,
        **stamp(),
    })  # fmt: skip


if __name__ == "__main__":
    main()
