"""Loss decreases over a few dozen AdamW steps on real English text (byte-level, one process),
below what a model that ignores its input (a unigram model) reaches."""

from __future__ import annotations

import math

import pytest
from real_text import assert_beats_unigram, train_losses

from tapered_megatron.config import load_config


@pytest.mark.parametrize("arch", ["transformer", "gated_attention"])
def test_loss_decreases_on_real_text(arch):
    cfg = load_config(
        "quickstart",
        ["--model.arch", arch, "--model.d_model", "64", "--model.layers", "2", "--model.heads", "4",
         "--model.d_ff", "128", "--model.vocab_size", "256", "--model.seq_len", "64",
         "--taper.multiple", "8"],
    )  # fmt: skip
    losses = train_losses(cfg, steps=40, batch=16, clip=None, text_bytes=300_000)
    first, last = losses[0], sum(losses[-5:]) / 5
    assert abs(first - math.log(256)) < 0.3
    assert last < first - 2.0, losses
    assert_beats_unigram(losses, 300_000)
