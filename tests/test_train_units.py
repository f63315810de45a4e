"""Training pieces without a process group: validation, LR schedule, param groups, checkpoints."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import reseal
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tapered_megatron.checkpoint import save
from tapered_megatron.checkpoint.layout import ParallelLayout, complete_tags, is_complete
from tapered_megatron.checkpoint.manifest import saved_bytes
from tapered_megatron.checkpoint.resume import find_resume, hash_problem, load
from tapered_megatron.checkpoint.save_dir import SaveDirTaken, own_save_dir
from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.training import launch, optim

ROOT = Path(__file__).resolve().parents[1]
DS = ROOT / "ds_configs"


def _resolve(overrides=(), ds=None, world=1):
    cfg = load_config("quickstart", list(overrides))
    return launch.resolve(cfg, ds if ds is not None else {}, world)


# ------------------------------------------------------------------ ds_config resolution
def test_auto_keys_are_filled_from_train_config():
    ds, lay = _resolve(
        ["--train.micro_batch_size", "2", "--train.global_batch_size", "16"],
        json.loads((DS / "default.json").read_text()),
        world=4,
    )
    assert (lay.dp, lay.grad_accum) == (4, 2)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["train_batch_size"] == 16
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is False  # CPU: fp32


def test_the_layout_record_keeps_the_layout_json_format():
    """What a run writes into layout.json, reads back and names in messages."""
    zero1 = json.loads((DS / "zero1.json").read_text())
    _, lay = _resolve(["--parallel.tp", "2"], zero1, world=2)
    record = {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 1, "pipeline_unit": "none"}
    assert lay.to_record() == record
    assert ParallelLayout.from_record(record) == ParallelLayout(2, 1, 1, 1)
    assert lay.describe() == "TP2 PP1 DP1 ZeRO-1 unit none"
    pipe = json.loads((DS / "pipeline.json").read_text())
    over = ["--parallel.pp", "2", "--parallel.schedule", "interleaved"]
    _, lay = _resolve([*over, "--parallel.virtual_stages", "2"], pipe, world=2)
    record = {"tp": 1, "pp": 2, "dp": 1, "zero_stage": 1, "pipeline_unit": "layer"}
    record.update(schedule="interleaved", virtual_stages=2)
    assert lay.to_record() == record
    assert ParallelLayout.from_record(record).to_record() == record
    assert lay.describe(("pp",)) == "PP2 unit layer schedule interleaved v2"


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_explicit_mixed_precision_runs_on_the_cpu_accelerator_with_a_note(half, monkeypatch):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: True)
    ds, _ = _resolve([], {half: {"enabled": True}}, world=1)
    assert launch.precision(ds) == half
    note = launch.precision_note(ds)
    assert half in note and "testing" in note and "\n" not in note
    auto, _ = _resolve([], {"bf16": {"enabled": "auto"}}, world=1)
    assert launch.precision(auto) == "fp32" and launch.precision_note(auto) == ""


def test_a_half_precision_the_accelerator_lacks_is_one_line(monkeypatch):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: False)
    with pytest.raises(ConfigError) as e:
        _resolve([], {"fp16": {"enabled": True}}, world=1)
    assert "does not support it" in str(e.value) and "enable bf16" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _resolve(["--parallel.pp", "2"], {"fp16": {"enabled": True}}, world=2)
    assert "ZeRO stage 0" in str(e.value) and "\n" not in str(e.value)


def test_every_shipped_ds_config_resolves():
    for path in sorted(DS.glob("*.json")):
        if path.name.startswith("cluster_"):
            continue
        ds = json.loads(path.read_text())
        pp = ["--parallel.pp", "2"] if "pipeline" in ds else []
        _resolve(pp, ds, world=2)


@pytest.mark.parametrize(
    "overrides, ds, world, key",
    [
        ([], {"train_batch_size": 4}, 1, "train_batch_size"),
        ([], {"train_micro_batch_size_per_gpu": 3}, 1, "train_micro_batch_size_per_gpu"),
        ([], {"gradient_accumulation_steps": 2}, 2, "gradient_accumulation_steps"),
        ([], {"gradient_clipping": 0.5}, 1, "gradient_clipping"),
        (["--parallel.pp", "2"], {"zero_optimization": {"stage": 2}}, 2, "stage=2"),
        (["--parallel.pp", "2"], {"zero_optimization": {"stage": 3}}, 2, "stage=3"),
        (["--parallel.tp", "2"], {}, 3, "parallel.tp * parallel.pp"),
        (["--train.global_batch_size", "12"], {}, 2, "train.global_batch_size"),
        ([], {"pipeline": {"stages": 4}}, 1, "pipeline.stages"),
        ([], {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, 1, "both fp16 and bf16"),
        ([], {"zero_optimization": {"stage": 5}}, 1, "zero_optimization.stage"),
        ([], {"zero_optimization": "yes"}, 1, '"zero_optimization": {"stage": 1}'),
        ([], {"fp16": True}, 1, '"fp16": {"enabled": true}'),
        ([], {"optimizer": {"type": "Adamm"}}, 1, "optimizer.type='Adamm'"),
        ([], {"scheduler": {"type": "cosine"}}, 1, "scheduler.type='cosine'"),
    ],
)
def test_inconsistent_configs_are_rejected_naming_the_key(overrides, ds, world, key):
    with pytest.raises(ConfigError) as e:
        _resolve(overrides, ds, world)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_resume_alias_and_launcher_local_rank():
    args, rest = launch.parse_args(["--local_rank=3", "--resume", "auto", "--train.iters", "5"])
    assert args.local_rank == 3
    assert load_config("quickstart", rest).train.resume == "auto"
    with pytest.raises(ConfigError):
        launch.parse_args(["--resume", "auto", "--train.resume", "x"])


def test_invalid_config_rejected_before_any_process_group(tmp_path):
    """A 4-rank launch of PP=2 with ZeRO-3 fails at once on every rank, before any rendezvous."""
    env = dict(os.environ, WORLD_SIZE="4", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    env["LOCAL_RANK"] = "1"
    cmd = [
        sys.executable, str(ROOT / "pretrain" / "main.py"), "--ds_config",
        str(DS / "zero3.json"), "--parallel.pp", "2", "--train.save_dir", str(tmp_path / "ck"),
    ]  # fmt: skip
    t = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert time.time() - t < 30  # MASTER_PORT=1 would hang/time out if a group were started
    env["RANK"] = "0"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "zero_optimization.stage=3" in lines[0] and "ds_configs/pipeline.json" in lines[0]
    assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------ optimiser / schedule
def test_warmup_then_cosine_to_min_lr():
    tr = load_config(
        "quickstart",
        ["--train.lr", "1e-3", "--train.min_lr", "1e-4", "--train.warmup_iters", "10",
         "--train.iters", "110"],
    ).train  # fmt: skip
    lrs = [optim.lr_at(tr, i) for i in range(130)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:111]))
    assert lrs[60] == pytest.approx(5.5e-4)
    assert lrs[110:] == [pytest.approx(1e-4)] * 20


def test_scheduler_state_round_trips():
    tr = load_config("quickstart").train
    p = nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=tr.lr)
    sch = optim.build_scheduler(opt, tr)
    for _ in range(7):
        opt.step()
        sch.step()
    state = sch.state_dict()
    opt2 = torch.optim.AdamW([p], lr=tr.lr)
    sch2 = optim.build_scheduler(opt2, tr)
    opt2.load_state_dict(opt.state_dict())  # DeepSpeed restores both, as here
    sch2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == optim.lr_at(tr, 7)
    opt.step(), sch.step(), opt2.step(), sch2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == optim.lr_at(tr, 8)


def test_mfu_peak_configured_or_probed_on_this_device():
    from tapered_megatron.training import logger

    assert logger.peak_tflops(123.0) == 123.0
    assert logger.device_product_name()
    probed = logger.peak_tflops(0.0)  # CPU: an fp32 matmul probe on this machine
    # physical ceiling: every core at 5 GHz retiring two 16-lane fp32 FMAs (AVX-512) a cycle
    assert 0 < probed < (os.cpu_count() or 1) * 5e9 * 64 / 1e12
    # an independent figure: torch's FLOP counter over the fastest of several timed products
    n = 1024  # the probe's size: smaller products run less efficiently
    a, b = torch.randn(n, n), torch.randn(n, n)
    with FlopCounterMode(display=False) as counter:
        a @ b
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    independent = counter.get_total_flops() / best / 1e12
    assert 1 / 3 < probed / independent < 3, (probed, independent)  # a shared, loaded machine


def test_matmul_peak_counts_products_against_each_clock():
    """One timing runs products until ``seconds`` pass on the first clock; each clock's rate is
    the products' FLOPs over its own elapsed time; the global RNG stream is left alone."""
    from tapered_megatron.accelerator import matmul_peak

    ticks = {"fast": 0.0, "slow": 0.0}

    def fast() -> float:  # advances 0.1 s per reading
        ticks["fast"] += 0.1
        return ticks["fast"]

    def slow() -> float:  # advances 1 s per reading (read only at a timing's start and end)
        ticks["slow"] += 1.0
        return ticks["slow"]

    torch.manual_seed(3)
    before = torch.get_rng_state()
    cpu = torch.device("cpu")
    rates = matmul_peak(
        [(4, 8, 2)], device=cpu, reps=1, warmup=0, seconds=0.25, clocks=(fast, slow)
    )
    # fast: start 0.1; after products 1, 2, 3 it reads 0.2, 0.3, 0.4 (0.3 >= 0.25: stop), then
    # 0.5 at the end: 0.4 s. slow: 1 s. Three products of 2 * 4 * 8 * 2 FLOPs.
    assert rates == pytest.approx([3 * 128 / 0.4, 3 * 128 / 1.0])
    assert torch.equal(torch.get_rng_state(), before)


