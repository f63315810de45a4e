"""Bad inputs end ``pretrain/main.py`` with exit 2 and one line, before any process group.

Each case calls the real entry point (``pretrain/main.py``'s ``main``) in this process, so the
test can see that ``torch.distributed`` was never initialised, and checks that nothing was
written to ``train.save_dir``. One case also runs as a separate ``python pretrain/main.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from launch_helpers import reseal

from tapered_megatron.checkpoint.manifest import digests
from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.data import write_indexed_dataset

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "pretrain" / "main.py"
TINY = [
    "--ds_config", str(ROOT / "ds_configs" / "zero0.json"),
    "--model.d_model", "32", "--model.heads", "2", "--model.layers", "2", "--model.d_ff", "64",
    "--model.seq_len", "16", "--model.vocab_size", "256", "--taper.multiple", "16",
    "--train.iters", "2", "--train.micro_batch_size", "2",
]  # fmt: skip


def _main():
    spec = importlib.util.spec_from_file_location("pretrain_main", MAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from tapered_megatron.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 255, rng.integers(10, 40)).tolist() for _ in range(50)]
    prefix = str(tmp_path_factory.mktemp("corpus") / "doc")
    write_indexed_dataset(prefix, docs)
    return prefix


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory) -> str:
    """A real sentencepiece model with 400 pieces (more than the tiny model's 256)."""
    from tapered_megatron.data import train_sentencepiece
    from tapered_megatron.data.sample_corpus import sample_corpus_docs

    prefix = tmp_path_factory.mktemp("tok") / "tok"
    docs = iter(sample_corpus_docs(limit=100))
    return train_sentencepiece(docs, prefix, vocab_size=400, num_threads=1)


def _copy(prefix: str, dest: Path) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, dest / f"doc{ext}")
    return str(dest / "doc")


def _corrupt_magic(prefix: str, tmp: Path) -> str:
    p = _copy(prefix, tmp / "magic")
    with open(p + ".idx", "r+b") as f:
        f.write(b"NOTANIDX")
    return p


def _truncate(prefix: str, tmp: Path, ext: str) -> str:
    p = _copy(prefix, tmp / f"trunc{ext[1:]}")
    size = os.path.getsize(p + ext)
    with open(p + ext, "r+b") as f:
        f.truncate(size - 10)
    return p


