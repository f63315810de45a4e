"""Resume on a different layout (real ranks through pretrain/main.py).

A run saves at iteration 10 under one (TP, PP, DP, ZeRO stage, pipeline unit) and continues to
20 under another; iterations 11-20 must equal the uninterrupted single-process run within 1e-5
relative, and the log must name the layout change.
"""

from __future__ import annotations

import json
import re

import pytest
from launch_helpers import ROOT, assert_close, launch_ranks, metrics

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


IMPLICIT_GB = ["--train.micro_batch_size", "2", "--train.global_batch_size", "0"]


@pytest.mark.slow
def test_resume_on_fewer_ranks_keeps_the_global_batch(corpus, tmp_path):
    """Saved on 2 ranks with ``train.global_batch_size`` 0 (micro 2 x dp 2 = 4), resumed on one:
    the run goes on with global batch 4 (accumulation 2), not 2, and matches the uninterrupted
    run with that batch."""
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    launch_ranks(1, corpus, ref_dir, "zero0.json", ["--train.global_batch_size", "4"], T)
    run = tmp_path / "run"
    run.mkdir()
    launch_ranks(2, corpus, run, "zero0.json", [*IMPLICIT_GB, "--train.exit_interval", "10"], T)
    launch_ranks(1, corpus, run, "zero0.json", [*IMPLICIT_GB, "--resume", "auto"], T)
    got, ref = metrics(run), metrics(ref_dir)
    assert [r["iteration"] for r in got] == list(range(1, 21))
    assert_close([r["loss"] for r in got[10:]], [r["loss"] for r in ref[10:]], rtol=RTOL)
    log = (run / "log.txt").read_text()
    assert "global batch 4 kept from the checkpoint" in log
    assert "global batch 4 = micro 2 x dp 1 x accumulation 2" in log


def test_kept_global_batch_unmet_is_one_line_and_an_explicit_one_wins(
    corpus,
    tmp_path,
    monkeypatch,
    capsys,
):
    """micro 4 x dp 1 = 4 saved; 2 ranks of micro 4 cannot make 4: one line naming the kept
    batch, before any process group. An explicit global batch is taken, and the log says the
    checkpoint's differed."""
    from tapered_megatron.config import ConfigError
    from tapered_megatron.training import launch

    once = ["--train.micro_batch_size", "4", "--train.global_batch_size", "0"]
    launch_ranks(1, corpus, tmp_path, "zero0.json", [*once, "--train.iters", "2"], T)
    argv = [
        "--ds_config", str(ROOT / "ds_configs" / "zero0.json"), "--data.path", corpus,
        "--data.cache_dir", str(tmp_path / "cache"), "--train.save_dir", str(tmp_path / "ckpt"),
        "--model.d_model", "32", "--model.heads", "2", "--model.layers", "2", "--model.d_ff",
        "64", "--model.seq_len", "16", "--model.vocab_size", "256", "--taper.multiple", "16",
        "--train.iters", "4", "--resume", "auto", "--train.micro_batch_size", "4",
    ]  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        launch.setup(argv)
    assert "\n" not in str(e.value) and "checkpoint's global batch is 4" in str(e.value)
    _, _, _, layout = launch.setup([*argv, "--train.global_batch_size", "16"])
    assert layout.global_batch_size == 16 and layout.grad_accum == 2
    assert "global batch 16 (train.global_batch_size, set explicitly)" in capsys.readouterr().out


INTERLEAVED = ["--parallel.pp", "2", "--parallel.schedule", "interleaved"]


@pytest.mark.slow
def test_interleaved_run_matches_one_process_and_resumes_under_1f1b_and_one_process(
    corpus, tmp_path
):
    """A PP2 x v2 interleaved run through pretrain/main.py logs the one-process losses,
    gradient norms (clipped at 1.0 from iteration 7 on) and validation loss; its checkpoint at
    iteration 10 continues under DeepSpeed's 1F1B engine, in one process and under the same
    schedule, each equal to the uninterrupted run; it exports as any checkpoint does."""
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    launch_ranks(1, corpus, ref_dir, "zero0.json", [], T)
    ref = metrics(ref_dir)
    inter = [*INTERLEAVED, "--parallel.virtual_stages", "2", "--train.exit_interval", "10"]
    for name, (n1, ds1, x1) in {
        "1f1b": (2, "pipeline.json", ["--parallel.pp", "2"]),
        "one": ONE_Z0,
        "same": (2, "pipeline.json", [*INTERLEAVED, "--parallel.virtual_stages", "2"]),
    }.items():
        run = tmp_path / name
        run.mkdir()
        launch_ranks(2, corpus, run, "pipeline.json", inter, T)
        first = metrics(run)
        assert_close([r["loss"] for r in first], [r["loss"] for r in ref[:10]], rtol=RTOL)
        assert_close([r["grad_norm"] for r in first], [r["grad_norm"] for r in ref[:10]], 1e-4)
        assert "val_loss" in first[-1]  # evaluation at iteration 10 ran through the schedule
        assert first[-1]["val_loss"] == pytest.approx(ref[9]["val_loss"], rel=RTOL)
        if name == "one":
            _exports_the_universal_masters(run / "ckpt", tmp_path / "export")
        launch_ranks(n1, corpus, run, ds1, [*x1, "--resume", "auto"], T)
        got = metrics(run)
        assert [r["iteration"] for r in got] == list(range(1, 21))
        assert_close([r["loss"] for r in got[10:]], [r["loss"] for r in ref[10:]], rtol=RTOL)
        log = (run / "log.txt").read_text()
        assert "schedule interleaved v2" in log or "from its universal/ copy" in log