def test_no_weight_decay_on_norms_gains_and_biases():
    from tapered_megatron.models import build_model

    cfg = load_config(
        "quickstart",
        ["--model.layers", "2", "--model.d_model", "32", "--model.heads", "2",
         "--model.d_ff", "64", "--model.arch", "gated_attention"],
    )  # fmt: skip
    model = build_model(cfg)
    groups = optim.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = [names[id(p)] for p in groups[0]["params"]]
    kept = [names[id(p)] for p in groups[1]["params"]]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert any("norm" in n for n in kept) and not any("norm" in n for n in decayed)
    assert all(p.ndim >= 2 for p in groups[0]["params"])
    assert len(decayed) + len(kept) == len(list(model.parameters()))


# ------------------------------------------------------------------ checkpoints
class FakeEngine:
    """Writes a file per save like DeepSpeed; can be told to die half-way."""

    def __init__(self, fail_at: int | None = None) -> None:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )

        self.fail_at = fail_at
        self.loaded = None
        self.checkpoint_engine = TorchCheckpointEngine()
        self.checkpoint_engine.zipfile_serialization = True  # DeepSpeed's default config

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save(client_state, str(d / "mp_rank_00_model_states.pt"))
        if client_state["iteration"] == self.fail_at:
            raise RuntimeError("node died while writing")

    def load_checkpoint(self, load_dir, tag, **kw):
        self.loaded = tag
        return str(Path(load_dir) / tag), torch.load(
            Path(load_dir) / tag / "mp_rank_00_model_states.pt", weights_only=True
        )


