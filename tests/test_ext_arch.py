"""Architectures defined outside the package: registered through ``model.plugins``, checked
like a built-in one, and shown in docs/ARCHITECTURE.md. ``token_shift`` is one file, configured
and built; ``qk_norm`` is a package (its record, plain data, and its modules) taken through
presets, training through ``pretrain/main.py``, export, Hugging Face generation with a key/value
cache and the scale planner, with no file outside its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_helpers import launch_ranks, metrics

from tapered_megatron.config import ConfigError, load_config, preset_names
from tapered_megatron.models import build_model, count_model

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "tests/fixtures/ext_arch/token_shift.py"
USE = ["--model.plugins", str(ROOT / PLUGIN), "--model.arch", "token_shift"]
PACKAGE = "tests/fixtures/ext_arch/qk_norm"
PACKAGE_USE = ["--model.plugins", str(ROOT / PACKAGE)]
TINY = [
    "--model.d_model", "32", "--model.heads", "2", "--model.layers", "2", "--model.d_ff", "64",
    "--model.seq_len", "16", "--model.vocab_size", "256", "--taper.multiple", "16",
]  # fmt: skip


def test_plugin_architecture_is_configured_like_a_builtin():
    cfg = load_config("quickstart", [*TINY, *USE, "--model.token_shift.shift", "3"])
    assert cfg.model.token_shift.shift == 3
    assert cfg.to_dict()["model"]["token_shift"] == {"shift": 3}
    assert cfg.with_overrides(["--train.iters", "5"]).model.token_shift.shift == 3
    model = build_model(cfg)
    assert count_model(cfg).params_total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 256  # causal: positions <= 8 unchanged
    torch.testing.assert_close(model(changed)[:, :9], model(ids)[:, :9], atol=0, rtol=0)
    for bad, match in [
        (["--model.token_shift.shift", "0"], r"model\.token_shift\.shift: must be >= 1"),
        (["--model.token_shift.shift", "16"], r"must be below model\.seq_len"),
        (["--model.token_shift.width", "2"], r"model\.token_shift\.width: unknown key"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config("quickstart", [*TINY, *USE, *bad])
    with pytest.raises(ConfigError, match=r"model\.plugins: file .*missing\.py does not exist"):
        load_config("quickstart", ["--model.plugins", "missing.py", "--model.arch", "x"])


def test_package_architecture_has_presets_from_its_record_without_torch():
    """``<arch>_<scale>`` is the scale's file plus the record's layer for that scale (or none),
    and loading it imports no torch: the record is plain data."""
    code = (
        "import json, sys; from tapered_megatron.config import load_config; "
        f"c = load_config('qk_norm_cpu', {PACKAGE_USE!r}); "
        "print(json.dumps([c.model.qk_norm.scale, [m for m in sys.modules if 'torch' in m]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [8.0, []]
    cpu, big = load_config("qk_norm_cpu", PACKAGE_USE), load_config("qk_norm_7b", PACKAGE_USE)
    assert cpu.model.d_model == load_config("tlm_cpu").model.d_model  # the cpu scale's shape
    assert (big.model.arch, big.model.qk_norm.scale, big.name) == ("qk_norm", 10.0, "qk_norm_7b")
    assert big.train.save_dir == "checkpoints/qk_norm_7b"
    assert {"qk_norm_cpu", "qk_norm_7b"} <= set(preset_names())


@pytest.mark.distributed
def test_package_architecture_trains_exports_generates_and_plans(corpus, tmp_path, capsys):
    import transformers

    from tapered_megatron.export.__main__ import main as export_main
    from tapered_megatron.planning.planner import main as plan_main

    use = ["--config", "qk_norm_cpu", *PACKAGE_USE, "--train.iters", "4"]
    launch_ranks(1, corpus, tmp_path, "default.json", [*use, "--logging.interval", "1"])
    recs = metrics(tmp_path)
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]
    saved = (tmp_path / "ckpt" / "global_step4" / "config.yaml").read_text()
    assert "arch: qk_norm" in saved and PACKAGE in saved
    out = tmp_path / "export"
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--out", str(out), "--plugins"]
    assert export_main([*args, str(ROOT / PACKAGE)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert hf.cfg.model.qk_norm.scale == 8.0 and hf.supports_kv_cache
    prompt = torch.randint(0, 255, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    with torch.no_grad():
        cached = hf.generate(prompt, use_cache=True, **kw)
        assert cached.tolist() == hf.generate(prompt, use_cache=False, **kw).tolist()
    capsys.readouterr()
    gpus = ["--gpus", "64", "--gpu-mem", "80", "--nodes", "8", "--json", "--top", "1"]
    assert plan_main(["--config", "qk_norm_7b", *PACKAGE_USE, *gpus]) == 0
    best = json.loads(capsys.readouterr().out.splitlines()[-1])["best"]
    assert best["tp"] * best["pp"] * best["dp"] == 64


def test_architecture_doc_shows_the_plugins_it_tests():
    """docs/ARCHITECTURE.md's worked examples are these very files."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for path in (PLUGIN, f"{PACKAGE}/__init__.py", f"{PACKAGE}/modules.py"):
        assert (ROOT / path).read_text() in doc, path
