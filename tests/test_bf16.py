"""bf16 in real ``pretrain/main.py`` processes on DeepSpeed's CPU accelerator (an explicit
``"bf16": {"enabled": true}`` runs there): every shipped or planner-written ds_config trains, the
layouts agree with fp32, checkpoints resume, non-finite steps are skipped whole.

bf16 runs are compared with the single-process fp32 run of the same tiny model within
:data:`BF16_RTOL` (bf16 weights and activations, fp32 master weights and optimizer state).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from launch_helpers import (
    ROOT,
    assert_close,
    launch_ranks,
    metrics,
)

from tapered_megatron.config import load_config
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.planner import Candidate, ds_config

pytestmark = pytest.mark.distributed

BF16_RTOL = 2e-3  # 8 steps of the tiny model: bf16 vs fp32 losses (measured within 1e-4)
STEPS = ["--train.iters", "8", "--eval.interval", "0"]
SHORT = ["--train.iters", "2", "--eval.interval", "0", "--train.universal_checkpoint", "false"]


def bf16_config(src: str | dict[str, Any], tmp_path: Path, **zero: Any) -> str:
    """A copy of a shipped ds_config (or a dict) with bf16 on and ``zero`` keys set, as a path."""
    cfg = json.loads((ROOT / "ds_configs" / src).read_text()) if isinstance(src, str) else src
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": True}
    cfg["zero_optimization"].update(zero)
    if cfg["zero_optimization"]["stage"] == 3:  # partition every parameter, however small
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    name = src if isinstance(src, str) else "planned.json"
    path = tmp_path / f"bf16_{name}"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    return out


@pytest.fixture(scope="module")
def fp32_ref(corpus, tmp_path_factory) -> list[dict]:
    """One process, fp32, 8 iterations (ZeRO-0)."""
    out = tmp_path_factory.mktemp("fp32")
    launch_ranks(1, corpus, out, "zero0.json", [*STEPS, "--train.universal_checkpoint", "false"])
    return metrics(out)


# ------------------------------------------------------------ save and resume
def test_zero0_bf16_save_resume_is_bitwise(corpus, fp32_ref, tmp_path):
    """ZeRO-0 bf16 follows the fp32 curve (DeepSpeed's priming step taken back), saves
    (DeepSpeed's files and the universal copy) and resumes bitwise."""
    ds = bf16_config("zero0.json", tmp_path)
    straight, split = _run(tmp_path, "straight"), _run(tmp_path, "split")
    launch_ranks(1, corpus, straight, ds, STEPS)
    launch_ranks(1, corpus, split, ds, [*STEPS, "--train.exit_interval", "4"])
    assert (split / "ckpt" / "global_step4" / "universal" / "meta.pt").exists()
    launch_ranks(1, corpus, split, ds, [*STEPS, "--resume", "auto"])
    got, ref = metrics(split), metrics(straight)
    assert [r["iteration"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]  # bitwise
    assert_close([r["loss"] for r in ref], [r["loss"] for r in fp32_ref], rtol=BF16_RTOL)
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    assert "bf16" in (split / "log.txt").read_text()


RESUME_SLOW = {  # saved under, resumed under (n, ds_config, args)
    "zero1-dp2": ((2, "zero1.json", []), (2, "zero1.json", [])),
    "zero3-dp2": ((2, "zero3.json", []), (2, "zero3.json", [])),
    "pp2": ((2, "pipeline.json", ["--parallel.pp", "2"]),) * 2,
    "zero0->zero3-dp2": ((1, "zero0.json", []), (2, "zero3.json", [])),
    "zero3-dp2->zero0": ((2, "zero3.json", []), (1, "zero0.json", [])),
    "pp2->dp2": ((2, "pipeline.json", ["--parallel.pp", "2"]), (2, "zero1.json", [])),
    "tp2->tp1": ((2, "zero1.json", ["--parallel.tp", "2"]), (1, "zero1.json", [])),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUME_SLOW))
def test_bf16_resume(case, corpus, fp32_ref, tmp_path):
    """Save at 4, resume to 8 (same or another layout); the curve stays on the fp32 one.
    A same-layout resume is bitwise against the straight run of that layout."""
    (n0, ds0, x0), (n1, ds1, x1) = RESUME_SLOW[case]
    run = _run(tmp_path, "run")
    launch_ranks(
        n0, corpus, run, bf16_config(ds0, tmp_path), [*x0, *STEPS, "--train.exit_interval", "4"]
    )
    launch_ranks(n1, corpus, run, bf16_config(ds1, tmp_path), [*x1, *STEPS, "--resume", "auto"])
    got = metrics(run)
    assert [r["iteration"] for r in got] == list(range(1, 9))
    assert_close([r["loss"] for r in got], [r["loss"] for r in fp32_ref], rtol=BF16_RTOL)
    if (n0, ds0, x0) == (n1, ds1, x1):
        straight = _run(tmp_path, "straight")
        launch_ranks(n0, corpus, straight, bf16_config(ds0, tmp_path), [*x0, *STEPS])
        assert [r["loss"] for r in got] == [r["loss"] for r in metrics(straight)]


# ------------------------------------------------------------------ layouts
LAYOUTS = {  # ZeRO-1 on two ranks: SLOW_LAYOUTS' zero1-2
    "pp2": (2, "pipeline.json", ["--parallel.pp", "2"]),
    "tp2": (2, "zero1.json", ["--parallel.tp", "2"]),
}
ARCH_EXTRA = ["--model.titans.chunk_size", "8", "--model.titans.window", "8",
              "--model.hope.levels", "2", "--model.hope.periods", "0", "4"]  # fmt: skip
SLOW_LAYOUTS = {
    **{f"zero{z}-{n}": (n, f"zero{z}.json", []) for z in (1, 2, 3) for n in (1, 2)},
    "zero0-1": (1, "zero0.json", []),
    "pp2-sublayer": (2, "pipeline.json", ["--parallel.pp", "2", "--parallel.pipeline_unit",
                                           "sublayer"]),
    "tp2-pp2": (4, "pipeline.json", ["--parallel.pp", "2", "--parallel.tp", "2"]),
}  # fmt: skip
ARCHS = ("gated_attention", "hope_attention", "titans")  # the transformer: every other case


def _layout_case(spec: tuple, data: str, fp32_ref: list[dict], tmp_path: Path) -> None:
    n, ds, extra = spec
    launch_ranks(
        n,
        data,
        tmp_path,
        bf16_config(ds, tmp_path),
        [*extra, *STEPS, "--train.universal_checkpoint", "false"],
    )
    got = metrics(tmp_path)
    assert_close([r["loss"] for r in got], [r["loss"] for r in fp32_ref], rtol=BF16_RTOL)
    assert_close(
        [r["grad_norm"] for r in got], [r["grad_norm"] for r in fp32_ref], rtol=20 * BF16_RTOL
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_layout_matches_fp32(name, corpus, fp32_ref, tmp_path):
    _layout_case(LAYOUTS[name], corpus, fp32_ref, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_bf16_layout_matches_fp32_more(name, corpus, fp32_ref, tmp_path):
    _layout_case(SLOW_LAYOUTS[name], corpus, fp32_ref, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_arch_dp2_matches_its_fp32_run(arch, corpus, tmp_path):
    from arch_args import for_arch

    args = [*for_arch(arch, ARCH_EXTRA), *STEPS, "--train.universal_checkpoint", "false"]
    ref, run = _run(tmp_path, "fp32"), _run(tmp_path, "bf16")
    launch_ranks(1, corpus, ref, "zero0.json", args)
    launch_ranks(2, corpus, run, bf16_config("zero1.json", tmp_path), args)
    assert_close(
        [r["loss"] for r in metrics(run)], [r["loss"] for r in metrics(ref)], rtol=BF16_RTOL
    )


# ------------------------------------------------------------- NaN / Inf skip
def test_bf16_zero3_nonfinite_step_is_skipped_whole(corpus, tmp_path, monkeypatch):
    """A NaN gradient on rank 0 at iteration 3 under ZeRO-3 with many sub-groups (sub_group_size
    1000): no sub-group is updated (later losses finite and equal a clean run's up to 2), the
    scheduler does not step (iteration 4 has iteration 3's learning rate), one step counted."""
    ds = bf16_config("zero3.json", tmp_path, sub_group_size=1000)
    clean, nan = _run(tmp_path, "clean"), _run(tmp_path, "nan")
    args = ["--train.iters", "5", "--eval.interval", "0", "--train.universal_checkpoint", "false"]
    launch_ranks(2, corpus, clean, ds, args)
    monkeypatch.setenv("TAPERED_MEGATRON_INJECT_NAN", "3")  # inherited by the ranks
    launch_ranks(2, corpus, nan, ds, args)
    ok, bad = metrics(clean), metrics(nan)
    log = (nan / "log.txt").read_text()
    assert "iteration 3: loss nan or gradients not finite: step skipped" in log, log[-3000:]
    assert [r.get("skipped", False) for r in bad] == [i == 3 for i in range(1, 6)]
    assert [r["loss"] for r in bad[:2]] == [r["loss"] for r in ok[:2]]
    assert all(math.isfinite(r["loss"]) for r in bad[3:])
    assert bad[3]["lr"] == ok[2]["lr"] and bad[4]["lr"] == ok[3]["lr"]


# ------------------------------------------------------- every ds_config runs
SHIPPED = sorted(p.name for p in (ROOT / "ds_configs").glob("*.json"))
DEFAULT_SHIPPED = {"zero2_offload.json"}  # DeepSpeed's CPU Adam under ZeRO-Offload
PLANNED = {  # planner candidate kinds: (zero, pp); TP and DP do not change the ds_config's kind
    f"zero{z}{'-pp2' if pp > 1 else ''}": (z, pp)
    for z in (0, 1, 2, 3)
    for pp in (1, 2)
    if pp == 1 or z <= 1
}


def _shipped(name: str, tmp_path: Path) -> tuple[int, str, list[str]]:
    """A shipped config at the tiny shape: pipeline configs on 2 stages, the cluster configs'
    fixed batch keys made those of the tiny run (micro-batch 4, global batch 8)."""
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
    n, extra = 1, []
    if "pipeline" in cfg:
        n, extra = 2, ["--parallel.pp", "2"]
        cfg["pipeline"]["stages"] = 2
    if name.startswith("cluster_"):
        cfg.update(
            train_batch_size=8, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2
        )
    return n, bf16_config(cfg, tmp_path), extra


def _config_trains(n: int, ds: str, extra: list[str], data: str, out: Path) -> None:
    launch_ranks(n, data, out, ds, [*extra, *SHORT])
    got = metrics(out)
    assert [r["iteration"] for r in got] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in got)
    assert "bf16" in (out / "log.txt").read_text()


@pytest.mark.parametrize(
    "name",
    [x if x in DEFAULT_SHIPPED else pytest.param(x, marks=pytest.mark.slow) for x in SHIPPED],
)
def test_shipped_ds_config_trains_in_bf16(name, corpus, tmp_path):
    _config_trains(*_shipped(name, tmp_path), corpus, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PLANNED))
def test_planned_ds_config_trains_in_bf16(kind, corpus, tmp_path):
    zero, pp = PLANNED[kind]
    cfg = load_config(
        "quickstart", ["--train.micro_batch_size", "4", "--train.global_batch_size", "8"]
    )
    best = Candidate(1, pp, 1, zero, 4, 2, "none", "layer")
    ds = ds_config(cfg, best, costlib.get_device("h100"))
    assert ds["bf16"]["enabled"]
    assert ("data_types" in ds) == (zero >= 1)  # fp32 accumulation wherever DeepSpeed takes it
    extra = ["--parallel.pp", "2"] if pp > 1 else []
    _config_trains(pp, bf16_config(ds, tmp_path), extra, corpus, tmp_path)


# ------------------------------------------------------------------- export
def test_export_of_a_bf16_run_holds_the_fp32_masters_and_hf_logits_match(corpus, tmp_path):
    """A bf16 ZeRO-0 checkpoint exports its fp32 master weights (the universal copy's, not the
    bf16-rounded module weights DeepSpeed saves), and the Hugging Face model loaded from the
    export gives the logits of our fp32 module holding them."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from tapered_megatron.checkpoint.consolidate import resolve_checkpoint
    from tapered_megatron.export.__main__ import main as export_main
    from tapered_megatron.models import build_model

    run = _run(tmp_path, "run")
    launch_ranks(1, corpus, run, bf16_config("zero0.json", tmp_path), ["--train.iters", "2"])
    ckpt = run / "ckpt"
    assert export_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    universal = ckpt / "global_step2" / "universal"
    module = torch.load(ckpt / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    for name in ("layers.0.mlp.w13.weight", "head.proj.weight", "layers.1.mixer.out.weight"):
        master = torch.load(universal / f"{name}.pt", weights_only=True)["fp32"]
        assert module["module"][name].dtype == torch.bfloat16
        assert torch.equal(got[name], master), name
        assert (master != master.bfloat16().float()).float().mean() > 0.9  # not bf16-rounded
    model = build_model(resolve_checkpoint(ckpt).cfg).eval()
    model.load_state_dict(got)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    ids = torch.randint(0, 255, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)[..., : hf.config.vocab_size]
        assert (hf(ids).logits - want).abs().max().item() <= 1e-5