def _cfg(tmp_path, *extra):
    return load_config(
        "quickstart", ["--train.save_dir", str(tmp_path), "--train.keep_last", "2", *extra]
    )


def test_latest_only_points_at_complete_checkpoints(tmp_path):
    cfg = _cfg(tmp_path)
    save.save(FakeEngine(), cfg, 10, 80)
    assert (tmp_path / "latest").read_text() == "global_step10"
    assert is_complete(tmp_path / "global_step10")
    saved = yaml_load(tmp_path / "global_step10" / "config.yaml")
    assert saved["train"]["save_dir"] == str(tmp_path)
    assert json.loads((tmp_path / "global_step10" / "taper_plan.json").read_text())["widths"]
    with pytest.raises(RuntimeError):
        save.save(FakeEngine(fail_at=20), cfg, 20, 160)
    assert (tmp_path / "global_step20").exists()  # half-written ...
    assert (tmp_path / "latest").read_text() == "global_step10"  # ... and never latest
    resume = _cfg(tmp_path, "--train.resume", "auto")
    assert find_resume(resume) == (tmp_path, "global_step10")
    # even with a stale/corrupt `latest`, auto picks the newest complete checkpoint
    (tmp_path / "latest").write_text("global_step20")
    assert find_resume(resume) == (tmp_path, "global_step10")
    eng = FakeEngine()
    client = load(eng, tmp_path, "global_step10")
    assert client == {"iteration": 10, "consumed_samples": 80}


