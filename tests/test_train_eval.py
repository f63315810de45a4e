"""Evaluation inside training: ``--eval.extra_paths`` and ``--eval.alignment`` (issue 11 item 7).

The values a run logs are checked against an independent computation on its final checkpoint
(the consolidated single-process module on the same samples), and a pipeline run's against the
single-process run's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from launch_helpers import launch_ranks, metrics

pytestmark = pytest.mark.distributed

EVAL = ["--eval.alignment", "true"]


def _extra(prefix: str) -> list[str]:
    return ["--eval.extra_paths", prefix]


def _samples(cfg, prefix: str, split: str, nums: tuple[int, int, int], which: int) -> torch.Tensor:
    """The first ``nums[which]`` samples the trainer reads from one split, stacked."""
    from tapered_megatron import data

    sets = data.build_gpt_datasets(
        prefix, split, cfg.model.seq_len, cfg.data.seed, nums, cfg.data.cache_dir, barrier=False
    )
    ds = sets[which]
    return torch.as_tensor(np.stack([ds[i] for i in range(nums[which])]).astype("int64"))


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory) -> Path:
    """One process, 20 iterations, evaluating at 10 and 20 with an extra dataset and alignment."""
    out = tmp_path_factory.mktemp("eval1")
    launch_ranks(1, corpus, out, "zero0.json", [*EVAL, *_extra(corpus)])
    return out


def test_extra_dataset_loss_and_alignment_equal_an_independent_computation(single, corpus):
    from tapered_megatron.eval import alignment_of
    from tapered_megatron.export import load_model

    recs = {r["iteration"]: r for r in metrics(single)}
    final = recs[20]
    name = Path(corpus).name
    assert set(final["extra_val_loss"]) == {name}
    assert [r["layer"] for r in final["alignment"]] == [0, 1]
    assert "extra_val_loss" in recs[10] and "alignment" in recs[10]
    assert all("alignment" not in recs[i] for i in range(1, 10))

    loaded = load_model(checkpoint=single / "ckpt")
    assert loaded.iteration == 20
    cfg, module = loaded.cfg, loaded.module.eval()
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    # the extra dataset: all its documents, the first eval.iters global batches
    tokens = _samples(cfg, corpus, "0,1,0", (0, gbs, 0), 1)
    with torch.no_grad():
        losses = [float(module(t[:, :-1], t[:, 1:])) for t in tokens.split(mbs)]
    assert final["extra_val_loss"][name] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # alignment: on the validation split's batches, averaged over all their tokens
    valid = _samples(cfg, corpus, cfg.data.split, (cfg.train.iters * gbs, gbs, 0), 1)
    rows, count = alignment_of(module, valid[:, :-1].split(mbs))
    assert count == gbs * cfg.model.seq_len
    for got, want in zip(final["alignment"], rows):
        assert got["rho_block"] == pytest.approx(want.rho_block, abs=1e-5)
        assert got["rho_mlp"] == pytest.approx(want.rho_mlp, abs=1e-5)
        assert -1 <= got["rho_block"] <= 1 and -1 <= got["rho_mlp"] <= 1

    log = (single / "log.txt").read_text()
    assert f"validation on {name} at iter 20 | loss " in log
    assert "alignment at iter 20 | rho_block by layer " in log


def test_extra_paths_are_checked_before_the_run(corpus, tmp_path):
    """A missing or corrupt extra dataset is a pre-flight error, like a bad data.path; two
    prefixes with one file name are rejected by the config."""
    from tapered_megatron.config import ConfigError, load_config
    from tapered_megatron.training.preflight import check_data

    missing = str(tmp_path / "nothing_here")
    cfg = load_config("quickstart", ["--data.path", corpus, *_extra(missing)])
    with pytest.raises(ConfigError, match=r"^eval.extra_paths: .*index file not found"):
        check_data(cfg)
    twin = tmp_path / "other"
    twin.mkdir()
    with pytest.raises(ConfigError, match=r"eval\.extra_paths: prefixes must have distinct"):
        load_config("quickstart", ["--eval.extra_paths", corpus, str(twin / Path(corpus).name)])


PIPELINES = {
    "pp2": (2, "pipeline.json", ["--parallel.pp", "2"]),
    "dp2-zero3": (2, "zero3.json", []),
    "tp2": (2, "zero1.json", ["--parallel.tp", "2"]),
    "pp2-sublayer": (
        2,
        "pipeline.json",
        ["--parallel.pp", "2", "--parallel.pipeline_unit", "sublayer", "--model.layers", "3"],
    ),
}


def _layout_case(name: str, corpus: str, single: Path, tmp_path: Path) -> None:
    n, ds, extra = PIPELINES[name]
    args = [*extra, *EVAL, *_extra(corpus), "--train.exit_interval", "10"]
    if "--model.layers" in extra:  # its own single-process reference
        ref_dir = tmp_path / "ref"
        ref_dir.mkdir()
        launch_ranks(1, corpus, ref_dir, "zero0.json", [*EVAL, *_extra(corpus), *extra[-2:]])
        ref = metrics(ref_dir)[9]
    else:
        ref = metrics(single)[9]
    launch_ranks(n, corpus, tmp_path, ds, args)
    rec = metrics(tmp_path)[-1]
    assert rec["iteration"] == 10
    name_ = Path(corpus).name
    assert rec["extra_val_loss"][name_] == pytest.approx(ref["extra_val_loss"][name_], rel=1e-4)
    measured = 0
    for got, want in zip(rec["alignment"], ref["alignment"]):
        if got["rho_block"] is None:  # a layer whose halves sit on two stages
            assert "sublayer" in extra
            continue
        measured += 1
        assert got["rho_block"] == pytest.approx(want["rho_block"], abs=1e-4)
        assert got["rho_mlp"] == pytest.approx(want["rho_mlp"], abs=1e-4)
    assert measured >= len(ref["alignment"]) - 1 and all(
        not math.isnan(r["rho_mlp"]) for r in ref["alignment"]
    )


def test_pipeline_alignment_and_extra_loss_match_single_process(corpus, single, tmp_path):
    _layout_case("pp2", corpus, single, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2-zero3", "tp2", "pp2-sublayer"])
def test_layouts_alignment_and_extra_loss_match_single_process(name, corpus, single, tmp_path):
    _layout_case(name, corpus, single, tmp_path)
