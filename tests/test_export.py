"""Export of checkpoints of every layout: the same tensors as the single-process checkpoint.

Each case trains a tiny model for 2 iterations through ``pretrain/main.py`` in real processes
(TP=2 + ZeRO-1, PP=2 with sub-layer units, ZeRO-3 over DP=2), exports it in this process (no
process group) and compares every tensor with the export of the single-process ZeRO-0 run of the
same seed and iterations. The shapes are chosen so the taper plan and the padded vocabulary
coincide at TP 1 and 2 (asserted). Bad input fails in one line and leaves nothing in ``OUT``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from arch_args import for_arch
from launch_helpers import ROOT, launch_ranks
from safetensors.torch import load_file

from tapered_megatron.export.__main__ import main as export_main
from tapered_megatron.export.consolidate import resolve_checkpoint

ARCHS = ("transformer", "gated_attention", "titans", "hope_attention")
# d_ff 128: cosine widths [192, 64] are multiples of the taper unit at TP 1 (16) and TP 2 (32),
# and the narrowest layer still splits into two CMS levels at TP 2.
COMMON = ["--model.d_ff", "128", "--train.iters", "2", "--train.lr", "2e-3",
          "--eval.interval", "0", "--model.titans.chunk_size", "8", "--model.titans.window", "8",
          "--model.hope.levels", "2", "--model.hope.periods", "0", "4"]  # fmt: skip
LAYOUTS = {
    "tp2": (2, "zero1.json", ["--parallel.tp", "2"]),
    "pp2-sublayer": (2, "pipeline.json", ["--parallel.pp", "2", "--parallel.pipeline_unit",
                                          "sublayer"]),
    "zero3-dp2": (2, "zero3", []),
}  # fmt: skip
CASES = [
    pytest.param(arch, layout, marks=[] if arch == "transformer" else [pytest.mark.slow])
    for arch in ARCHS
    for layout in LAYOUTS
]


def train(corpus: str, out: Path, arch: str, n: int, ds: str, extra: list[str]) -> Path:
    """Train the tiny model of ``arch`` in ``n`` real processes; return its save dir."""
    out.mkdir(parents=True, exist_ok=True)
    if ds == "zero3":  # partition every parameter, however small
        cfg = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds = str(out / "zero3_all.json")
        Path(ds).write_text(json.dumps(cfg))
    # generous timeout: on a shared 2-core machine a launch can take minutes to start
    launch_ranks(n, corpus, out, ds, [*for_arch(arch, COMMON), *extra], timeout=900)
    return out / "ckpt"


_single: dict[str, Path] = {}


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The single-process ZeRO-0 checkpoint of an architecture (trained once per module)."""

    def get(arch: str) -> Path:
        if arch not in _single:
            out = tmp_path_factory.mktemp(f"single-{arch}")
            _single[arch] = train(corpus, out, arch, 1, "zero0.json", [])
        return _single[arch]

    return get


_single_export: dict[str, Path] = {}


@pytest.fixture(scope="module")
def single_export(single, tmp_path_factory):
    """The export of :func:`single` (made once per architecture)."""

    def get(arch: str) -> Path:
        if arch not in _single_export:
            out = tmp_path_factory.mktemp(f"single-export-{arch}") / "out"
            export(single(arch), out)
            _single_export[arch] = out
        return _single_export[arch]

    return get


def export(ckpt: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    assert export_main(["--checkpoint", str(ckpt), "--out", str(out), *extra]) == 0
    assert not torch.distributed.is_initialized()
    return load_file(str(out / "model.safetensors"))


@pytest.mark.distributed
@pytest.mark.parametrize("arch,layout", CASES)
def test_export_of_layout_equals_single_process(
    arch,
    layout,
    corpus,
    single,
    single_export,
    tmp_path,
):
    n, ds, extra = LAYOUTS[layout]
    ckpt = train(corpus, tmp_path / "run", arch, n, ds, extra)
    ref_ckpt = single(arch)
    cfg, ref_cfg = resolve_checkpoint(ckpt).cfg, resolve_checkpoint(ref_ckpt).cfg
    assert cfg.taper_plan.widths == ref_cfg.taper_plan.widths
    assert cfg.padded_vocab_size == ref_cfg.padded_vocab_size
    got = export(ckpt, tmp_path / "out")
    want = load_file(str(single_export(arch) / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        diff = (got[name] - want[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| architecture | {arch}" in card and "iteration 2" in card
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["taper_widths"] == list(cfg.taper_plan.widths)
    assert config["tapered_config"]["model"]["arch"] == arch


def _error(capsys, argv: list[str]) -> str:
    assert export_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.distributed
def test_bad_input_one_line_errors_nothing_written(single, tmp_path, capsys):
    ckpt = single("transformer")
    out = tmp_path / "out"
    base = ["--checkpoint", str(ckpt), "--out", str(out)]

    # a tag that does not exist
    assert "global_step99" in _error(capsys, [*base, "--tag", "global_step99"])
    assert not out.exists()

    # a partial checkpoint: the run stopped while saving global_step2
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial, ignore=shutil.ignore_patterns("tensorboard"))
    (partial / "global_step2" / "complete").unlink()
    err = _error(capsys, ["--checkpoint", str(partial), "--out", str(out)])
    assert "partial checkpoint" in err
    assert not out.exists()

    # a tokenizer whose vocabulary is larger than the model's (256)
    from tapered_megatron.data import train_sentencepiece
    from tapered_megatron.data.sample_corpus import sample_corpus_docs

    tok = train_sentencepiece(iter(sample_corpus_docs(40)), tmp_path / "tok", vocab_size=400)
    assert "400 tokens" in _error(capsys, [*base, "--tokenizer-model", tok])
    assert not out.exists()

    # an output directory that cannot be written (root ignores permission bits: use /sys)
    if os.geteuid() == 0:
        locked = Path("/sys/tapered_megatron_test/out")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        locked = tmp_path / "ro" / "out"
    assert "cannot write" in _error(capsys, ["--checkpoint", str(ckpt), "--out", str(locked)])
    assert not locked.exists()

    # an output directory with something in it is left alone without --overwrite
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "not empty" in _error(capsys, base)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
