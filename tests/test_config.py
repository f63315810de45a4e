"""Configuration: presets load, overrides apply, bad input is rejected naming the key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tapered_megatron.config import ConfigError, load_config, parse_overrides, preset_names

PRESETS = preset_names()


def test_presets_cover_every_arch_and_scale():
    for arch in ("transformer", "gated_attention", "titans", "hope_attention"):
        for scale in ("440m", "760m", "1.3b", "7b", "30b"):
            assert f"{arch}_{scale}" in PRESETS
    assert "quickstart" in PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_plans(name):
    cfg = load_config(name)
    plan = cfg.taper_plan
    assert plan.layers == cfg.model.layers and plan.deviation == 0
    assert cfg.model.arch in name or name in ("quickstart", "tlm_cpu")  # tlm_cpu: all archs


def test_overrides_apply_with_types():
    cfg = load_config(
        "quickstart",
        [
            "--model.arch",
            "titans",
            "--taper.schedule",
            "uniform",
            "--train.iters=20",
            "--taper.ratio",
            "1.25",
            "0.75",
            "--train.checkpoint_activations",
            "true",
            "--model.titans.chunk_size",
            "8",
        ],
    )
    assert cfg.model.arch == "titans" and cfg.taper.schedule == "uniform"
    assert cfg.train.iters == 20 and cfg.taper.ratio == (1.25, 0.75)
    assert cfg.train.recompute == "full" and cfg.model.titans.chunk_size == 8
    assert set(cfg.taper_plan.widths) == {cfg.model.d_ff}
    again = cfg.with_overrides(["--train.iters", "5"])
    assert again.train.iters == 5 and again.model.arch == "titans"


def test_public_entry_point():
    cfg = load_config("quickstart", ["--model.arch", "gated_attention"])
    assert cfg.model.arch == "gated_attention" and cfg.name == "quickstart"
    assert cfg.padded_vocab_size % 128 == 0 and cfg.padded_vocab_size >= cfg.model.vocab_size


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["--model.foo", "1"], r"model\.foo: unknown key"),
        (["--modle.arch", "titans"], r"modle: unknown key"),
        (["--train.iters", "ten"], r"train\.iters: expected an integer"),
        (["--train.checkpoint_activations", "maybe"], r"checkpoint_activations: expected"),
        (
            ["--parallel.activation_checkpointing", "true"],
            r"parallel\.activation_checkpointing was renamed: use train\.checkpoint_activations",
        ),
        (["--model.arch", "mamba"], r"model\.arch: unknown architecture"),
        (["--model.heads", "5"], r"model\.heads"),
        (["--parallel.tp", "4"], r"parallel\.tp"),
        (["--parallel.pp", "7"], r"parallel\.pp"),
        (["--taper.ratio", "1.5", "0.7"], r"taper\.ratio"),
        (["--taper.ratio", "1.9", "0.1", "--taper.multiple", "64"], r"rounding unit"),
        (["--train.min_lr", "1.0"], r"train\.min_lr"),
        (["--data.split", "a,b"], r"data\.split"),
        (["--train.iters", "1", "--train.iters", "2"], r"given twice"),
        (["train.iters", "1"], r"unexpected argument"),
        (
            [
                "--model.arch",
                "titans",
                "--model.titans.variant",
                "mac",
                "--model.titans.window",
                "20",
            ],
            r"titans\.window",
        ),
        (
            [
                "--model.arch",
                "titans",
                "--model.titans.variant",
                "lmm",
                "--model.titans.persistent_tokens",
                "2",
            ],
            r"persistent",
        ),
        (
            ["--model.arch", "titans", "--model.titans.persistent_tokens", "-1"],
            r"titans\.persistent_tokens",
        ),
        (["--model.arch", "titans", "--model.titans.max_step", "0.04"], r"titans\.max_step"),
        (["--model.arch", "titans", "--model.titans.max_momentum", "0.8"], r"max_momentum"),
        (["--model.arch", "hope_attention", "--model.hope.rate", "adaptive"], r"hope\.rate"),
        (["--model.arch", "hope_attention", "--model.hope.rate_init", "1.0"], r"hope\.rate_init"),
        (["--model.arch", "hope_attention", "--model.hope.update", "outer"], r"hope\.update"),
        (
            [
                "--model.arch",
                "hope_attention",
                "--model.hope.step_norm",
                "input",
                "--model.hope.w2_gate_spread",
                "4.8",
            ],
            r"hope\.w2_gate_spread: .*hope\.step_norm split",
        ),
        (
            [
                "--model.arch",
                "hope_attention",
                "--model.hope.update",
                "teach",
                "--parallel.pp",
                "2",
            ],
            r"hope\.update: teach",
        ),
        (
            [
                "--model.arch",
                "hope_attention",
                "--model.hope.levels",
                "17",
                "--model.hope.periods",
                *["0"] * 17,
            ],
            r"model\.hope\.levels",
        ),
    ],
)
def test_bad_input_names_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("quickstart", overrides)


def test_unknown_preset_and_base_inheritance(tmp_path):
    with pytest.raises(ConfigError, match="no preset named"):
        load_config("no_such_preset")
    child = tmp_path / "child.yaml"
    child.write_text("base: transformer_440m\nmodel: {arch: titans}\ntrain: {iters: 7}\n")
    cfg = load_config(str(child))
    assert cfg.model.arch == "titans" and cfg.model.d_model == 1024 and cfg.train.iters == 7


def test_parse_overrides_nests_and_keeps_negative_numbers():
    assert parse_overrides(["--a.b.c", "-1", "--a.d", "x", "y"]) == {
        "a": {"b": {"c": "-1"}, "d": ["x", "y"]}
    }


def test_print_cli():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tapered_megatron.config",
            "--config",
            "quickstart",
            "--model.arch",
            "hope_attention",
            "--print",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    obj = json.loads(out)
    assert obj["model"]["arch"] == "hope_attention" and sum(obj["taper_plan"]["widths"]) == 6 * 512
    bad = subprocess.run(
        [sys.executable, "-m", "tapered_megatron.config", "--model.layers", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "model.layers" in bad.stderr


def test_saved_config_of_an_older_checkpoint_loads(tmp_path):
    """config.yaml written before the architecture records carried every arch's section."""
    import yaml

    from tapered_megatron.config import load_saved_config

    cfg = load_config("quickstart")
    old = cfg.to_dict()
    old["model"]["titans"] = {"chunk_size": 16, "window": 64}
    old["model"]["hope"] = {"levels": 3, "periods": [0, 64, 16]}
    old["model"]["gate"] = "elementwise"
    del old["train"]["recompute"]
    old["parallel"]["activation_checkpointing"] = True  # the key's name before the rename
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    assert load_saved_config(path) == cfg.with_overrides(["--train.checkpoint_activations", "true"])
    with pytest.raises(ConfigError, match="a config carries only its own"):
        load_config(str(path))


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("--train.lr", "inf", "train.lr: must be a finite number"),
        ("--train.clip_grad", "nan", "train.clip_grad: must be a finite number"),
        ("--train.min_lr", "-1e-4", "train.min_lr: must be >= 0"),
        ("--train.adam_beta2", "1.0", "train.adam_beta2: must be < 1"),
        (
            "--train.iters",
            "100000000000000000000000",
            "train.iters: 100000000000000000000000 is out",
        ),
        ("--train.iters", "1e23", "train.iters: expected an integer"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_one_line(key, value, says):
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", [key, value])
    assert says in str(e.value) and "\n" not in str(e.value)
