"""In-context memory at the default config of each preset shape: on structured input (a block of
key/value pairs repeated), the in-context updates change the output of the memory module by a
stated amount (Titans: relative to the mixer output without updates; Hope: relative to the CMS
input, since the static CMS output of a fresh model is small), and the memory's recall error
falls from one repetition to the next (Hope: only slightly at init, see its test).

Titans: the memory branch (``NeuralMemory``) of one mixer and the whole mixer; recall error =
``||M_{t-1}(k_t) - v_t||^2 / ||v_t||^2`` with the mixer's own keys and values. Hope-attention:
the CMS of one layer; recall error of its fastest level = ``||f_{W_t}(u_t) - u_{t+1}||^2 /
||u_{t+1}||^2`` (its association objective: the value after each key, the next key after each
value). Both from freshly initialised modules (what training starts from), fp32, no grad.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tapered_megatron.config import load_config
from tapered_megatron.models import in_context_memory
from tapered_megatron.models.hope import ContinuumMemory
from tapered_megatron.models.titans import TitansMixer, memory_scan
from tapered_megatron.parallel import init_parameters

PAIRS = 16  # key/value pairs per block; the block (2 * PAIRS tokens) repeats REPEATS times
REPEATS = 6
FAST = ["quickstart", "440m"]  # shapes run by default; the larger ones are marked slow
SLOW = ["760m", "1.3b", "7b"]
SHAPES = FAST + [pytest.param(s, marks=pytest.mark.slow) for s in SLOW]


def _cfg(arch: str, shape: str):
    preset = "quickstart" if shape == "quickstart" else f"{arch}_{shape}"
    # Hope's association rule (the presets' teach signal needs the whole model's first pass)
    own = ["--model.hope.update", "association"] if arch == "hope_attention" else []
    over = ["--model.arch", arch, "--model.seq_len", str(2 * PAIRS * REPEATS), *own]
    return load_config(preset, over)


def _structured(d: int, batch: int = 2) -> torch.Tensor:
    """RMS-normalised random key/value vectors, the same block of pairs repeated."""
    g = torch.Generator().manual_seed(0)
    block = F.rms_norm(torch.randn(batch, 2 * PAIRS, d, generator=g), (d,))
    return block.repeat(1, REPEATS, 1)


def _per_repeat(err: torch.Tensor) -> list[float]:
    """Mean of a per-token [B, S] error over each repetition of the block."""
    return [round(x, 4) for x in err.unflatten(1, (REPEATS, -1)).mean(dim=(0, 2)).tolist()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_titans_memory_moves_the_mixer_and_recalls(shape):
    cfg = _cfg("titans", shape)
    torch.manual_seed(0)
    mixer = TitansMixer(cfg, 0)
    init_parameters(mixer, cfg.train.seed, "layers.0.mixer.")
    mem = mixer.memory
    x = _structured(cfg.model.d_model)
    heads = mem.local_heads
    with torch.no_grad():
        _, k, v, _ = mem.project(x)
        theta, eta, alpha = mem.gate_values(x)
        k_next = F.pad(k[:, :, 1:], (0, 0, 0, 1))
        pred, _ = memory_scan(k_next, k, v, theta, eta, alpha, list(mem.memory), mem.chunk_size)
        err = ((pred - v.roll(-1, 2)).pow(2).sum(-1) / v.roll(-1, 2).pow(2).sum(-1))[..., :-1]
        recall = _per_repeat(F.pad(err, (0, 1), value=err[..., -1:].mean().item()).mean(1))
        on = mixer(x)
        mem.gate_bias[:heads] = -30.0  # theta ~ 1e-13: the memory stays at its initial weights
        off = mixer(x)
    change = _rel(on, off)
    print(f"titans {shape}: mixer output change {change:.3f}, recall error per repeat {recall}")
    assert change > 0.2  # measured 0.35-0.38 at every preset shape
    # measured 1.68 -> 0.69 (quickstart), 1.10 -> 0.29 (440m), 1.00 -> 0.47 (7b; titans.gate_std)
    assert recall[-1] < 0.6 * recall[0]
    assert all(b <= a * 1.02 for a, b in itertools.pairwise(recall))


def _hope_cms(shape: str, *overrides: str) -> tuple[float, list[float]]:
    """A fresh CMS of layer 0 on the structured input: the change of its output by the
    in-context updates (relative to its input) and its fastest level's recall error per repeat."""
    cfg = _cfg("hope_attention", shape).with_overrides(list(overrides))
    torch.manual_seed(0)
    cms = ContinuumMemory(cfg, 0)
    init_parameters(cms, cfg.train.seed, "layers.0.mlp.")
    u = _structured(cfg.model.d_model)
    fast = max(
        range(len(cms.levels)), key=lambda i: (cms.levels[i].updating, -cms.levels[i].period)
    )
    with torch.no_grad():
        level = cms.levels[fast]
        lin = u
        for lv in cms.levels[:fast]:  # the fastest level's input
            lin = lin + (lv.forward_updating(lin, cms.eta) if lv.updating else lv(lin))
        out = level.forward_updating(lin, cms.eta)
        err = (out[:, :-1] - lin[:, 1:]).pow(2).sum(-1) / lin[:, 1:].pow(2).sum(-1)
        recall = _per_repeat(F.pad(err, (0, 1), value=err[:, -1:].mean().item()))
        on = cms(u)
        with in_context_memory(cms, False):
            off = cms(u)
    change = ((on - off).norm() / u.norm()).item()  # the static CMS output is small at init
    print(f"hope {shape} {list(overrides)}: CMS output change / input {change:.5f}, recall error "
          f"per repeat {recall}")  # fmt: skip
    return change, recall


@pytest.mark.parametrize("shape", FAST)
def test_hope_cms_update_rule_recalls_in_context(shape):
    """The CMS update rule itself, with W_2's gate open (``hope.w2_rate_init`` 0.5): the
    repeated pairs are recalled at least 10 % better by the last repeat (measured 1.003 -> 0.720
    at quickstart, 1.0005 -> 0.831 at 440m); without updates the error stays flat."""
    change, recall = _hope_cms(shape, "--model.hope.w2_rate_init", "0.5")
    assert change > 1e-4
    assert recall[-1] < 0.9 * recall[0]


@pytest.mark.xfail(
    strict=True,
    reason="at the defaults (W_2's gate at 1e-5) a fresh CMS moves by 0.0056 (quickstart) and "
    "0.014 (440m) of its input and recalls 1.0001 -> 0.9992, 1.0005 -> 0.9934: the updates "
    "start small on purpose; whether a trained model uses them is the memory probe's question "
    "(tests/test_memory_probe.py)",
)
@pytest.mark.parametrize("shape", SHAPES)
def test_hope_cms_moves_the_block_and_recalls(shape):
    """At the default config the in-context updates matter from the start: the repeated pairs
    are recalled at least 10 % better by the last repeat."""
    change, recall = _hope_cms(shape)
    assert change > 1e-5
    assert recall[-1] < 0.9 * recall[0]
