"""Checkpoints received from elsewhere, in real ``pretrain/main.py`` processes: no code runs
from a pickled file or a plugin a saved config names, and an unusable newest checkpoint gives
way to the next older one.

One tiny single-rank run saves ``global_step2`` and ``global_step4``; each case copies it and
tampers with a file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from launch_helpers import MAIN, ROOT, common_args, hold_save_dir, job_env, popen_job, reseal

from tapered_megatron.checkpoint.layout import complete_tags
from tapered_megatron.checkpoint.manifest import file_digest, write_manifest
from tapered_megatron.export.__main__ import main as export_main

pytestmark = pytest.mark.distributed

BASE = ["--train.save_interval", "2", "--eval.interval", "0"]
FIRST = ["--train.iters", "4", *BASE]
RESUME = ["--train.iters", "6", *BASE, "--resume", "auto"]


class Payload:
    """Pickles as a call of ``os.system`` that creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def run(corpus: str, out: Path, extra: list[str], ds: str = "zero0.json") -> tuple[int, str]:
    """One rank of ``pretrain/main.py``; its exit code and output."""
    p = popen_job([sys.executable, "-u", MAIN, *common_args(corpus, out, ds, extra)], job_env())
    log = p.communicate(timeout=400)[0]
    return p.returncode, log


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A run directory whose ``ckpt`` holds complete ``global_step2`` and ``global_step4``."""
    out = tmp_path_factory.mktemp("trained")
    rc, log = run(corpus, out, FIRST)
    assert rc == 0, log[-3000:]
    return out


def copy_run(trained: Path, to: Path, keep: tuple[str, ...]) -> Path:
    """A copy of the trained run's checkpoints ``keep``; returns its run directory."""
    for tag in keep:
        shutil.copytree(trained / "ckpt" / tag, to / "ckpt" / tag)
    (to / "ckpt" / "latest").write_text(keep[-1])
    return to


@pytest.mark.parametrize(
    "name", ["mp_rank_00_model_states.pt", "rng_rank00000.pt", "universal/meta.pt"]
)
def test_a_pickle_naming_code_is_refused_and_never_runs(name, corpus, trained, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path / "run", ("global_step4",))
    marker = tmp_path / "marker"
    torch.save(Payload(marker), run_dir / "ckpt" / "global_step4" / name)
    # universal/meta.pt is read on a layout change: resume under ZeRO-1 instead of ZeRO-0
    ds = "zero1.json" if name.startswith("universal") else "zero0.json"
    rc, log = run(corpus, run_dir, RESUME, ds)
    assert rc == 2, log[-3000:]
    err = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in log, log[-3000:]
    assert name in err[0] and "posix.system" in err[0], err[0]
    assert not marker.exists()

    assert export_main(["--checkpoint", str(run_dir / "ckpt"), "--out", str(tmp_path / "x")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "refused" in lines[0], lines
    assert not marker.exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "rng_rank00000.pt"])
def test_resume_falls_back_past_a_truncated_newest_checkpoint(name, corpus, trained, tmp_path):
    run_dir = copy_run(trained, tmp_path / "run", ("global_step2", "global_step4"))
    f = run_dir / "ckpt" / "global_step4" / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, log = run(corpus, run_dir, RESUME)
    assert rc == 0, log[-3000:]
    notes = [line for line in log.splitlines() if "resuming from the older" in line]
    assert len(notes) == 1 and f"global_step4/{name}" in notes[0], log[-3000:]
    assert f"resumed from {run_dir / 'ckpt' / 'global_step2'} at iteration 2" in log
    assert (run_dir / "ckpt" / "latest").read_text() == "global_step6"


