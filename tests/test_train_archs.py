"""Every architecture trains through pretrain/main.py, tapered and uniform, under DP=2 and PP=2.

For each (architecture, schedule) the DP=2 (ZeRO-1) and PP=2 (pipeline + ZeRO-1) runs must give
the same 10-step loss curve (same seed, same global batch), and the loss must go down.
Slow (two launches per case); run with ``pytest -m slow tests/test_train_archs.py``.
"""

from __future__ import annotations

import math

import pytest
from arch_args import for_arch
from launch_helpers import assert_close, launch_ranks, metrics

ARCHS = ("transformer", "gated_attention", "titans", "hope_attention")
# Small memory chunks / windows for seq_len 16; two CMS levels so d_ff(l) = 32 still splits.
EXTRA = ["--model.titans.chunk_size", "8", "--model.titans.window", "8",
         "--model.hope.levels", "2", "--model.hope.periods", "0", "4"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["cosine", "uniform"])
@pytest.mark.parametrize("arch", ARCHS)
def test_arch_trains_under_dp2_and_pp2(arch, schedule, corpus, tmp_path):
    common = [*for_arch(arch, EXTRA), "--taper.schedule", schedule,
              "--train.exit_interval", "10"]  # fmt: skip
    curves = []
    for name, ds, extra in (
        ("dp2", "zero1.json", []),
        ("pp2", "pipeline.json", ["--parallel.pp", "2"]),
    ):
        out = tmp_path / name
        out.mkdir()
        launch_ranks(2, corpus, out, ds, [*common, *extra])
        log = (out / "log.txt").read_text()
        assert f"taper: {schedule}" in log
        curve = [r["loss"] for r in metrics(out)]
        assert len(curve) == 10 and all(math.isfinite(x) for x in curve)
        assert curve[-1] < curve[0]
        curves.append(curve)
    assert_close(curves[0], curves[1])
