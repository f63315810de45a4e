"""An architecture defined outside the package: registered through ``model.plugins``, checked
like a built-in one, trained through ``pretrain/main.py``, and shown in docs/ARCHITECTURE.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch_helpers import launch_ranks, metrics

from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.models import build_model, count_model

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "tests/fixtures/ext_arch/token_shift.py"
USE = ["--model.plugins", str(ROOT / PLUGIN), "--model.arch", "token_shift"]
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


@pytest.mark.distributed
def test_plugin_architecture_trains_through_main(corpus, tmp_path):
    launch_ranks(1, corpus, tmp_path, "default.json", [*USE, "--train.iters", "4"])
    recs = metrics(tmp_path)
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]
    saved = (tmp_path / "ckpt" / "global_step4" / "config.yaml").read_text()
    assert "arch: token_shift" in saved and "token_shift.py" in saved


def test_architecture_doc_shows_the_plugin_it_tests():
    """docs/ARCHITECTURE.md's worked example is this very file."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert (ROOT / PLUGIN).read_text() in doc