def test_keep_last_and_explicit_paths(tmp_path):
    cfg = _cfg(tmp_path)
    for it in (5, 10, 15, 20):
        save.save(FakeEngine(), cfg, it, it * 8)
    assert [t for _, t in complete_tags(tmp_path)] == ["global_step15", "global_step20"]
    assert not (tmp_path / "global_step5").exists()
    assert find_resume(_cfg(tmp_path, "--train.resume", str(tmp_path))) == (
        tmp_path,
        "global_step20",
    )
    one = tmp_path / "global_step15"
    assert find_resume(_cfg(tmp_path, "--train.resume", str(one))) == (
        tmp_path,
        "global_step15",
    )
    assert find_resume(_cfg(tmp_path / "empty", "--train.resume", "auto")) is None
    with pytest.raises(FileNotFoundError):
        find_resume(_cfg(tmp_path, "--train.resume", str(tmp_path / "nothing")))


def yaml_load(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_resume_passes_over_an_unusable_checkpoint_with_a_note(tmp_path):
    cfg = _cfg(tmp_path)
    for it in (10, 20):
        save.save(FakeEngine(), cfg, it, it * 8)
    resume = _cfg(tmp_path, "--train.resume", "auto")
    (tmp_path / "global_step20" / "layout.json").write_text("{not json")
    reseal(tmp_path / "global_step20")  # listed in the manifest: only its content is wrong
    notes: list[str] = []
    assert find_resume(resume, note=notes.append) == (tmp_path, "global_step10")
    assert len(notes) == 1 and "global_step20/layout.json: unreadable" in notes[0], notes
    # a `latest` outside the directory is not followed, and says so
    (tmp_path / "latest").write_text("../elsewhere/global_step30")
    notes.clear()
    assert find_resume(resume, note=notes.append) == (tmp_path, "global_step10")
    assert "not a plain global_stepN tag" in notes[0] and "ignored" in notes[0], notes
    # nothing usable left: one line naming the newest's problem
    f = tmp_path / "global_step10" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:64])
    with pytest.raises(ConfigError, match=r"no usable checkpoint .*global_step20/layout\.json"):
        find_resume(resume)


def _tamper(f: Path) -> None:
    """Invert 16 bytes in the middle of ``f``: same size, another sha256."""
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(255 - b for b in data[mid : mid + 16])
    f.write_bytes(bytes(data))


def test_pruning_counts_only_usable_checkpoints_and_spares_the_resumed_one(tmp_path):
    """The newest checkpoint unusable (changed after saving), the run resumed from the older
    one with keep_last 1: its saves never prune the checkpoint it resumed from nor the newest
    one it saved, and ``latest`` always names a tag that exists."""
    for it in (2, 4):
        save.save(FakeEngine(), _cfg(tmp_path), it, it * 8)
    _tamper(tmp_path / "global_step4" / "mp_rank_00_model_states.pt")  # found by the sha256
    over = ["--train.save_dir", str(tmp_path), "--train.keep_last", "1", "--train.resume", "auto"]
    cfg = load_config("quickstart", over)
    lineage = save.Lineage(resumed="global_step2")  # what the trainer resumed from
    save.save(FakeEngine(), cfg, 3, 24, lineage=lineage)
    assert [t for _, t in complete_tags(tmp_path)] == [
        "global_step2",
        "global_step3",
        "global_step4",
    ]
    assert find_resume(cfg, known={"global_step4": "changed"}) == (
        tmp_path,
        "global_step3",
    )
    save.save(FakeEngine(), cfg, 4, 32, lineage=lineage)  # replaces the unusable one
    assert [t for _, t in complete_tags(tmp_path)] == ["global_step2", "global_step4"]
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert hash_problem(tmp_path / "global_step4") is None


def _checkpoints_of_another_run(save_dir: Path) -> list[str]:
    for it in (2, 4):
        save.save(FakeEngine(), _cfg(save_dir), it, it * 8)
    (save_dir / "notes").mkdir()
    (save_dir / "notes" / "mine.txt").write_text("keep")
    return sorted(p.name for p in save_dir.iterdir())