@pytest.mark.parametrize(
    "name", ["mp_rank_00_model_states.pt", "rng_rank00000.pt", "universal/head.proj.weight.pt"]
)
def test_overwritten_bytes_fall_back_on_resume_and_stop_export(
    name,
    corpus,
    trained,
    tmp_path,
    capsys,
):
    """256 bytes overwritten inside a file of the newest checkpoint (same size, still loads):
    its sha256 no longer matches the manifest in ``complete``, so resume passes over it to the
    older checkpoint with a note and export refuses it in one line."""
    run_dir = copy_run(trained, tmp_path / "run", ("global_step2", "global_step4"))
    f = run_dir / "ckpt" / "global_step4" / name
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 256] = bytes(255 - b for b in data[mid : mid + 256])
    f.write_bytes(bytes(data))
    assert export_main(["--checkpoint", str(run_dir / "ckpt"), "--out", str(tmp_path / "x")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "sha256" in lines[0], lines
    rc, log = run(corpus, run_dir, RESUME)
    assert rc == 0, log[-3000:]
    notes = [line for line in log.splitlines() if "resuming from the older" in line]
    assert len(notes) == 1 and f"global_step4/{name}" in notes[0] and "sha256" in notes[0], log
    assert f"resumed from {run_dir / 'ckpt' / 'global_step2'} at iteration 2" in log


def finite_weights(tag_dir: Path) -> bool:
    """Whether every tensor of a checkpoint's model states is finite."""
    from tapered_megatron.checkpoint import safe_load

    module = safe_load.load(tag_dir / "mp_rank_00_model_states.pt")["module"]
    return all(bool(torch.isfinite(t).all()) for t in module.values())


@pytest.mark.slow
def test_nan_weights_from_a_saved_file_never_replace_the_good_checkpoints(
    corpus, trained, tmp_path
):
    """global_step4's weights are NaN yet its manifest matches (a sender wrote them so): every
    resumed step is skipped, the saves due meanwhile are withheld, the run stops after
    ``train.max_skipped_steps``; global_step2 is not pruned and no NaN checkpoint is added."""
    from tapered_megatron.checkpoint import safe_load

    run_dir = copy_run(trained, tmp_path / "run", ("global_step2", "global_step4"))
    tag = run_dir / "ckpt" / "global_step4"
    state = safe_load.load(tag / "mp_rank_00_model_states.pt")
    next(iter(state["module"].values())).fill_(float("nan"))
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    reseal(tag)
    extra = ["--train.iters", "8", *BASE, "--resume", "auto", "--train.max_skipped_steps", "3"]
    rc, log = run(corpus, run_dir, extra)
    assert rc == 1, log[-3000:]
    assert "iteration 6: checkpoint withheld" in log, log[-3000:]
    assert "error: 3 consecutive steps with non-finite loss" in log, log[-3000:]
    ckpt = run_dir / "ckpt"
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step2", "global_step4"]
    assert (ckpt / "latest").read_text() == "global_step4"
    assert finite_weights(ckpt / "global_step2")


@pytest.mark.slow
def test_an_lr_that_overflows_the_weights_leaves_only_finite_checkpoints(corpus, tmp_path):
    """``--train.lr 1e30`` (finite, accepted): the weights blow up; every checkpoint the run
    leaves has finite weights and ``latest`` names one of them."""
    extra = ["--train.lr", "1e30", "--train.iters", "8", "--train.save_interval", "1"]
    extra += ["--eval.interval", "0", "--train.max_skipped_steps", "2", "--train.keep_last", "8"]
    rc, log = run(corpus, tmp_path, extra)
    assert rc in (0, 1), log[-3000:]
    ckpt = tmp_path / "ckpt"
    saved = sorted(ckpt.glob("global_step*"))
    assert saved and all(finite_weights(t) for t in saved), log[-3000:]
    assert (ckpt / (ckpt / "latest").read_text() / "complete").exists()
    assert "Traceback" not in log


def test_overwritten_bytes_in_an_exported_shard_are_refused_by_our_loaders(
    trained, tmp_path, capsys
):
    """An export carries ``manifest.json`` (size and sha256 of every file); 256 bytes
    overwritten in one of its shards (same size, still a valid safetensors file) make
    perplexity (a real process), generate, zero-shot, our ``load_model`` and
    ``from_pretrained`` refuse it in one line naming the shard, before any weight is used."""
    import transformers

    from tapered_megatron.eval.zeroshot import main as zeroshot_main
    from tapered_megatron.export.load import ExportError, load_model
    from tapered_megatron.generate import main as generate_main

    out = tmp_path / "export"
    argv = ["--checkpoint", str(trained / "ckpt"), "--out", str(out), "--max_shard_size", "20KB"]
    assert export_main(argv) == 0
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    load_model(model=out)  # the export as written loads
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    end = len(data) - 8  # inside the last tensor's bytes, the header untouched
    data[end - 256 : end] = bytes(255 - b for b in data[end - 256 : end])
    shard.write_bytes(bytes(data))
    capsys.readouterr()

    cmd = [sys.executable, "-m", "tapered_megatron.eval.perplexity", "--model", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert shard.name in err[0] and "sha256" in err[0] and "refused" in err[0], err[0]
    for tool, args in [
        (generate_main, ["--model", str(out), "--prompt", "1 2 3", "--max-new-tokens", "2"]),
        (zeroshot_main, ["--model", str(out), "--output", str(tmp_path / "zeroshot")]),
    ]:
        assert tool(args) == 2, tool
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and shard.name in lines[0] and "sha256" in lines[0], lines
    with pytest.raises(ExportError, match=f"{shard.name}: sha256 differs"):
        load_model(model=out)
    with pytest.raises(ValueError, match=f"{shard.name}: sha256 differs"):
        transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


OUTSIDE = ("relative", "absolute", "symlink")


def list_outside(folder: Path, record: str, kind: str, listed: str, outside: Path) -> str:
    """Make the manifest in ``folder / record`` name a file outside ``folder``, with that
    file's true size and sha256 (what a sender can write): ``relative`` (``../…``) or
    ``absolute``, a path to a copy of ``folder / listed`` at ``outside``; ``symlink``,
    ``listed`` itself replaced by a link to that copy. Returns the entry's name."""
    shutil.copyfile(folder / listed, outside)
    name = listed
    if kind == "symlink":
        (folder / listed).unlink()
        (folder / listed).symlink_to(outside)
    else:
        name = os.path.relpath(outside, folder) if kind == "relative" else str(outside)
    marker = json.loads((folder / record).read_text())
    marker["files"][name] = file_digest(outside)
    (folder / record).write_text(json.dumps(marker))
    return name


def test_a_checkpoint_manifest_naming_a_file_outside_is_passed_over(
    corpus, trained, tmp_path, capsys
):
    """A ``complete`` whose manifest lists ``../…``, an absolute path or a symlink leading out
    of the tag (each with the outside file's true digest): the tag is not complete, so
    ``--resume auto`` falls back to global_step2 with a note (a real run for the symlink,
    :func:`find_resume` for each) and export refuses it in one line."""
    from tapered_megatron.checkpoint.resume import find_resume
    from tapered_megatron.config import load_config

    for kind in OUTSIDE:
        run_dir = copy_run(trained, tmp_path / kind, ("global_step2", "global_step4"))
        ckpt = run_dir / "ckpt"
        tag4 = ckpt / "global_step4"
        name = list_outside(
            tag4, "complete", kind, "mp_rank_00_model_states.pt", tmp_path / kind / "x.pt"
        )
        assert export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "x")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"lists {name!r}, not a file inside {tag4}" in lines[0], lines
        notes: list[str] = []
        cfg = load_config("quickstart", ["--train.save_dir", str(ckpt), "--train.resume", "auto"])
        assert find_resume(cfg, notes.append) == (ckpt, "global_step2"), kind
        assert len(notes) == 1 and f"lists {name!r}, not a file inside" in notes[0], notes
    rc, log = run(corpus, run_dir, RESUME)
    assert rc == 0, log[-3000:]
    notes = [line for line in log.splitlines() if "resuming from the older" in line]
    assert len(notes) == 1 and "not a file inside" in notes[0], log[-3000:]
    assert f"resumed from {ckpt / 'global_step2'} at iteration 2" in log


def test_an_export_manifest_naming_a_file_outside_is_refused(trained, tmp_path, capsys):
    """An export whose ``manifest.json`` lists ``../…``, an absolute path or a symlink leading
    out of it (with the outside file's true digest), or an entry that is not [size, sha256]:
    generate, ``load_model`` and ``from_pretrained`` refuse it in one line."""
    import transformers

    from tapered_megatron.export.load import ExportError, load_model
    from tapered_megatron.generate import main as generate_main

    written = tmp_path / "export"
    assert export_main(["--checkpoint", str(trained / "ckpt"), "--out", str(written)]) == 0
    for kind in OUTSIDE:
        out = tmp_path / kind / "export"
        shutil.copytree(written, out)
        name = list_outside(out, "manifest.json", kind, "config.json", tmp_path / kind / "c.json")
        why = f"lists {name!r}, not a file inside {out}"
        capsys.readouterr()
        args = ["--model", str(out), "--prompt", "1 2 3", "--max-new-tokens", "2"]
        assert generate_main(args) == 2, kind
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and why in lines[0] and "refused" in lines[0], lines
        with pytest.raises(ExportError, match=re.escape(why)):
            load_model(model=out)
        with pytest.raises(ValueError, match=re.escape(why)):
            transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    manifest = json.loads((written / "manifest.json").read_text())
    manifest["files"]["config.json"] = "x"  # an entry that is not [size, sha256]
    (written / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=re.escape("lists 'config.json' as 'x', not [size")):
        load_model(model=written)


def test_a_plugin_named_by_a_saved_config_is_never_imported(corpus, trained, tmp_path, capsys):
    """``model.plugins`` of a checkpoint's ``config.yaml`` or an export's ``config.json`` is
    not imported by resume, export, generate, perplexity or ``from_pretrained``; each says in one
    line how to pass it."""
    import transformers

    from tapered_megatron.eval.perplexity import main as perplexity_main
    from tapered_megatron.generate import main as generate_main

    marker = tmp_path / "imported"
    plugin = tmp_path / "received_arch.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n")
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(trained / "ckpt"), "--out", str(out)]) == 0
    run_dir = copy_run(trained, tmp_path / "run", ("global_step4",))
    saved = run_dir / "ckpt" / "global_step4" / "config.yaml"
    data = yaml.safe_load(saved.read_text())
    data["model"].update(arch="received_arch", plugins=[str(plugin)])
    saved.write_text(yaml.safe_dump(data, sort_keys=False))
    reseal(saved.parent)  # a sender writes a consistent manifest for what it sends
    raw = json.loads((out / "config.json").read_text())
    raw["tapered_config"]["model"].update(arch="received_arch", plugins=[str(plugin)])
    (out / "config.json").write_text(json.dumps(raw))
    write_manifest(out)  # the export's sender, too, lists what it sends
    capsys.readouterr()

    rc, log = run(corpus, run_dir, RESUME)
    assert not marker.exists(), "resume imported the saved config's plugin"
    err = [line for line in log.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(err) == 1, log[-3000:]
    assert f"pass --model.plugins {plugin}" in err[0], err[0]
    ckpt = ["--checkpoint", str(run_dir / "ckpt")]
    for tool, args in [
        (export_main, [*ckpt, "--out", str(tmp_path / "x")]),
        (generate_main, [*ckpt, "--prompt", "1 2 3", "--max-new-tokens", "2"]),
        (perplexity_main, [*ckpt]),
        (generate_main, ["--model", str(out), "--prompt", "1 2 3", "--max-new-tokens", "2"]),
    ]:
        assert tool(args) == 2, tool
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"pass --plugins {plugin}" in lines[0], lines
    with pytest.raises(ValueError, match=f"import {plugin} before from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert not marker.exists()


def test_an_rng_file_holding_numpy_arrays_still_loads(tmp_path):
    """RNG files written before numpy's state was stored as ints hold a numpy array: they load
    and restore the same streams."""
    import random

    import numpy as np
    import torch

    from tapered_megatron.checkpoint import safe_load
    from tapered_megatron.parallel.random import get_rng_state, set_rng_state

    state = get_rng_state()
    state["numpy"] = np.random.get_state()  # the old format: a tuple with a uint32 array
    torch.save(state, tmp_path / "rng_rank00000.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(safe_load.load(tmp_path / "rng_rank00000.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_an_unreadable_pt_names_the_file_and_quotes_the_cause(tmp_path):
    """A zip whose tensor data is missing: one line, the file and torch's own first line."""
    import zipfile

    from tapered_megatron.checkpoint import safe_load
    from tapered_megatron.config_fields import first_line

    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2)}, good)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            if not name.endswith("data/0"):  # the one tensor's storage
                zout.writestr(name, zin.read(name))
    with pytest.raises(RuntimeError) as raw:
        torch.load(bad, weights_only=True)
    cause = str(raw.value).splitlines()[0]
    assert "data/0" in cause
    with pytest.raises(safe_load.UnsafeFileError) as err:
        safe_load.load(bad)
    assert str(err.value) == f"{bad}: unreadable ({cause})"
    assert first_line(ValueError("first\nsecond")) == "first"
    assert first_line(EOFError()) == "EOFError"


