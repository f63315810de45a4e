"""Loss decreases over a few dozen AdamW steps on real English text (byte-level, one process)."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample" / "corpus.jsonl.gz"


def english_bytes(limit: int = 300_000) -> torch.Tensor:
    """Bytes of the repo's sample corpus if present, else of Python's own LICENSE text."""
    if SAMPLE.exists():
        texts, size = [], 0
        with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
            for line in f:
                texts.append(json.loads(line)["text"])
                size += len(texts[-1])
                if size >= limit:
                    break
        data = "\n".join(texts).encode()
    else:
        data = (
            Path(sys.prefix)
            / "lib"
            / f"python{sys.version_info[0]}.{sys.version_info[1]}"
            / "LICENSE.txt"
        ).read_bytes()
    return torch.frombuffer(bytearray(data[:limit]), dtype=torch.uint8).long()


@pytest.mark.parametrize("arch", ["transformer", "gated_attention"])
def test_loss_decreases_on_real_text(arch):
    torch.manual_seed(0)
    cfg = load_config(
        "quickstart",
        ["--model.arch", arch, "--model.d_model", "64", "--model.layers", "2", "--model.heads", "4",
         "--model.d_ff", "128", "--model.vocab_size", "256", "--model.seq_len", "64",
         "--taper.multiple", "8"],
    )  # fmt: skip
    data = english_bytes()
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    seq, losses = cfg.model.seq_len, []
    for _ in range(40):
        starts = torch.randint(0, len(data) - seq - 1, (16,), generator=g)
        batch = torch.stack([data[s : s + seq + 1] for s in starts])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = losses[0], sum(losses[-5:]) / 5
    assert abs(first - math.log(256)) < 0.3
    assert last < first - 2.0, losses
