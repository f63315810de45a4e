"""fp16 with dynamic loss scaling through pretrain/main.py (DeepSpeed's fp16 optimizers).

Overflowing steps are skipped and counted, the loss scale halves until the gradients fit and is
visible in the log; the trained run matches fp32 within fp16's precision; resume in the same
layout is bitwise. DeepSpeed's CPU accelerator reports fp16 as supported only through
``fp16_on_cpu.py`` (torch computes it on any CPU).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch_helpers import ROOT, launch_ranks, metrics

pytestmark = pytest.mark.distributed
WRAP = str(Path(__file__).with_name("fp16_on_cpu.py"))


def _fp16_config(tmp_path: Path, power: int) -> str:
    ds = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    ds.pop("bf16")
    ds["fp16"] = {
        "enabled": True, "initial_scale_power": power, "loss_scale_window": 4, "hysteresis": 1,
    }  # fmt: skip
    path = tmp_path / f"fp16_{power}.json"
    path.write_text(json.dumps(ds))
    return str(path)


def _run(out: Path, ds: str, corpus: str, extra: list[str]) -> str:
    """Train one rank of the tiny model in fp16 on this CPU; return its output."""
    out.mkdir(exist_ok=True)
    launch_ranks(1, corpus, out, ds, ["--logging.interval", "1", *extra], 600, (WRAP,))
    return (out / "log.txt").read_text()


def test_overflow_steps_are_skipped_counted_and_the_scale_falls(corpus, tmp_path):
    """Scale 2^30 overflows fp16: the first steps are skipped (no update, the LR schedule
    waits), the scale halves each time and is logged, then training proceeds."""
    log = _run(tmp_path, _fp16_config(tmp_path, 30), corpus, [])
    got = metrics(tmp_path)
    skipped = [r["iteration"] for r in got if r.get("skipped")]
    assert skipped[:5] == [1, 2, 3, 4, 5], skipped
    assert "iteration 1: fp16 gradient overflow: step skipped, loss scale 5.36871e+08" in log
    first_ok = next(r for r in got if not r.get("skipped"))
    assert first_ok["lr"] == got[0]["lr"]  # the schedule did not advance on skipped steps
    assert math.isfinite(first_ok["grad_norm"]) and first_ok["grad_norm"] < 100  # unscaled
    scales = [float(x.split("loss scale ")[1].split(" ")[0]) for x in log.splitlines()
              if x.startswith("iter ") and "loss scale" in x]  # fmt: skip
    assert scales[0] == pytest.approx(2.0**29, rel=1e-5) and min(scales) < 2.0**20
    assert f"skipped {len(skipped)}" in log
    assert got[-1]["loss"] < got[0]["loss"] - 0.25


@pytest.mark.slow
def test_fp16_follows_fp32_and_resumes_bitwise(corpus, tmp_path):
    """Scale 2^12 (no overflow at this size): 20 fp16 steps stay within 2 % of the fp32 run's
    losses; stopping at 10 and resuming gives the uninterrupted fp16 run's losses bitwise."""
    fp16 = _fp16_config(tmp_path, 12)
    ref, whole, run = (tmp_path / n for n in ("fp32", "whole", "run"))
    _run(ref, str(ROOT / "ds_configs" / "zero0.json"), corpus, [])
    _run(whole, fp16, corpus, [])
    _run(run, fp16, corpus, ["--train.exit_interval", "10"])
    _run(run, fp16, corpus, ["--resume", "auto"])
    want = [r["loss"] for r in metrics(whole)]
    assert not any(r.get("skipped") for r in metrics(whole))
    assert [r["loss"] for r in metrics(run)] == want
    assert want == pytest.approx([r["loss"] for r in metrics(ref)], rel=0.02)