def test_a_fresh_run_into_another_runs_save_dir_stops_in_one_line(tmp_path):
    from tapered_megatron.checkpoint.preflight import check_owner

    before = _checkpoints_of_another_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_owner(_cfg(tmp_path))
    line = str(e.value)
    assert "\n" not in line and "another run's checkpoints" in line and "--resume auto" in line
    assert "--train.start_over" in line
    elsewhere = tmp_path / "elsewhere" / "global_step4"
    with pytest.raises(ConfigError):  # resuming from another directory into this one
        check_owner(_cfg(tmp_path, "--train.resume", str(elsewhere)))
    check_owner(_cfg(tmp_path, "--train.resume", "auto"))
    check_owner(_cfg(tmp_path, "--train.resume", str(tmp_path / "global_step2")))
    with pytest.raises(ConfigError, match="one of the two"):
        check_owner(_cfg(tmp_path, "--train.resume", "auto", "--train.start_over", "true"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(SaveDirTaken), own_save_dir(_cfg(tmp_path)):
        pass  # checked again once the lock is held
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "job.lock"])


def test_start_over_moves_the_earlier_checkpoints_aside(tmp_path, capsys):
    _checkpoints_of_another_run(tmp_path)
    cfg = _cfg(tmp_path, "--train.start_over", "true")
    with own_save_dir(cfg):
        save.save(FakeEngine(), cfg, 1, 8, lineage=save.Lineage())
    (aside,) = tmp_path.glob("earlier-run-*")
    assert sorted(p.name for p in aside.iterdir()) == ["global_step2", "global_step4", "latest"]
    assert hash_problem(aside / "global_step4") is None  # moved, intact
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert "moved to" in capsys.readouterr().out


def test_a_save_dir_in_use_is_refused_and_freed_when_its_holder_is_killed(tmp_path):
    """Another process holds the directory's lock: a job is refused in one line naming it;
    after ``kill -9`` of the holder the kernel has released the lock and the job proceeds."""
    from launch_helpers import hold_save_dir

    holder = hold_save_dir(tmp_path)
    try:
        cfg = _cfg(tmp_path)
        with pytest.raises(SaveDirTaken) as e, own_save_dir(cfg):
            pass
        line = str(e.value)
        assert "\n" not in line and "in use by another job" in line
        assert f"pid {holder.pid}" in line
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own
        holder.wait()
    with own_save_dir(cfg):
        save.save(FakeEngine(), cfg, 1, 8, lineage=save.Lineage())
    assert (tmp_path / "latest").read_text() == "global_step1"


STATES = "mp_rank_00_model_states.pt"


def _drop(marker: dict, name: str) -> None:
    del marker["files"][name]


MANIFEST_FAULTS = {
    "files null": (lambda m, d: m.update(files=None), "'files' is None"),
    "files a list": (lambda m, d: m.update(files=[]), "'files' is [], not the mapping"),
    "an entry removed, its file edited": (
        lambda m, d: (_drop(m, STATES), _tamper(d / STATES)),
        "mp_rank_00_model_states.pt: not in the manifest complete",
    ),
    "a file added": (lambda m, d: (d / "extra.pt").write_bytes(b"x"), "extra.pt: not in the"),
    "a listed file removed": (
        lambda m, d: (d / "taper_plan.json").unlink(),
        "taper_plan.json: missing",
    ),
    "a file replaced by a link out of the tag, its entry removed": (
        lambda m, d: (_drop(m, "config.yaml"), _link_out(d / "config.yaml")),
        "config.yaml: a symbolic link",
    ),
    "iteration a string": (lambda m, d: m.update(iteration="4"), "iteration is '4', not a count"),
    "consumed samples negative": (lambda m, d: m.update(consumed_samples=-1), "not a count"),
    "iteration of another tag": (lambda m, d: m.update(iteration=9), "not the tag's 4"),
    "an absurd size": (
        lambda m, d: m["files"]["config.yaml"].__setitem__(0, 1 << 60),
        "lists 'config.yaml' as [1152921504606846976",
    ),
    "a size of another type": (
        lambda m, d: m["files"]["config.yaml"].__setitem__(0, "12"),
        "not [size, sha256]",
    ),
}


def _link_out(f: Path) -> None:
    outside = f.parent.parent / "outside.yaml"
    outside.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(outside)