def _edited_in_place(prefix: str, tmp: Path) -> list[str]:
    """A copy whose ids were checked once (the marker is in its cache), then its first token
    overwritten with 300 (beyond the 256-entry vocabulary), size and mtime kept."""
    from tapered_megatron.data import IndexedDataset
    from tapered_megatron.data.blended import check_vocab_cached

    p, cache = _copy(prefix, tmp / "edited"), tmp / "cache"
    check_vocab_cached(IndexedDataset(p), 256, cache)
    st = os.stat(p + ".bin")
    ds = IndexedDataset(p)
    with open(p + ".bin", "r+b") as f:
        f.write(np.array([300], dtype=ds.dtype).tobytes())
    os.utime(p + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    return ["--data.path", p, "--data.cache_dir", str(cache)]


D32 = ("--model.d_model", "32")
TP2_LAYOUT = {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 1, "pipeline_unit": "none"}


def _saved_checkpoint(
    tmp: Path,
    overrides: list[str],
    change: tuple[str, str] = ("--model.d_model", "64"),
    layout: dict | None = None,
) -> Path:
    """A save dir whose complete checkpoint recorded another model (by default d_model 64) or,
    with ``layout``, that model saved under that parallel layout without a universal/ copy."""
    save = tmp / "old"
    tag = save / "global_step5"
    tag.mkdir(parents=True)
    skip = {"--ds_config", change[0]}
    args = [x for k, v in zip(TINY[::2], TINY[1::2]) if k not in skip for x in (k, v)]
    cfg = load_config("quickstart", [*args, *overrides, *change])
    (tag / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if layout is not None:
        (tag / "layout.json").write_text(json.dumps(layout))
    marker = {"iteration": 5, "consumed_samples": 40, "files": digests(tag)}
    (tag / "complete").write_text(json.dumps(marker))
    (save / "latest").write_text("global_step5")
    return save


def _ds_with(tmp: Path, **params: object) -> str:
    """The tiny runs' ds_config with an AdamW optimizer section of ``params``."""
    ds = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    ds["optimizer"] = {"type": "AdamW", "params": params}
    path = tmp / "ds_optimizer.json"
    path.write_text(json.dumps(ds))
    return str(path)


CASES = {
    "missing dataset": (lambda c, t, k: ["--data.path", str(t / "nope")], "index file not found"),
    "corrupt index": (lambda c, t, k: ["--data.path", _corrupt_magic(c, t)], "wrong magic"),
    "truncated index": (
        lambda c, t, k: ["--data.path", _truncate(c, t, ".idx")],
        "truncated index",
    ),
    "truncated data": (lambda c, t, k: ["--data.path", _truncate(c, t, ".bin")], "truncated data"),
    "blend odd count": (lambda c, t, k: ["--data.path", f"0.5 {c} {c}"], "odd item count"),
    "blend weight not a number": (lambda c, t, k: ["--data.path", f"x {c}"], "not a number"),
    "blend weight negative": (lambda c, t, k: ["--data.path", f"-1 {c} 1 {c}"], ">= 0"),
    "blend weights zero": (lambda c, t, k: ["--data.path", f"0 {c} 0 {c}"], "sum to zero"),
    "tokenizer missing": (
        lambda c, t, k: ["--data.path", c, "--data.tokenizer_model", str(t / "no.model")],
        "data.tokenizer_model",
    ),
    "tokenizer not a model": (
        lambda c, t, k: ["--data.path", c, "--data.tokenizer_model", c + ".idx"],
        "not a readable sentencepiece model",
    ),
    "tokenizer larger than vocab": (
        lambda c, t, k: ["--data.path", c, "--data.tokenizer_model", k],
        "set --model.vocab_size 400",
    ),
    "token id beyond the vocabulary, edited after a clean check": (
        lambda c, t, k: _edited_in_place(c, t),
        "token id 300 at token 0 is outside the vocabulary [0, 256)",
    ),
    "seq_len beyond data": (
        lambda c, t, k: ["--data.path", c, "--model.seq_len", "100000"],
        "fewer than one sample",
    ),
    "save dir under a file": (
        lambda c, t, k: ["--data.path", c, "--train.save_dir", c + ".bin/ckpt"],
        "not a directory",
    ),
    "no disk for the checkpoint": (
        lambda c, t, k: [
            "--data.path",
            c,
            "--model.d_model",
            "65536",
            "--model.heads",
            "64",
            "--model.d_ff",
            "262144",
            "--model.layers",
            "4",
        ],
        "bytes) free on",
    ),
    "split without training documents": (
        lambda c, t, k: ["--data.path", c, "--data.split", "0,0,100"],
        "data.split '0,0,100' leaves the training split of",
    ),
    "ds_config optimizer lr a quoted number": (
        lambda c, t, k: ["--data.path", c, "--ds_config", _ds_with(t, lr="3e-4")],
        'ds_config "optimizer.params.lr": "3e-4" is not a number; write "lr": 0.0003',
    ),
    "ds_config optimizer betas not numbers": (
        lambda c, t, k: ["--data.path", c, "--ds_config", _ds_with(t, betas=["0.9", 0.95])],
        '"optimizer.params.betas": ["0.9", 0.95] is not a number',
    ),
    "resume path missing": (
        lambda c, t, k: ["--data.path", c, "--resume", str(t / "gone")],
        "does not exist",
    ),
    "resume without a complete checkpoint": (
        lambda c, t, k: ["--data.path", c, "--resume", str(c.rsplit("/", 1)[0])],
        "no complete checkpoint",
    ),
    "resume from another model": (
        lambda c, t, k: [
            "--data.path",
            c,
            "--resume",
            str(_saved_checkpoint(t, ["--data.path", c])),
        ],
        "model.d_model 64 in the checkpoint, 32 here",
    ),
    "resume under another layout without universal/": (
        lambda c, t, k: [
            "--data.path",
            c,
            "--resume",
            str(_saved_checkpoint(t, ["--data.path", c], D32, TP2_LAYOUT)),
        ],
        "saved under TP2 PP1 DP1 ZeRO-1 unit none without a universal/ copy",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_before_any_process_group(case, corpus, big_tokenizer, tmp_path, capsys):
    make, expect = CASES[case]
    save = tmp_path / "save"
    extra = make(corpus, tmp_path, big_tokenizer)
    if "--train.save_dir" in extra:
        save = Path(extra[extra.index("--train.save_dir") + 1])
    else:
        extra += ["--train.save_dir", str(save)]
    given = set(extra[::2])
    tiny = [x for k, v in zip(TINY[::2], TINY[1::2]) if k not in given for x in (k, v)]
    args = [*tiny, *extra]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = _main()(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert not dist.is_initialized()
    assert err.startswith("error: ") and "\n" not in err, err
    assert expect in err, err
    assert not save.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_wandb_project_without_the_package_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    """``--logging.wandb_project`` where ``import wandb`` fails (the optional extra missing)."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    save = tmp_path / "save"
    args = [*TINY, "--data.path", corpus, "--train.save_dir", str(save)]
    rc = _main()([*args, "--logging.wandb_project", "p"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not dist.is_initialized() and not save.exists(), err
    assert err.startswith("error: logging.wandb_project: the wandb package does not import")
    assert "pip install 'tapered-megatron[wandb]'" in err and "\n" not in err


def test_bad_input_in_a_real_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, str(MAIN), *TINY, "--data.path", str(tmp_path / "missing")]
    cmd += ["--train.save_dir", str(tmp_path / "save")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "index file not found" in lines[0], p.stderr
    assert "re-run data_tools/tokenize.py" in lines[0]
    assert not (tmp_path / "save").exists()


def test_layout_change_needs_the_universal_copy(corpus, tmp_path):
    """Pre-flight lets a checkpoint of another layout through when it holds universal/; one
    written before layout.json is judged by the TP / PP of its config."""
    from tapered_megatron.checkpoint import preflight
    from tapered_megatron.training import launch

    save = _saved_checkpoint(tmp_path, ["--data.path", corpus], D32, TP2_LAYOUT)
    base = [*TINY[2:], "--data.path", corpus]
    cfg = load_config("quickstart", [*base, "--train.resume", str(save)])
    _, layout = launch.resolve(cfg, launch.load_ds_config(TINY[1]), 1)
    with pytest.raises(ConfigError, match="cannot resume under TP1 PP1 DP1 ZeRO-0 unit none"):
        preflight.check_resume(cfg, layout)
    (save / "global_step5" / "universal").mkdir()
    torch.save({}, save / "global_step5" / "universal" / "meta.pt")
    reseal(save / "global_step5")
    preflight.check_resume(cfg, layout)  # a layout change is allowed with the copy

    old = _saved_checkpoint(tmp_path / "x", ["--data.path", corpus, "--parallel.tp", "2"], D32)
    cfg = load_config("quickstart", [*base, "--train.resume", str(old)])
    with pytest.raises(ConfigError, match="saved under TP2 PP1 unit none without"):
        preflight.check_resume(cfg, layout)


def test_resume_may_change_dropout_only(corpus, tmp_path):
    """``model.dropout`` changes no weight: a resume with another value passes the check; any
    other model key still fails it."""
    from tapered_megatron.checkpoint.preflight import check_resume
    from tapered_megatron.config import ConfigError

    save = _saved_checkpoint(tmp_path, ["--data.path", corpus], ("--model.dropout", "0.1"))
    args = [x for k, v in zip(TINY[::2], TINY[1::2]) if k != "--ds_config" for x in (k, v)]
    args += ["--train.resume", str(save)]
    check_resume(load_config("quickstart", args))
    other = load_config("quickstart", [*args, "--model.norm_eps", "1e-6"])
    with pytest.raises(ConfigError, match=r"model\.norm_eps 1e-05 in the checkpoint, 1e-06 here"):
        check_resume(other)


def test_an_id_beyond_the_vocabulary_missed_by_the_content_key_stops_at_the_batch(tmp_path):
    """A token file over 64 MiB is keyed by 16 pieces of 1 MiB; ids beyond the vocabulary
    written between them after a clean check (size and mtime kept) pass pre-flight's cached
    check, and the run stops at the first batch holding one: exit 1, one line naming the file
    and the token's position, no traceback, no checkpoint saved."""
    from tapered_megatron.data import IndexedDataset
    from tapered_megatron.data.blended import (
        HASH_PIECE_BYTES,
        HASH_PIECES,
        WHOLE_HASH_BYTES,
        check_vocab_cached,
    )

    n_tokens = (WHOLE_HASH_BYTES + (4 << 20)) // 2
    docs = np.random.default_rng(0).integers(0, 255, n_tokens, dtype=np.uint16)
    prefix, cache = str(tmp_path / "big"), tmp_path / "cache"
    write_indexed_dataset(prefix, np.split(docs, 8))
    check_vocab_cached(IndexedDataset(prefix), 256, cache)
    st = os.stat(prefix + ".bin")
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    hashed = np.zeros(len(tokens), bool)
    for k in range(HASH_PIECES):  # the bytes content_key reads, in tokens
        at = (st.st_size - HASH_PIECE_BYTES) * k // (HASH_PIECES - 1)
        hashed[at // 2 : (at + HASH_PIECE_BYTES + 1) // 2] = True
    tokens[~hashed] = 300
    tokens.flush()
    del tokens
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    tiny = [x for k, v in zip(TINY[::2], TINY[1::2]) if k != "--model.seq_len" for x in (k, v)]
    cmd = [sys.executable, str(MAIN), *tiny, "--data.path", prefix, "--data.cache_dir", str(cache)]
    cmd += ["--train.save_dir", str(tmp_path / "save"), "--train.save_interval", "1"]
    cmd += ["--data.split", "1,0,0", "--eval.interval", "0", "--model.seq_len", "2048"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 1 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"{prefix}.bin: token id 300 at token " in err[0], err[0]
    assert "outside the vocabulary [0, 256)" in err[0] and "stopped without saving" in err[0]
    assert not list((tmp_path / "save").glob("global_step*"))
