"""Overlapped data-parallel communication: the shipped ZeRO-2 config (``overlap_comm: true``)
trains two real ranks to the losses and gradient norms of the same config with
``overlap_comm: false``, with two micro-batches per step (ZeRO-2 reduces each one)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from launch_helpers import ROOT, grad_norms, launch_ranks, losses

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_zero2_overlap_equals_no_overlap(corpus, tmp_path):
    shipped = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    assert shipped["zero_optimization"]["overlap_comm"] is True
    plain = json.loads(json.dumps(shipped))
    plain["zero_optimization"]["overlap_comm"] = False
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    extra = ["--train.micro_batch_size", "2", "--train.iters", "10", "--logging.interval", "1"]
    runs = {}
    for name, ds in (("overlap", "zero2.json"), ("plain", str(tmp_path / "plain.json"))):
        out = tmp_path / name
        out.mkdir()
        launch_ranks(2, corpus, out, ds, extra)
        runs[name] = (losses(out), grad_norms(out))
    (got, got_norms), (want, want_norms) = runs["overlap"], runs["plain"]
    assert len(got) == len(want) == 10
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-6, atol=0)
