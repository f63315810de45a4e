"""scripts/gpu_check.sh: its stage limits fit the GPU budget, and its dry run (every stage on
this CPU, tiny shapes, explicit bf16) completes with each stage's JSON lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_BUDGET_S = 480
STEPS = {
    "quickstart": ["train", "resume", "export", "generate"],
    "arch_transformer": ["train"],
    "arch_gated_attention": ["train"],
    "arch_hope_attention": ["train"],
    "arch_titans": ["train"],
}
BENCHES = {
    "sdpa_kernels": "sdpa_kernels",
    "mfu_440m_eager": "preset_train_step_mfu",
    "mfu_760m_eager": "preset_train_step_mfu",
    "mfu_440m_compiled": "preset_train_step_mfu",
    "mfu_760m_compiled": "preset_train_step_mfu",
    "vs_llama": "model_train_step",
    "memory_vs_plan": "memory_vs_plan",
}


def stage_limits() -> dict[str, tuple[int, int]]:
    """``stage NAME GPU_LIMIT DRY_LIMIT ...`` calls of the script: name -> (GPU, dry run)."""
    calls = re.findall(r"^stage (\S+) (\d+) (\d+) ", SCRIPT.read_text(), re.M)
    return {name: (int(gpu), int(dry)) for name, gpu, dry in calls}


def test_stage_limits_fit_the_budget():
    """Every stage has a limit, and the GPU limits sum to at most eight minutes."""
    limits = stage_limits()
    assert set(limits) == {*STEPS, *BENCHES, "rng_streams"}
    assert sum(gpu for gpu, _ in limits.values()) <= GPU_BUDGET_S


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_dry_run_writes_every_stage(tmp_path):
    """``--dry-run`` end to end (about 6 minutes on a loaded 2-core CPU): every stage finishes
    within its limit with rc 0 and writes its result lines; the quickstart resumes from its
    checkpoint, exports and generates; the SDPA check finds no math kernel. The RNG stage may
    fail only while scripts/check_rng_streams.py does not exist."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_WORK": str(work)}
    env.pop("GPU_CHECK_DRY", None)
    limits = stage_limits()
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=sum(dry for _, dry in limits.values()) + 120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = {x["stage"]: x for x in _lines(out / "stages.jsonl")}
    assert set(summary) == set(limits)
    rng_script = (ROOT / "scripts" / "check_rng_streams.py").exists()
    for name, line in summary.items():
        assert line["dry_run"] is True
        assert line["limit_s"] == limits[name][1]
        if name == "rng_streams" and not rng_script:
            assert line["rc"] != 0
            continue
        assert line["rc"] == 0, (name, (out / f"{name}.log").read_text()[-2000:])
        lines = _lines(out / f"{name}.json")
        assert lines[-1] == line
        if name in STEPS:
            steps = {x["step"]: x for x in lines if "step" in x}
            assert list(steps) == STEPS[name]
            assert all(x["rc"] == 0 for x in steps.values())
        elif name in BENCHES:
            assert [x["bench"] for x in lines if "bench" in x] == [BENCHES[name]]
    quick = {x["step"]: x for x in _lines(out / "quickstart.json") if "step" in x}
    assert quick["train"]["last_iter"].startswith("iter      4/4")
    assert quick["resume"]["resumed"].startswith("resumed from")
    assert quick["resume"]["last_iter"].startswith("iter      6/6")
    assert (work / "quickstart_export" / "model.safetensors").exists()
    for arch in ("transformer", "gated_attention", "hope_attention", "titans"):
        (train,) = [x for x in _lines(out / f"arch_{arch}.json") if "step" in x]
        assert train["last_iter"].startswith("iter      2/2"), train
    (sdpa,) = [x for x in _lines(out / "sdpa_kernels.json") if "bench" in x]
    assert sdpa["ok"] and all("math" not in p["kernels"] for p in sdpa["presets"].values())
    (mem,) = [x for x in _lines(out / "memory_vs_plan.json") if "bench" in x]
    assert mem["layout"]["precision"] == "bf16" and mem["predicted_gib"] > 0