def listing(folder: Path) -> list[str]:
    """Every path under ``folder``, relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_export_overwrite_never_deletes_what_an_export_did_not_write(trained, tmp_path, capsys):
    """``--overwrite`` replaces only an earlier export: the checkpoint directory itself, a
    folder of someone's files, or an export with an unlisted file in it is refused in one line
    and left as it was."""
    run_dir = copy_run(trained, tmp_path / "run", ("global_step2", "global_step4"))
    ckpt = run_dir / "ckpt"
    (ckpt / "notes").mkdir()
    (ckpt / "notes" / "plan.txt").write_text("mine")
    before = listing(ckpt)
    export = ["--checkpoint", str(ckpt), "--overwrite", "--out"]
    earlier = tmp_path / "export"
    assert export_main([*export, str(earlier)]) == 0
    assert export_main([*export, str(earlier)]) == 0  # an earlier export is replaced
    (earlier / "notes.txt").write_text("mine")
    for out, why in [
        (ckpt, "not an earlier export"),
        (ckpt / "notes", "not an earlier export"),
        (earlier, "holds notes.txt, which its manifest.json does not list"),
    ]:
        capsys.readouterr()
        assert export_main([*export, str(out)]) == 2, out
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and why in lines[0], lines
    assert listing(ckpt) == before
    assert (earlier / "notes.txt").read_text() == "mine"


def test_a_second_job_on_a_save_dir_in_use_is_refused(corpus, trained, tmp_path):
    """A job whose save directory another job holds (its lock, here held by a small process)
    stops in one line before training, writing no checkpoint (the lock's release at ``kill -9``
    of its holder: ``test_train_units.py``)."""
    run_dir = copy_run(trained, tmp_path / "run", ("global_step2", "global_step4"))
    ckpt = run_dir / "ckpt"
    holder = hold_save_dir(ckpt)
    try:
        rc, log = run(corpus, run_dir, RESUME)
    finally:
        holder.kill()
        holder.wait()
    err = [line for line in log.splitlines() if line.startswith("error: ")]
    assert rc == 1 and len(err) == 1 and "Traceback" not in log, log[-3000:]
    assert f"in use by another job (pid {holder.pid} on" in err[0], err[0]
    assert [t for _, t in complete_tags(ckpt)] == ["global_step2", "global_step4"]


def _drop_entry(out: Path, name: str) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["files"][name]
    (out / "manifest.json").write_text(json.dumps(manifest))


def _set_files(out: Path, files: object) -> None:
    (out / "manifest.json").write_text(json.dumps({"files": files}))


def _weights_zeroed_and_unlisted(out: Path) -> None:
    _drop_entry(out, "model.safetensors")
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-4096:] = bytes(4096)
    f.write_bytes(bytes(data))


def _config_linked_out(out: Path) -> None:
    _drop_entry(out, "config.json")
    outside = out.parent / "outside.json"
    outside.write_bytes((out / "config.json").read_bytes())
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(outside)


EXPORT_FAULTS = {
    "model.safetensors unlisted and changed": (
        _weights_zeroed_and_unlisted,
        "model.safetensors: not in the manifest manifest.json",
    ),
    "a file added": (lambda out: (out / "extra.py").write_text("x = 1\n"), "extra.py: not in"),
    "files null": (lambda out: _set_files(out, None), "'files' is None"),
    "files empty": (lambda out: _set_files(out, {}), ": not in the manifest manifest.json"),
    "config.json a link out, unlisted": (_config_linked_out, "config.json: a symbolic link"),
    "no manifest.json": (lambda out: (out / "manifest.json").unlink(), "not a readable JSON"),
}


@pytest.mark.parametrize("fault", EXPORT_FAULTS)
def test_an_export_manifest_that_does_not_cover_every_file_is_refused(fault, tmp_path, capsys):
    """An export whose ``manifest.json`` no longer covers exactly its plain files: generate,
    perplexity and ``load_model`` refuse it in one line naming the problem, and so does
    ``from_pretrained`` (which loads Hugging Face's own ``save_pretrained`` folders, those
    without a manifest)."""
    import transformers
    from tiny_export import tiny_export

    import tapered_megatron.hf  # noqa: F401 - registers the classes with the Auto* factories
    from tapered_megatron.eval.perplexity import main as perplexity_main
    from tapered_megatron.export.load import ExportError, load_model
    from tapered_megatron.generate import main as generate_main

    change, why = EXPORT_FAULTS[fault]
    out, _ = tiny_export(tmp_path / "export", "transformer", None)
    change(out)
    with pytest.raises(ExportError, match=re.escape(why)):
        load_model(model=out)
    for tool, args in [
        (generate_main, ["--model", str(out), "--prompt", "1 2 3"]),
        (perplexity_main, ["--model", str(out)]),
    ]:
        capsys.readouterr()
        assert tool(args) == 2, tool
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and why in lines[0], lines
    if fault != "no manifest.json":
        with pytest.raises(ValueError, match=re.escape(why)):
            transformers.AutoModelForCausalLM.from_pretrained(out)


def test_an_export_config_including_a_base_is_never_followed(tmp_path, capsys):
    """An export whose ``config.json`` carries ``tapered_config.base`` with an absolute path to
    a YAML file naming a plugin (the manifest rewritten): generate, ``load_model`` and
    ``from_pretrained`` refuse it in one line; the plugin never runs."""
    import transformers
    from tiny_export import tiny_export

    import tapered_megatron.hf  # noqa: F401 - registers the classes with the Auto* factories
    from tapered_megatron.export.load import ExportError, load_model
    from tapered_megatron.generate import main as generate_main

    marker, plugin = tmp_path / "imported", tmp_path / "received_arch.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n")
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(yaml.safe_dump({"model": {"arch": "x", "plugins": [str(plugin)]}}))
    out, _ = tiny_export(tmp_path / "export", "transformer", None)
    raw = json.loads((out / "config.json").read_text())
    raw["tapered_config"]["base"] = str(defaults)
    (out / "config.json").write_text(json.dumps(raw))
    write_manifest(out)
    why = f"'base: {str(defaults)!r:.80}' is not followed"  # the message keeps 80 characters
    with pytest.raises(ExportError, match=re.escape(why)):
        load_model(model=out)
    capsys.readouterr()
    assert generate_main(["--model", str(out), "--prompt", "1 2 3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and why in lines[0], lines
    with pytest.raises(ValueError, match=re.escape(why)):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not marker.exists()


def test_zero_shot_never_runs_code_from_the_export(tmp_path):
    """Python appended to an export's ``configuration_tapered.py`` and ``modeling_tapered.py``
    (the manifest rewritten): zero-shot (a fresh process: one that imported
    ``tapered_megatron.hf`` already prefers the registered classes) evaluates it with the
    installed classes and the appended code never runs."""
    from tiny_export import tiny_export, tiny_tokenizer

    marker = tmp_path / "ran"
    out, _ = tiny_export(tmp_path / "export", "transformer", tiny_tokenizer(tmp_path))
    for name in ("configuration_tapered.py", "modeling_tapered.py"):
        with open(out / name, "a") as f:
            f.write(f"\nopen({str(marker)!r}, 'w').close()\n")
    write_manifest(out)
    cmd = [sys.executable, "-m", "tapered_megatron.eval.zeroshot", "--model", str(out)]
    cmd += ["--tasks", "tm_shakespeare_lastword", "--limit", "2", "--output", str(tmp_path / "z")]
    p = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "z" / "zeroshot.json").read_text())["tasks"]
    assert not marker.exists()