def _exports_the_universal_masters(ckpt, out) -> None:
    """``python -m tapered_megatron.export`` of ``ckpt``: every parameter of the model, equal to
    the universal copy's fp32 master."""
    import torch
    from safetensors.torch import load_file

    from tapered_megatron.checkpoint.consolidate import resolve_checkpoint
    from tapered_megatron.export.__main__ import main as export_main
    from tapered_megatron.models import build_model

    assert export_main(["--checkpoint", str(ckpt), "--out", str(out)]) == 0
    got = load_file(str(out / "model.safetensors"))
    names = dict(build_model(resolve_checkpoint(ckpt).cfg).named_parameters())
    assert sorted(got) == sorted(names)
    universal = ckpt / "global_step10" / "universal"
    for name in got:
        assert torch.equal(got[name], torch.load(universal / f"{name}.pt")["fp32"]), name


VIRTUAL_CASES = {
    "tp2-sp-interleaved": (4, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    "interleaved-recompute-full": (2, ["--train.recompute", "full"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(VIRTUAL_CASES))
def test_virtual_schedule_with_tp_sp_or_recompute_matches_one_process(case, corpus, tmp_path):
    """TP2 with sequence parallelism inside interleaved chunks (TP2 x PP2 x v2), and full
    recompute inside them, log the one-process losses and gradient norms."""
    ranks, extra = VIRTUAL_CASES[case]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    launch_ranks(1, corpus, ref_dir, "zero0.json", ["--train.iters", "10"], T)
    run = tmp_path / "run"
    run.mkdir()
    args = [*INTERLEAVED, "--parallel.virtual_stages", "2", *extra, "--train.iters", "10"]
    launch_ranks(ranks, corpus, run, "pipeline.json", args, T)
    got, ref = metrics(run), metrics(ref_dir)
    assert_close([r["loss"] for r in got], [r["loss"] for r in ref], rtol=RTOL)
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "1f1b"])
def test_virtual_schedule_times_stages_skips_a_nan_step_and_measures_alignment(
    corpus, tmp_path, monkeypatch, schedule
):
    """PP2 through pretrain/main.py (interleaved x v2, and DeepSpeed's 1F1B engine) with a NaN
    loss injected at iteration 2 and ``eval.alignment``: that step is skipped as in one process,
    every other loss and gradient norm, the validation losses and every layer's alignment equal
    one process's, and the log gives both pipeline ranks' compute time."""
    monkeypatch.setenv("TAPERED_MEGATRON_INJECT_NAN", "2")  # inherited by the ranks
    args = ["--train.iters", "6", "--eval.interval", "3", "--logging.interval", "3"]
    args += ["--eval.alignment", "true"]
    ref_dir, run = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    run.mkdir()
    launch_ranks(1, corpus, ref_dir, "zero0.json", args, T)
    layout = ["--parallel.pp", "2", "--parallel.schedule", schedule]
    layout += ["--parallel.virtual_stages", "2"] if schedule == "interleaved" else []
    launch_ranks(2, corpus, run, "pipeline.json", [*layout, *args], T)
    got, ref = metrics(run), metrics(ref_dir)
    assert [r.get("skipped", False) for r in got] == [i == 2 for i in range(1, 7)]
    assert [r.get("skipped", False) for r in ref] == [i == 2 for i in range(1, 7)]
    kept = [i for i in range(6) if i != 1]
    assert_close([got[i]["loss"] for i in kept], [ref[i]["loss"] for i in kept])
    assert_close([got[i]["grad_norm"] for i in kept], [ref[i]["grad_norm"] for i in kept], 1e-4)
    evals = [i for i, r in enumerate(ref) if "val_loss" in r]
    assert evals == [2, 5] and [i for i, r in enumerate(got) if "val_loss" in r] == evals
    for i in evals:
        assert got[i]["val_loss"] == pytest.approx(ref[i]["val_loss"], rel=RTOL)
        want = [(a["rho_block"], a["rho_mlp"]) for a in ref[i]["alignment"]]
        have = [(a["rho_block"], a["rho_mlp"]) for a in got[i]["alignment"]]
        assert len(have) == len(want) == 2
        assert_close([x for row in have for x in row], [x for row in want for x in row], 1e-4)
    log = (run / "log.txt").read_text()
    stages = re.findall(r"\| stages (\d+)/(\d+) ms", log)
    assert len(stages) == 2 and sum(int(ms) for row in stages for ms in row) > 0, log[-3000:]
