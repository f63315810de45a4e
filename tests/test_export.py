"""Export of checkpoints of every layout: the same tensors as the single-process checkpoint.

Each case trains a tiny model for 2 of its 4 iterations through ``pretrain/main.py`` in real
processes (TP=2 + ZeRO-1, PP=2 with sub-layer units, ZeRO-3 over DP=2), exports it in this
process (no process group) and compares every tensor with the export of the single-process
ZeRO-0 run of the same seed at the same iteration. The shapes are chosen so the taper plan and
the padded vocabulary coincide at TP 1 and 2 (asserted). By default every other architecture
resumes its single-process checkpoint under a multi-process layout and exports that. Bad input
fails in one line and leaves nothing in ``OUT``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arch_args import for_arch
from launch_helpers import ROOT, assert_close, launch_ranks, metrics
from safetensors.torch import load_file

from tapered_megatron.checkpoint.consolidate import resolve_checkpoint
from tapered_megatron.export.__main__ import main as export_main

ARCHS = ("transformer", "gated_attention", "titans", "hope_attention")
# d_ff 128: cosine widths [192, 64] are multiples of the taper unit at TP 1 (16) and TP 2 (32),
# and the narrowest layer still splits into two CMS levels at TP 2.
COMMON = ["--model.d_ff", "128", "--train.iters", "4", "--train.save_interval", "2",
          "--train.lr", "2e-3", "--eval.interval", "0", "--model.titans.chunk_size", "8",
          "--model.titans.window", "8", "--model.hope.levels", "2", "--model.hope.periods", "0",
          "4"]  # fmt: skip
LAYOUTS = {
    "tp2": (2, "zero1.json", ["--parallel.tp", "2"]),
    "pp2-sublayer": (2, "pipeline.json", ["--parallel.pp", "2", "--parallel.pipeline_unit",
                                          "sublayer"]),
    "zero3-dp2": (2, "zero3", []),
}  # fmt: skip
# by default the transformer from TP=2; the other layouts' exports of every other architecture
# run by default after a resume (test_arch_resumes_under_another_layout_and_exports)
CASES = [
    pytest.param(arch, layout, marks=[] if (arch, layout) == ("transformer", "tp2") else [
        pytest.mark.slow])
    for arch in ARCHS
    for layout in LAYOUTS
]  # fmt: skip


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


STOP2 = ["--train.exit_interval", "2"]
_single: dict[str, Path] = {}


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The single-process ZeRO-0 checkpoint of an architecture, saved at iterations 2 and 4
    (trained once per module)."""

    def get(arch: str) -> Path:
        if arch not in _single:
            out = tmp_path_factory.mktemp(f"single-{arch}")
            _single[arch] = train(corpus, out, arch, 1, "zero0.json", [])
        return _single[arch]

    return get


_single_export: dict[tuple[str, int], Path] = {}


@pytest.fixture(scope="module")
def single_export(single, tmp_path_factory):
    """The export of :func:`single` at an iteration (made once per architecture and iteration)."""

    def get(arch: str, it: int) -> Path:
        if (arch, it) not in _single_export:
            out = tmp_path_factory.mktemp(f"single-export-{arch}-{it}") / "out"
            export(single(arch), out, "--tag", f"global_step{it}")
            _single_export[arch, it] = out
        return _single_export[arch, it]

    return get


def export(ckpt: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    assert export_main(["--checkpoint", str(ckpt), "--out", str(out), *extra]) == 0
    assert not torch.distributed.is_initialized()
    files = sorted(out.glob("model*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def assert_export_equals_single(
    ckpt: Path, out: Path, arch: str, it: int, single, single_export, atol: float = 1e-6
) -> None:
    """``ckpt`` (latest: iteration ``it``) exported into ``out`` holds the tensors of the
    single-process export at ``it`` (``atol``), and its card and config name ``arch``."""
    ref_ckpt = single(arch)
    cfg, ref_cfg = resolve_checkpoint(ckpt).cfg, resolve_checkpoint(ref_ckpt).cfg
    assert cfg.taper_plan.widths == ref_cfg.taper_plan.widths
    assert cfg.padded_vocab_size == ref_cfg.padded_vocab_size
    got = export(ckpt, out)
    want = load_file(str(single_export(arch, it) / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        diff = (got[name] - want[name]).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff}"
    card = (out / "README.md").read_text()
    assert f"| architecture | {arch}" in card and f"iteration {it}" in card
    config = json.loads((out / "config.json").read_text())
    assert config["taper_widths"] == list(cfg.taper_plan.widths)
    assert config["tapered_config"]["model"]["arch"] == arch


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
    ckpt = train(corpus, tmp_path / "run", arch, n, ds, [*extra, *STOP2])
    assert_export_equals_single(ckpt, tmp_path / "out", arch, 2, single, single_export)


# architecture: the layout that resumes its single-process checkpoint (each layout once)
RESUMES = {"gated_attention": "tp2", "titans": "pp2-sublayer", "hope_attention": "zero3-dp2"}


@pytest.mark.distributed
@pytest.mark.parametrize("arch", list(RESUMES))
def test_arch_resumes_under_another_layout_and_exports(
    arch, corpus, single, single_export, tmp_path
):
    """An architecture through ``pretrain/main.py``: the single-process run's global_step2
    resumed under a multi-process layout to iteration 4. Its iterations 3-4 equal the
    single-process run's within 1e-5 (the log names the layout change) and the export of its
    checkpoint equals the single-process export at 4 within 1e-4 (two optimizer steps in
    another reduction order apart; a misplaced shard is off by the init scale, 0.02)."""
    n, ds, extra = LAYOUTS[RESUMES[arch]]
    ref = single(arch)
    run = tmp_path / "run"
    shutil.copytree(ref / "global_step2", run / "ckpt" / "global_step2")
    (run / "ckpt" / "latest").write_text("global_step2")
    ckpt = train(corpus, run, arch, n, ds, [*extra, "--resume", "auto"])
    assert "layout change: checkpoint" in (run / "log.txt").read_text()
    got, want = metrics(run), metrics(ref.parent)
    assert [r["iteration"] for r in got] == [3, 4]
    assert_close([r["loss"] for r in got], [r["loss"] for r in want[2:]], rtol=1e-5)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in want[2:]])
    assert_export_equals_single(ckpt, tmp_path / "out", arch, 4, single, single_export, 1e-4)


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

    # a partial checkpoint: the run stopped while saving global_step4
    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial, ignore=shutil.ignore_patterns("tensorboard"))
    (partial / "global_step4" / "complete").unlink()
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


