"""Hope-attention's Continuum Memory System: plain-chain equivalence at rate 0, update timing of
fast vs slow levels, causality, budget, TP=2 vs TP=1, training on real text."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_titans import assert_causal, assert_tp_equal, tiny_cfg, train_losses

from tapered_megatron.models import build_model, count_model
from tapered_megatron.models.hope import ContinuumMemory, level_widths


def _plain_chain(cms: ContinuumMemory, u: torch.Tensor) -> torch.Tensor:
    """``sum_i f_i(u_{i-1})`` with ``u_i = u_{i-1} + f_i(u_{i-1})``, written plainly."""
    total = torch.zeros_like(u)
    for level in cms.levels:
        gate, up = F.linear(u, level.w13.weight).chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, level.w2.weight)
        u, total = u + o, total + o
    return total


@pytest.mark.parametrize(
    "overrides", [["--model.hope.lr", "0"], ["--model.hope.periods", "0", "0", "0"]]
)
def test_rates_zero_is_attention_plus_plain_mlp_chain(overrides):
    cfg = tiny_cfg("hope_attention", *overrides)
    model = build_model(cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.embedding(ids)
        for block in model.layers:
            z = h + block.mixer(block.mixer_norm(h))
            expected = z + _plain_chain(block.mlp, block.mlp_norm(z))
            torch.testing.assert_close(block(h), expected, rtol=0, atol=0)
            h = expected


def test_slow_levels_change_less_often_than_fast_ones():
    cfg = tiny_cfg(
        "hope_attention", "--model.seq_len", "64", "--model.hope.periods", "0", "32", "8"
    )
    model = build_model(cfg)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    cms = model.layers[0].mlp
    cms.record_updates = True
    with torch.no_grad():
        model(ids)
    static, slow, fast = cms.last_updates
    assert static == []
    assert slow == [32]
    assert fast == [8, 16, 24, 32, 40, 48, 56]
    assert 0 < len(slow) < len(fast)


def test_updates_start_exactly_at_the_first_boundary():
    """Before the fastest period ends, the updating CMS equals the static one; after, it differs."""
    cfg = tiny_cfg("hope_attention", "--model.hope.periods", "0", "16", "4")
    cms_on = build_model(cfg).layers[0].mlp
    cms_off = build_model(cfg.with_overrides(["--model.hope.lr", "0"])).layers[0].mlp
    u = torch.randn(2, 32, cfg.model.d_model)
    with torch.no_grad():
        on, off = cms_on(u), cms_off(u)
    torch.testing.assert_close(on[:, :4], off[:, :4], rtol=0, atol=1e-6)
    assert not torch.allclose(on[:, 4:], off[:, 4:])


def test_causal_across_period_boundaries():
    cfg = tiny_cfg("hope_attention")
    model = build_model(cfg).train()
    # periods 16 and 4: cut points on, before and after boundaries
    assert_causal(model, 256, 32, [0, 3, 4, 5, 15, 16, 20, 30])


def test_budget_follows_d_ff_and_gradients_reach_every_level():
    cfg = tiny_cfg("hope_attention")
    model = build_model(cfg)
    d = cfg.model.d_model
    for layer, width in enumerate(cfg.taper_plan.widths):
        cms = model.layers[layer].mlp
        assert sum(cms.widths) == width
        assert sum(p.numel() for p in cms.parameters()) == 3 * d * width
    ref = count_model(cfg.with_overrides(["--model.arch", "transformer"]))
    assert count_model(cfg).params_total == ref.params_total
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    from tapered_megatron.models import lm_loss

    lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    for level in model.layers[0].mlp.levels:
        assert level.w13.weight.grad.abs().sum() > 0 and level.w2.weight.grad.abs().sum() > 0
    assert level_widths(96, 3, 16) == [32, 32, 32] and level_widths(112, 3, 16) == [48, 32, 32]
    with pytest.raises(ValueError, match=r"hope\.levels"):
        level_widths(32, 3, 16)


@pytest.mark.distributed
def test_tp2_equals_tp1():
    assert_tp_equal({"hope": ["hope_attention"]})


def test_loss_decreases_on_real_text():
    cfg = tiny_cfg("hope_attention", "--model.d_model", "64", "--model.d_ff", "192")
    losses = train_losses(cfg, steps=40)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"hope_attention loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.5
