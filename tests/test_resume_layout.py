"""Resume on a different layout (real ranks through pretrain/main.py).

A run saves at iteration 10 under one (TP, PP, DP, ZeRO stage, pipeline unit) and continues to
20 under another; iterations 11-20 must equal the uninterrupted single-process run within 1e-5
relative, and the log must name the layout change.
"""

from __future__ import annotations

import json

import pytest
from train_runs import ROOT, assert_close, launch_ranks, metrics

pytestmark = pytest.mark.distributed

RTOL = 1e-5
T = 600  # seconds per launch (the shared CI box can be slow to start 4 ranks)
TP2 = (2, "zero1.json", ["--parallel.tp", "2"])
TP1_PP2_DP2 = (4, "pipeline.json", ["--parallel.pp", "2"])
PP2_SUBLAYER_Z1 = (
    2,
    "pipeline.json",
    ["--parallel.pp", "2", "--parallel.pipeline_unit", "sublayer"],
)
DP2_Z3 = (2, "zero3.json", [])
ONE_Z0 = (1, "zero0.json", [])
DP3_Z3 = (3, "zero3.json", [])
TITANS = ["--model.arch", "titans", "--model.titans.chunk_size", "8"]
GB12 = ["--train.global_batch_size", "12"]  # DP3: sizes not a multiple of 3 (padded partitions)

# case: (saved under, resumed under, arguments of every run incl. the reference)
CASES = {
    "pp2-sublayer-zero1->dp2-zero3": (PP2_SUBLAYER_Z1, DP2_Z3, []),
    "tp2->tp1-pp2-dp2": (TP2, TP1_PP2_DP2, []),
    "titans:pp2-sublayer-zero1->dp2-zero3": (PP2_SUBLAYER_Z1, DP2_Z3, TITANS),
    "titans:tp2->tp1-pp2-dp2": (TP2, TP1_PP2_DP2, TITANS),
    "zero0->dp3-zero3": (ONE_Z0, DP3_Z3, GB12),  # ZeRO-0 save, uneven ZeRO-3 load
    "dp3-zero3->zero0": (DP3_Z3, ONE_Z0, GB12),  # uneven ZeRO-3 save, ZeRO-0 load
}
DEFAULT = {"pp2-sublayer-zero1->dp2-zero3"}


def _ds(name: str, tmp_path) -> str:
    if name != "zero3.json":
        return name
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition everything
    path = tmp_path / "zero3_all.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    "case", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_resume_under_another_layout(case, corpus, tmp_path):
    (n0, ds0, x0), (n1, ds1, x1), common = CASES[case]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    launch_ranks(1, corpus, ref_dir, "zero0.json", common, timeout=T)
    ref = [r["loss"] for r in metrics(ref_dir)]
    run = tmp_path / "run"
    run.mkdir()
    launch_ranks(
        n0, corpus, run, _ds(ds0, tmp_path), [*x0, *common, "--train.exit_interval", "10"], T
    )
    assert (run / "ckpt" / "global_step10" / "universal" / "meta.pt").exists()
    launch_ranks(n1, corpus, run, _ds(ds1, tmp_path), [*x1, *common, "--resume", "auto"], T)
    got = metrics(run)
    assert [r["iteration"] for r in got] == list(range(1, 21))
    assert_close([r["loss"] for r in got[10:]], ref[10:], rtol=RTOL)
    assert [r["lr"] for r in got[10:]] == pytest.approx([r["lr"] for r in metrics(ref_dir)[10:]])
    assert "layout change: checkpoint" in (run / "log.txt").read_text()