BENCH = ROOT / "scripts" / "bench_export.py"


def bench_export(work: Path, *args: str) -> dict:
    """``scripts/bench_export.py`` (the export in a measured child process); its JSON line."""
    p = subprocess.run(
        [sys.executable, str(BENCH), "--work", str(work), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of an export loaded by ``transformers`` (``trust_remote_code``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        return model(ids).logits


def shard_names(folder: Path) -> list[str]:
    """The shards ``model.safetensors.index.json`` lists, checked to be Hugging Face's names."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names = sorted(set(index["weight_map"].values()))
    n = len(names)
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in folder.glob("model*.safetensors")) == names
    return names


def within_memory_bound(r: dict, slack_mib: float) -> None:
    """Peak RSS above the footprint at most the largest tensor (fp32, as read) plus one shard."""
    bound = r["largest_tensor_fp32_mib"] + r["largest_shard_mib"] + slack_mib
    assert r["peak_above_footprint_mib"] <= bound, r


@pytest.mark.distributed
def test_sharded_export_loads_in_transformers_equal_to_the_single_file(
    single, single_export, tmp_path
):
    """The tiny checkpoint exported with ``--max_shard_size 20KB``: Hugging Face's shard names
    and index, every shard within the limit or one tensor, ``transformers`` logits (and our
    loader's) equal to the single-file export's; ``--dtype bfloat16`` writes bf16 shards that
    load as bf16. (The memory of the export: the slow test below.)"""
    from safetensors import safe_open

    from tapered_megatron.export.load import load_model

    ckpt = single("transformer")
    sharded = tmp_path / "sharded"
    export(ckpt, sharded, "--max_shard_size", "20KB")
    names = shard_names(sharded)
    assert len(names) >= 3 and not (sharded / "model.safetensors").exists()
    for name in names:
        with safe_open(str(sharded / name), "pt") as f:
            assert (sharded / name).stat().st_size <= 20_000 + 1024 or len(list(f.keys())) == 1
    ids = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
    want = hf_logits(single_export("transformer", 4), ids)  # the latest: what export picks
    assert torch.equal(hf_logits(sharded, ids), want)
    ours = load_model(model=sharded).module
    with torch.no_grad():
        assert torch.equal(ours(ids)[..., : want.shape[-1]], want)

    bf16 = tmp_path / "bf16"
    export(ckpt, bf16, "--dtype", "bfloat16", "--max_shard_size", "20KB")
    with safe_open(str(bf16 / shard_names(bf16)[0]), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    got = hf_logits(bf16, ids)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max()
    ours = load_model(model=bf16, dtype="bfloat16").module  # the eval tools' --dtype
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        mine = ours(ids)[..., : want.shape[-1]]
    assert mine.dtype == torch.bfloat16  # computed in bf16: within its rounding of transformers'
    assert (mine.float() - got.float()).abs().max() <= 0.02 * got.abs().max()


@pytest.mark.slow
def test_export_of_a_preset_checkpoint_holds_one_tensor_not_the_model(tmp_path):
    """``transformer_440m`` cut to 4 layers (482 MiB fp32), trained one step and saved by the
    trainer, exported in 100 MB shards in a child process: its peak RSS above the interpreter's
    footprint stays within the largest tensor plus one shard (well below the model), and the
    sharded export loads in ``transformers`` with logits equal to the single-file export's."""
    r = bench_export(tmp_path, "--config", "transformer_440m", "--layers", "4")
    assert r["shards"] >= 3 and r["model_mib"] > 400
    within_memory_bound(r, slack_mib=0)
    assert r["peak_above_footprint_mib"] < 0.5 * r["model_mib"], r
    sharded, single = tmp_path / "export-float32", tmp_path / "single"
    shard_names(sharded)
    export(tmp_path / "ckpt", single, "--max_shard_size", "10GB")
    assert (single / "model.safetensors").is_file()
    ids = torch.randint(0, 255, (1, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf_logits(sharded, ids), hf_logits(single, ids))