@pytest.mark.parametrize("fault", MANIFEST_FAULTS)
def test_a_manifest_that_does_not_cover_every_file_makes_the_checkpoint_unusable(fault, tmp_path):
    """``complete`` of the newest checkpoint changed so its manifest no longer covers exactly
    its plain files (or a field is of the wrong type or absurd): resume falls back to the older
    checkpoint with a one-line note naming the problem, export refuses in one line, the
    free-space estimate uses the older checkpoint's size, and pruning never counts it."""
    from tapered_megatron.checkpoint.consolidate import resolve_checkpoint
    from tapered_megatron.export.load import ExportError

    change, why = MANIFEST_FAULTS[fault]
    for it in (2, 4):
        save.save(FakeEngine(), _cfg(tmp_path), it, it * 8)
    size2 = saved_bytes(tmp_path)
    tag4 = tmp_path / "global_step4"
    marker = json.loads((tag4 / "complete").read_text())
    change(marker, tag4)
    (tag4 / "complete").write_text(json.dumps(marker))
    notes: list[str] = []
    resume = _cfg(tmp_path, "--train.resume", "auto")
    assert find_resume(resume, note=notes.append) == (tmp_path, "global_step2")
    assert len(notes) == 1 and why in notes[0] and "\n" not in notes[0], notes
    with pytest.raises(ExportError, match=re.escape(why)):
        resolve_checkpoint(tmp_path, "global_step4")
    assert save.checkpoint_bytes(resume, half=False) == size2
    assert [t for _, t in save.usable_tags(tmp_path)] == ["global_step2"]


def _plugin(tmp_path: Path) -> tuple[Path, Path]:
    """A plugin file that would create ``marker`` when imported; (plugin, marker)."""
    marker, plugin = tmp_path / "imported", tmp_path / "received_arch.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n")
    return plugin, marker


def test_a_saved_config_including_a_base_is_never_followed(tmp_path):
    """The newest checkpoint's ``config.yaml`` says ``base: defaults.yaml`` (a file of the tag,
    the manifest resealed) whose ``model.plugins`` names a Python file: resume passes over the
    tag with a note, loading the saved config and export refuse it in one line, and the plugin
    never runs."""
    import yaml

    from tapered_megatron.checkpoint.consolidate import resolve_checkpoint
    from tapered_megatron.config import load_saved_config
    from tapered_megatron.export.load import ExportError

    plugin, marker = _plugin(tmp_path)
    save_dir = tmp_path / "ckpt"
    for it in (2, 4):
        save.save(FakeEngine(), _cfg(save_dir), it, it * 8)
    tag4 = save_dir / "global_step4"
    base = {"model": {"arch": "received_arch", "plugins": [str(plugin)]}}
    (tag4 / "defaults.yaml").write_text(yaml.safe_dump(base))
    saved = yaml.safe_load((tag4 / "config.yaml").read_text())
    (tag4 / "config.yaml").write_text(yaml.safe_dump({"base": "defaults.yaml", **saved}))
    reseal(tag4)
    notes: list[str] = []
    resume = _cfg(save_dir, "--train.resume", "auto")
    assert find_resume(resume, note=notes.append) == (save_dir, "global_step2")
    assert len(notes) == 1 and "without 'base'" in notes[0], notes
    with pytest.raises(ConfigError, match=re.escape("'base: 'defaults.yaml'' is not followed")):
        load_saved_config(tag4 / "config.yaml")
    with pytest.raises(ExportError, match="is not followed"):
        resolve_checkpoint(save_dir, "global_step4")
    assert not marker.exists()


BOUNDLESS = {
    "aliases expanding to 9**9 values": "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")),
    "nested 5000 deep": "x: " + "[" * 5000 + "]" * 5000 + "\n",
    "a recursive alias": "x: &a [*a]\n",
    "5 MiB": "x: '" + "y" * (5 << 20) + "'\n",
}


@pytest.mark.parametrize("case", BOUNDLESS)
def test_a_saved_config_is_parsed_within_bounds(case, tmp_path):
    """A checkpoint's ``config.yaml`` that would take unbounded memory, time or stack to parse
    is refused in one line within a second; resume passes over its checkpoint."""
    from tapered_megatron.config import load_saved_config

    for it in (2, 4):
        save.save(FakeEngine(), _cfg(tmp_path), it, it * 8)
    f = tmp_path / "global_step4" / "config.yaml"
    f.write_text(BOUNDLESS[case])
    reseal(f.parent)
    t = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_saved_config(f)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    notes: list[str] = []
    resume = _cfg(tmp_path, "--train.resume", "auto")
    assert find_resume(resume, note=notes.append) == (tmp_path, "global_step2")
    assert len(notes) == 1 and "config.yaml: unreadable" in notes[0], notes
    assert time.perf_counter() - t < 5
