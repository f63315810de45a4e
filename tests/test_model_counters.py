"""Counters: counted parameters equal the meta-built module; tapering keeps params and FLOPs."""

from __future__ import annotations

import json

import pytest
import torch

from tapered_megatron.architectures import BUILT_IN
from tapered_megatron.config import load_config, preset_names
from tapered_megatron.models import build_model, count_model, summary

PRESETS = preset_names()


def _load(preset: str, *overrides: str):
    return load_config(preset, list(overrides))  # an unknown architecture fails here


def test_every_architecture_has_presets_at_the_paper_scales():
    """The preset-parametrised counter tests cover every architecture of the package (others
    may be registered by tests or plugins)."""
    ours = set(BUILT_IN)
    assert {load_config(p, []).model.arch for p in PRESETS} == ours
    for arch in ours:
        assert {f"{arch}_{s}" for s in ("440m", "760m", "1.3b")} <= set(PRESETS), arch


@pytest.mark.parametrize("preset", PRESETS)
def test_counted_params_equal_meta_module(preset):
    cfg = _load(preset)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    counts = count_model(cfg)
    assert counts.params_total == sum(p.numel() for p in model.parameters())
    assert counts.embedding.params == model.embedding.embed.weight.numel()
    for lc, block in zip(counts.layers, model.layers):
        assert lc.total.params == sum(p.numel() for p in block.parameters())
        assert lc.d_ff == cfg.taper_plan.widths[lc.layer]


def test_counted_params_equal_real_module():
    for arch in ("transformer", "gated_attention"):
        cfg = load_config("quickstart", ["--model.arch", arch])
        assert count_model(cfg).params_total == sum(
            p.numel() for p in build_model(cfg).parameters()
        )


def _cms_split_slack(cfg) -> float:
    """FLOPs the Hope CMS level split can add beyond linearity in d_ff (0 for other archs).

    Each layer splits d_ff(l) into levels in whole rounding units; where the remainder lands
    (a static level or an in-context-updating one, which costs more per unit of width) is not
    linear in d_ff(l). Bound: per layer and variant, under one unit per level at the update price.
    """
    if cfg.model.arch != "hope_attention":
        return 0.0
    from tapered_megatron.models.hope import ContinuumMemory

    unit, levels = cfg.taper_plan.unit, cfg.model.hope.levels
    one = ContinuumMemory.counts(cfg, 0, d_ff=levels * unit).flops / (levels * unit)
    static = cfg.with_overrides(["--model.hope.lr", "0"])
    base = ContinuumMemory.counts(static, 0, d_ff=levels * unit).flops / (levels * unit)
    return 2 * cfg.model.layers * unit * levels * abs(one - base)


@pytest.mark.parametrize("preset", PRESETS)
def test_taper_keeps_params_and_flops_within_plan_deviation(preset):
    variants = {
        "tapered": _load(preset),
        "uniform": _load(preset, "--taper.schedule", "uniform"),
        "reverse": _load(preset, "--taper.reverse", "true"),
    }
    counts = {k: count_model(c) for k, c in variants.items()}
    uni = counts["uniform"]
    # MLP parameters and FLOPs are linear in d_ff: the slope per unit of width
    lc = uni.layers[0]
    p_slope, f_slope = lc.mlp.params / lc.d_ff, lc.mlp.flops / lc.d_ff
    dev_u = abs(variants["uniform"].taper_plan.deviation)
    split_slack = _cms_split_slack(variants["uniform"])
    for name in ("tapered", "reverse"):
        dev = abs(variants[name].taper_plan.deviation) + dev_u
        c = counts[name]
        assert abs(c.params_total - uni.params_total) <= p_slope * dev + 1e-6, name
        flops_bound = f_slope * dev * 1.0001 + split_slack + 1e-6
        assert abs(c.flops_per_token - uni.flops_per_token) <= flops_bound, name
    assert counts["tapered"].params_total == counts["reverse"].params_total
    assert [l.d_ff for l in counts["reverse"].layers] == [l.d_ff for l in counts["tapered"].layers][
        ::-1
    ]


def test_flops_match_hand_count():
    cfg = load_config("quickstart", ["--taper.schedule", "uniform"])
    m, v = cfg.model, cfg.padded_vocab_size
    per_layer = 2 * (4 * m.d_model**2 + 3 * m.d_model * m.d_ff) + 2 * m.d_model * (m.seq_len + 1)
    assert count_model(cfg).flops_per_token == pytest.approx(
        m.layers * per_layer + 2 * m.d_model * v
    )
    assert count_model(cfg).train_flops_per_token == pytest.approx(
        3 * count_model(cfg).flops_per_token
    )


def test_summary_json(capsys):
    assert summary.main(["--config", "transformer_7b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("params_total", "params_per_layer", "flops_per_token", "d_ff"):
        assert key in out
    assert out["params_total"] == out["params_meta"] > 6e9
    assert len(out["d_ff"]) == len(out["params_per_layer"]) == 32
    assert summary.main(["--config", "quickstart", "--model.arch", "gated_attention"]) == 0
    assert "taper: cosine" in capsys.readouterr().out
    assert summary.main(["--config", "quickstart", "--model.nope", "1"]) == 2


def test_meta_build_allocates_nothing():
    cfg = load_config("transformer_30b")
    model = build_model(cfg, device="meta")
    assert not any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()])
    assert torch.empty(0).device.type == "cpu"  # the device context did not leak


