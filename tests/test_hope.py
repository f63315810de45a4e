"""Hope-attention's Continuum Memory System: plain-chain equivalence at rate 0, update timing of
fast vs slow levels, plain reference of the update rule, causality, budget, training on real
text. TP=2 vs TP=1 for hope_attention runs in ``test_titans.py`` (one launch for both)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_memory import assert_causal, assert_learns_real_text, tiny_cfg

from tapered_megatron.models import build_model, count_model
from tapered_megatron.models.hope import (
    NORM_EPS,
    W2_GATE_GAIN,
    ContinuumMemory,
    level_widths,
)
from tapered_megatron.parallel import init_parameters


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


def _reference_level(level, u: torch.Tensor, eta: float, teach=None) -> torch.Tensor:
    """The CMS rule written plainly: per-sequence weights, per-token autograd gradients of
    ``1/2 ||f(u_t) - u_{t+1}||^2`` (or of ``<f(u_t), teach_t>``: output error ``teach_t``) clipped
    to norm ``sqrt(d)``, scaled by the token's rate and divided by the squared norm of the
    level's input ``u_t`` (W_2 with ``own``: of its own input ``a_t``; with ``split``: its own
    rate over ``||a_t||^2`` plus the period's mean ``||a||^2``), summed over the period, applied
    at its end."""
    d, c = u.shape[-1], level.period
    rates = level.rates(u, eta).detach()
    rates2 = level.rates(u, eta, w2=True).detach()
    outs = []
    for b in range(u.shape[0]):
        w13, w2 = level.w13.weight.detach().clone(), level.w2.weight.detach().clone()
        acc13, acc2 = torch.zeros_like(w13), torch.zeros_like(w2)
        rows = []
        for t in range(u.shape[1]):
            if t > 0 and t % c == 0:
                w13, w2 = w13 - acc13, w2 - acc2
                acc13, acc2 = torch.zeros_like(w13), torch.zeros_like(w2)
            p13, p2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
            gate, up = F.linear(u[b, t], p13).chunk(2)
            y = F.linear(F.silu(gate) * up, p2)
            rows.append(y.detach())
            if t + 1 < u.shape[1]:
                inner = (
                    0.5 * (y - u[b, t + 1]).pow(2).sum()
                    if teach is None
                    else (y * teach[b, t]).sum()
                )
                g13, g2 = torch.autograd.grad(inner, (p13, p2))
                norm = torch.sqrt(g13.pow(2).sum() + g2.pow(2).sum())
                clip = min(1.0, d**0.5 / norm.item())
                u_sq = u[b, t].pow(2).sum().clamp_min(NORM_EPS)
                a_sq = (F.silu(gate) * up).pow(2).sum().detach()
                acc13 = acc13 + clip * rates[b, t] / u_sq * g13
                if level.step_norm == "input":
                    acc2 = acc2 + clip * rates[b, t] / u_sq * g2
                elif level.step_norm == "own":
                    acc2 = acc2 + clip * rates[b, t] / (a_sq + NORM_EPS) * g2
                else:  # split: the period's tokens at the period-start weights
                    gates, ups = F.linear(u[b, t // c * c :][:c], w13).chunk(2, dim=-1)
                    a_mean = (F.silu(gates) * ups).pow(2).sum(-1).mean()
                    acc2 = acc2 + clip * rates2[b, t] / (a_sq + a_mean + NORM_EPS) * g2
        outs.append(torch.stack(rows))
    return torch.stack(outs)


@pytest.mark.parametrize(
    "seq, rate, update, periods, norm",
    [
        (24, "learned", "association", ["0", "16", "4"], "input"),
        (80, "learned", "association", ["0", "16", "4"], "input"),  # 80 > d_model: folded
        (24, "constant", "association", ["0", "16", "4"], "input"),
        (24, "learned", "teach", ["0", "16", "4"], "input"),
        (40, "learned", "association", ["0", "1", "3"], "input"),  # period 1: token by token
        (40, "learned", "teach", ["0", "1", "3"], "input"),
        (80, "learned", "association", ["0", "16", "4"], "own"),
        (40, "learned", "teach", ["0", "1", "3"], "own"),
        (80, "learned", "association", ["0", "16", "4"], "split"),
        (24, "constant", "association", ["0", "16", "4"], "split"),
        (40, "learned", "teach", ["0", "1", "3"], "split"),
    ],
)
def test_cms_level_equals_plain_reference(seq, rate, update, periods, norm):
    cfg = tiny_cfg(
        "hope_attention",
        *("--model.seq_len", str(seq), "--model.hope.rate", rate, "--model.hope.update", update),
        *("--model.hope.step_norm", norm),
        *("--model.hope.periods", *periods),
    )
    cms = build_model(cfg).layers[0].mlp
    d = cfg.model.d_model
    gen = torch.Generator().manual_seed(3)
    u = F.rms_norm(torch.randn(2, seq, d, generator=gen), (d,))
    teach = torch.randn(2, seq, d, generator=gen) if update == "teach" else None
    for level in cms.levels[1:]:
        with torch.no_grad():
            got = level.forward_updating(u, cms.eta, teach)
            rates = level.rates(u, cms.eta)
        if rate == "learned":  # data-dependent: different per token
            assert rates.std() > 0.01 * rates.mean()
        ref = _reference_level(level, u, cms.eta, teach)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "teach, norm, final, shared",
    [
        (False, "split", True, True),
        (False, "split", False, False),
        (False, "input", False, True),
        (False, "own", True, False),
        (True, "split", False, True),
        (True, "own", True, True),
        (True, "input", True, False),
    ],
)
def test_window_backward_equals_numerical_gradients(teach, norm, final, shared, monkeypatch):
    """The hand-written backward of one window (``_UpdatingWindow``) against fp64 finite
    differences of its forward: outputs and, unless final, the ``W_13`` factors and the folded
    ``W_2``, w.r.t. every input (level inputs, pre-activations, shared or per-sequence ``W_2``,
    targets, rates, norms), second-order terms included; inner gradients clipped for some
    tokens and not for others."""
    from tapered_megatron.models.hope import window
    from tapered_megatron.models.hope.window import _scales, _UpdatingWindow, _WindowSpec

    gen = torch.Generator().manual_seed(5)
    bsz, d, h, c = 2, 4, 3, 3
    n = 11 if final else 12  # a final window may end in a short period

    def rand(*shape, scale=1.0):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return x.requires_grad_()

    batch = () if shared else (bsz,)
    xw, w2 = rand(bsz, n, d), rand(*batch, d, h)
    gv = (xw @ rand(2 * h, d, scale=0.7).mT).detach().requires_grad_()
    tgt = rand(bsz, n - final, d).detach().requires_grad_(not teach)
    r13, r2 = (torch.rand(bsz, n, generator=gen, dtype=torch.float64) for _ in range(2))
    xsq = torch.rand(bsz, n, generator=gen, dtype=torch.float64) * 2
    inputs = (xw, gv, w2, tgt, r13.requires_grad_(), r2.requires_grad_(), xsq.requires_grad_())
    spec = _WindowSpec(c, norm, teach, final, False, 0, None)
    clipped = []

    def scales(*args):  # records which tokens' inner gradients the forward clips
        out = _scales(*args)
        clipped.append(out[0].detach() >= 1)
        return out

    with monkeypatch.context() as patch:
        patch.setattr(window, "_scales", scales)
        _UpdatingWindow.apply(spec, *inputs)
    share = torch.cat([x.flatten() for x in clipped]).double().mean()
    assert 0.1 < share < 0.9, share  # both branches of the clip are exercised
    assert torch.autograd.gradcheck(lambda *x: _UpdatingWindow.apply(spec, *x), inputs)


@pytest.mark.parametrize("norm", ["split", "input"])
def test_updating_level_gradients_across_fold_windows(norm, monkeypatch):
    """A whole updating level over several fold windows (later windows apply the earlier ones'
    ``W_13`` factors in dual form and start from the folded per-sequence ``W_2``; the last
    window ends in a period without update) against fp64 finite differences: the output's
    gradients w.r.t. the level's input, its three matrices and its rate gates."""
    from tapered_megatron.models.hope import modules

    monkeypatch.setattr(modules, "fold_window", lambda d, h, c, seq: 2 * c)  # windows of 6 tokens
    cfg = tiny_cfg(
        "hope_attention",
        *("--model.d_model", "8", "--model.seq_len", "14", "--taper.schedule", "uniform"),
        *("--model.hope.periods", "0", "3", "3", "--model.hope.step_norm", norm),
        *("--model.hope.w2_rate_init", "0.3"),  # W_2's updates large enough to matter
    )
    cms = build_model(cfg).layers[0].mlp.double()
    level, eta = cms.levels[1], cms.eta
    gates = {"rate_w", "rate_b", "w2_rate_w", "w2_rate_b"} if norm == "split" else set()
    assert {"rate_w", "rate_b"} | gates <= {n for n, _ in level.named_parameters()}
    gen = torch.Generator().manual_seed(7)
    u = F.rms_norm(torch.randn(2, 14, 8, generator=gen, dtype=torch.float64), (8,))
    record: list[int] = []
    with torch.no_grad():
        level.forward_updating(u, eta, record=record)
    assert record == [3, 6, 9, 12]  # updates at every boundary, in all three windows
    # gradcheck perturbs its inputs in place: passing the level's own parameters perturbs them
    params = tuple(level.parameters())
    assert torch.autograd.gradcheck(
        lambda u, *_: level.forward_updating(u, eta), (u.requires_grad_(), *params)
    )


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--model.hope.update", "teach"],
        ["--model.hope.rate", "constant"],
        ["--model.hope.step_norm", "own"],
        ["--model.hope.step_norm", "split"],
    ],
)
def test_causal_across_period_boundaries(overrides):
    cfg = tiny_cfg("hope_attention", *overrides)
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
        # two rate gates (W_13's and, with step_norm split, W_2's) per updating level
        gates = sum(lv.updating for lv in cms.levels) * 2 * (d + 1)
        assert gates == 4 * (d + 1)
        matrices = [p for n, p in cms.named_parameters() if "rate" not in n.split(".")[-1]]
        assert sum(p.numel() for p in matrices) == 3 * d * width
        assert sum(p.numel() for p in cms.parameters()) == 3 * d * width + gates
    ref = count_model(cfg.with_overrides(["--model.arch", "transformer"]))
    layers = cfg.model.layers
    assert count_model(cfg).params_total == ref.params_total + layers * 4 * (d + 1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    from tapered_megatron.models import lm_loss

    lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    for level in model.layers[0].mlp.levels:
        assert level.w13.weight.grad.abs().sum() > 0 and level.w2.weight.grad.abs().sum() > 0
        if level.updating:
            for gate in (level.rate_w, level.rate_b, level.w2_rate_w, level.w2_rate_b):
                assert gate.grad.abs().sum() > 0
    assert level_widths(96, 3, 16) == [32, 32, 32] and level_widths(112, 3, 16) == [48, 32, 32]
    with pytest.raises(ValueError, match=r"hope\.levels"):
        level_widths(32, 3, 16)


@pytest.mark.parametrize(("d", "spread"), [(64, 0.0), (64, 4.8), (256, 4.8), (1024, 4.8)])
def test_w2_gate_spread_sets_the_least_init_spread_of_the_gate_logit(d, spread):
    """``hope.w2_gate_spread``: over RMS-normalised inputs the initial logit of ``W_2``'s gate has
    a std of at least the spread (the weights' own init_std where that is wider already), and
    ``W_13``'s gate keeps ``init_std``."""
    cfg = tiny_cfg(
        "hope_attention", "--model.d_model", str(d), "--model.hope.w2_gate_spread", str(spread)
    )
    model = build_model(cfg)
    levels = [lv for block in model.layers for lv in block.mlp.levels if lv.updating]
    assert len(levels) == 4
    u = torch.randn(4096, d, generator=torch.Generator().manual_seed(0))
    u = u / u.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 1: ||u||^2 = d
    with torch.no_grad():  # pooled over the four gates (4 d weights: a few % sampling noise)
        logits = torch.cat([W2_GATE_GAIN * (u @ lv.w2_rate_w + lv.w2_rate_b) for lv in levels])
        w13 = torch.cat([lv.rate_w for lv in levels])
    natural = W2_GATE_GAIN * cfg.model.init_std * d**0.5  # the spread init_std alone gives
    assert logits.std().item() == pytest.approx(max(spread, natural), rel=0.12)
    assert w13.pow(2).mean().sqrt().item() == pytest.approx(cfg.model.init_std, rel=0.12)


def test_loss_decreases_on_real_text():
    assert_learns_real_text("hope_attention", 192)


def test_teach_signal_is_the_per_token_loss_gradient():
    """The first pass gives every CMS the gradient of each token's next-token cross-entropy
    w.r.t. the normalised final hidden state of the static model, over the RMS head weight."""
    from tapered_megatron.models.hope import teach_pass

    cfg = tiny_cfg("hope_attention", "--model.hope.update", "teach")
    model = build_model(cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    teach_pass(model, ids)
    signal = model.layers[0].mlp.teach_signal
    assert all(block.mlp.teach_signal is signal for block in model.layers)
    static = build_model(cfg.with_overrides(["--model.hope.lr", "0"]))  # same weights, no updates
    with torch.no_grad():
        h = static.embedding(ids)
        for block in static.layers:
            h = block(h)
    x = static.head.norm(h).requires_grad_()
    w = static.head.proj.weight.detach()
    ce = F.cross_entropy((x @ w.T)[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    (grad,) = torch.autograd.grad(ce, x)
    grad[:, -1] = 0
    torch.testing.assert_close(signal, grad / w.pow(2).mean().sqrt(), rtol=1e-4, atol=1e-6)
    assert signal[:, :-1].norm(dim=-1).min() > 0


def test_bf16_autocast_updates_match_fp64_at_4096():
    """Under bf16 autocast the updating levels compute in fp32 (see docs/memory_architectures.md):
    with the ``W_2`` gates half open (a trained model's regime; at init they start at 1e-5) the CMS
    output over 4096 tokens stays within 1 % of fp64 (measured 0.31 %; the updates move it by 10 %).
    Run in bf16 the levels were 1.27 % off."""
    seq, d = 4096, 128
    cfg = tiny_cfg(
        "hope_attention",
        *("--model.d_model", str(d), "--model.d_ff", "384", "--model.seq_len", str(seq)),
    )
    torch.manual_seed(0)
    cms = ContinuumMemory(cfg, 0)
    init_parameters(cms, 0, "layers.0.mlp.")
    with torch.no_grad():
        for level in cms.levels:
            if level.w2_rate_b is not None:
                level.w2_rate_b.zero_()
    u = F.rms_norm(torch.randn(1, seq, d, generator=torch.Generator().manual_seed(1)), (d,))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = cms(u)
        cms.double()
        high = cms(u.double())
        cms.eta = 0.0
        static = cms(u.double())
    assert low.dtype == torch.bfloat16
    err = ((low.double() - high).norm() / high.norm()).item()
    effect = ((high - static).norm() / high.norm()).item()
    print(f"hope bf16 autocast vs fp64 at {seq}: {err:.4f}; the updates' effect {effect:.4f}")
    assert err <= 0.01 and effect > 2 * err


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cms_keeps_what_its_counts_say(dtype, recompute, monkeypatch):
    """On real tensors over several fold windows, the bytes a CMS slot's forward leaves alive
    for backward (its output and the weights excepted) are its counted activations within 5 %:
    no copy of the earlier windows' factors, no wider copy of a bf16 weight; under selective
    recompute those less its core (the windows' inputs stay: no fp32 copy of the targets, no
    whole-sequence product kept for the first window's slice of it)."""
    from tapered_megatron.models.hope import modules
    from tapered_megatron.planning.fake_world import LiveBytes

    monkeypatch.setattr(modules, "fold_window", lambda d, h, c, seq: 32)
    cfg = tiny_cfg(
        "hope_attention",
        *("--model.d_model", "64", "--model.d_ff", "192", "--model.seq_len", "128"),
        *("--taper.schedule", "uniform", "--model.hope.periods", "0", "16", "8"),
        *("--train.recompute", recompute),
    )
    cms = build_model(cfg).layers[0].mlp.to(dtype)
    u = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    live = LiveBytes()
    with live:
        live.log = []
        y = cms(u.requires_grad_())
    weights = {id(p.untyped_storage()) for p in cms.parameters()}
    made = [(r, n) for r, n in live.log if r() is not y.untyped_storage()]
    kept = LiveBytes.alive([(r, n) for r, n in made if id(r()) not in weights])
    c = ContinuumMemory.counts(cfg, 0, dtype.itemsize)
    per_token = c.act_bytes - (c.core_bytes if recompute == "selective" else 0)
    assert kept == pytest.approx(per_token * u.shape[:2].numel(), rel=0.05)
