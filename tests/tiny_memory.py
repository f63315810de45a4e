"""Shared by the memory-architecture tests (Titans, Hope): a tiny model config that runs at TP=1
and TP=2 alike, and a causality check."""

from __future__ import annotations

import torch

from tapered_megatron.config import load_config


def tiny_cfg(arch: str, *overrides: str):
    """A tiny model (2 layers, d_model 32, 2 heads, seq 32, byte vocabulary) valid at TP=2.

    The model's shape does not depend on ``parallel.tp``, so the same config (hence the same
    widths and weights) runs at TP=1 in a single process and at TP=2 in two.
    """
    own = {
        "titans": [
            "--model.titans.chunk_size", "4",
            "--model.titans.window", "8",
            "--model.titans.conv_size", "3",
        ],
        "hope_attention": ["--model.hope.periods", "0", "16", "4", "--model.hope.lr", "0.5"],
    }  # fmt: skip
    cfg = load_config(
        "quickstart",
        [
            "--model.arch", arch,
            "--model.d_model", "32",
            "--model.layers", "2",
            "--model.heads", "2",
            "--model.d_ff", "96",
            "--model.vocab_size", "256",
            "--model.make_vocab_size_divisible_by", "64",
            "--model.seq_len", "32",
            *own.get(arch, []),
            "--taper.multiple", "8",
            "--parallel.tp", "2",
        ],
    )  # fmt: skip
    return cfg.with_overrides(list(overrides)) if overrides else cfg


def assert_causal(model, vocab: int, seq: int, cut_points: list[int]) -> None:
    """Changing tokens after ``t`` leaves every output at ``<= t`` unchanged."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    with torch.no_grad():
        base = model(ids)
        for t in cut_points:
            other = ids.clone()
            other[:, t + 1 :] = torch.randint(0, vocab, (2, seq - t - 1), generator=g)
            out = model(other)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


def assert_learns_real_text(arch: str, d_ff: int, steps: int = 40) -> None:
    """``arch``'s tiny model trained ``steps`` steps on real text: the mean loss of the last five
    steps is at least 0.5 nats below the first five's and 0.3 below the unigram baseline."""
    from real_text import assert_beats_unigram, train_losses

    cfg = tiny_cfg(arch, "--model.d_model", "64", "--model.d_ff", str(d_ff))
    losses = train_losses(cfg, steps, text_bytes=200_000)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"{arch} loss {first:.3f} -> {last:.3f}")
    assert last < first - 0.5
    assert_beats_unigram(losses, 200_000)