#: count_model's forward FLOPs over PyTorch's FlopCounterMode's, per architecture and number of
#: key/value heads (4: one per head; 1: multi-query), at the shape of the test below. Above 1
#: because torch's counter skips in-place products (the ``baddbmm_`` of Hope's dual-form
#: corrections) and counts Titans' window by its blocks.
FLOP_RATIO = {("transformer", 4): 1.134, ("gated_attention", 4): 1.126, ("titans", 4): 1.108,
              ("hope_attention", 4): 1.178, ("transformer", 1): 1.149,
              ("titans", 1): 1.115}  # fmt: skip


@pytest.mark.parametrize("arch, kv", list(FLOP_RATIO))
def test_forward_flops_agree_with_torch_flop_counter(arch, kv):
    """An independent count: PyTorch's FlopCounterMode over one forward pass (matmuls and
    attention) against ``count_model``'s forward FLOPs per token, at d 128, 2 layers, seq 256,
    within 2 % of the recorded ratio: a missing term (the head is 12 % of the count, attention
    scores 12 %) or a doubled one fails; with one key/value head, counting the key/value
    projections at 4 heads (10 % of the count) fails too."""
    from arch_args import for_arch
    from torch.utils.flop_counter import FlopCounterMode

    shape = ["--model.d_model", "128", "--model.heads", "4", "--model.layers", "2"]
    shape += ["--model.kv_heads", str(kv)]
    shape += ["--model.d_ff", "384", "--model.seq_len", "256", "--model.vocab_size", "512"]
    cfg = load_config("quickstart", for_arch(arch, shape))
    model = build_model(cfg).eval()
    ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    measured = counter.get_total_flops() / ids.numel()
    ratio = count_model(cfg, 4).flops_per_token / measured
    assert ratio == pytest.approx(FLOP_RATIO[arch, kv], rel=0.02)


def test_teach_first_pass_is_counted():
    """``hope.update teach`` runs a first forward of the whole model (static CMS levels) in
    every training step: count_model's training FLOPs add it, and they agree with an
    independent count, PyTorch's FlopCounterMode over one training step (forward, first pass
    included, and backward), in their ratio to the association step's (measured: 1.23 counted,
    1.29 by torch at d 128, 2 layers; without the first pass counted: 1.00)."""
    from torch.utils.flop_counter import FlopCounterMode

    shape = ["--model.arch", "hope_attention", "--model.d_model", "128", "--model.heads", "4"]
    shape += ["--model.layers", "2", "--model.d_ff", "384", "--model.seq_len", "128"]
    shape += ["--model.vocab_size", "512", "--model.hope.periods", "0", "32", "16"]
    ids = torch.randint(0, 512, (2, 129), generator=torch.Generator().manual_seed(0))
    counted, measured = {}, {}
    for update in ("association", "teach"):
        cfg = load_config("quickstart", [*shape, "--model.hope.update", update])
        counts = count_model(cfg, 4)
        counted[update] = counts.train_flops_per_token
        model = build_model(cfg)
        with FlopCounterMode(display=False) as counter:
            model(ids[:, :-1], ids[:, 1:]).backward()
        measured[update] = counter.get_total_flops()
    static = load_config("quickstart", [*shape, "--model.hope.lr", "0"])
    assert counts.first_pass_flops == count_model(static, 4).flops_per_token > 0
    ratio_counted = counted["teach"] / counted["association"]
    ratio_measured = measured["teach"] / measured["association"]
    assert ratio_counted == pytest.approx(ratio_measured, rel=0.08)
    assert ratio_counted > 1.15


def test_architectures_presets_match_parameters_at_every_reproduction_scale(capsys):
    """``models.summary --compare``: at 440m / 760m / 1.3b and the reproduction's cpu scale
    every architecture's preset has its transformer's parameters within 2 % (the MLP width
    gives back what the mixer adds); training FLOPs per token are stated, not matched (Hope's
    in-context updates and teach-signal pass cost more than their parameters say)."""
    assert summary.main(["--compare", "440m", "760m", "1.3b", "cpu", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    archs = ("transformer", "gated_attention", "titans", "hope_attention")
    assert sorted((r["scale"], r["arch"]) for r in rows) == sorted(
        (s, a) for s in ("440m", "760m", "1.3b", "cpu") for a in archs
    )
    for r in rows:
        assert abs(r["params_ratio"] - 1) <= 0.02, r
        if r["arch"] == "transformer":
            assert r["params_ratio"] == r["flops_ratio"] == 1.0
    assert all(r["flops_ratio"] > 1.5 for r in rows if r["arch"] == "hope_attention")
    assert summary.main(["--compare", "9x"]) == 2
    assert "no preset transformer_9x" in capsys.readouterr().err
