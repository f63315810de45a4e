"""Random streams: the CPU and the accelerator generator are seeded, forked and checkpointed
together; replicated regions draw the same dropout masks on every TP rank, TP-local ones differ.
(A run with dropout resuming bitwise: ``test_faults.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model
from tapered_megatron.parallel import init_model_parallel
from tapered_megatron.parallel import random as rnd
from tapered_megatron.parallel.local_launch import run_workers
from tapered_megatron.parallel.random import (
    get_rng_state,
    get_rng_tracker,
    model_parallel_seed,
    set_rng_state,
)

ROOT = Path(__file__).resolve().parents[1]


class FakeAccelerator:
    """An accelerator whose generator is its own ``torch.Generator``, as a GPU's is (the CPU
    accelerator's generator is the CPU one, so it cannot tell the two apart)."""

    def __init__(self) -> None:
        self.gen = torch.Generator()

    def device_name(self, device_index: int | None = None) -> str:
        return "fake"

    def manual_seed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self.gen.get_state()

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        self.gen.set_state(state)

    def draw(self) -> torch.Tensor:
        """What a dropout kernel on this device would consume."""
        return torch.rand(16, generator=self.gen)


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeAccelerator]:
    """A :class:`FakeAccelerator` where ``parallel/random.py`` reads the accelerator; the CPU
    generator and the tracker are put back afterwards."""
    acc = FakeAccelerator()
    monkeypatch.setattr(rnd, "get_accelerator", lambda: acc)
    cpu, tracker = torch.get_rng_state(), get_rng_tracker().get_states()
    yield acc
    torch.set_rng_state(cpu)
    get_rng_tracker().states = tracker


def _seed_as_tp_rank(monkeypatch, tp_rank: int, seed: int = 7) -> None:
    monkeypatch.setattr(rnd, "get_tensor_model_parallel_rank", lambda: tp_rank)
    model_parallel_seed(seed)


def test_accelerator_stream_is_seeded_on_tp_ranks_alike_and_forked(fake, monkeypatch):
    seen = {}
    for tp_rank in (0, 1):
        fake.gen.manual_seed(1000 + tp_rank)  # whatever the device generator held before
        _seed_as_tp_rank(monkeypatch, tp_rank)
        default = fake.get_rng_state()
        with get_rng_tracker().fork():
            forked = fake.draw()
            forked_cpu = torch.rand(4)
        assert torch.equal(fake.get_rng_state(), default), "fork() must restore the device stream"
        with get_rng_tracker().fork():  # the TP stream continues where it stopped
            assert not torch.equal(fake.draw(), forked)
        seen[tp_rank] = (default, forked, forked_cpu, fake.draw(), torch.rand(4))
    (d0, f0, fc0, r0, c0), (d1, f1, fc1, r1, c1) = seen[0], seen[1]
    # the default streams: seeded by the run seed, the same on the TP ranks of a stage
    assert torch.equal(d0, torch.Generator().manual_seed(7).get_state())
    assert torch.equal(d0, d1) and torch.equal(r0, r1) and torch.equal(c0, c1)
    # the TP-local stream: different on each TP rank, on the device and on the CPU
    assert not torch.equal(f0, f1) and not torch.equal(fc0, fc1)


def test_checkpointed_state_holds_both_generators(fake, monkeypatch):
    _seed_as_tp_rank(monkeypatch, 1)
    fake.draw()
    saved = get_rng_state()
    assert set(saved) == {"python", "numpy", "torch", "accelerator", "tracker"}
    with get_rng_tracker().fork():
        expect_forked = (fake.draw(), torch.rand(3))
    expect = (fake.draw(), torch.rand(3))
    set_rng_state(saved)
    with get_rng_tracker().fork():
        got_forked = (fake.draw(), torch.rand(3))
    got = (fake.draw(), torch.rand(3))
    for a, b in zip((*expect_forked, *expect), (*got_forked, *got)):
        assert torch.equal(a, b)


def test_state_without_accelerator_entries_still_loads(fake, monkeypatch):
    """A checkpoint written on a CPU, or before accelerator states were kept: the CPU streams
    are restored, the accelerator's keep what ``model_parallel_seed`` gave them."""
    _seed_as_tp_rank(monkeypatch, 0)
    old = get_rng_state()
    old.pop("accelerator")
    old["tracker"] = {k: v["cpu"] for k, v in old["tracker"].items()}  # bare CPU states
    cpu_next = torch.rand(3)
    with get_rng_tracker().fork():
        forked_cpu = torch.rand(3)
    _seed_as_tp_rank(monkeypatch, 0)
    seeded = fake.get_rng_state()
    with get_rng_tracker().fork():
        forked_dev = fake.draw()
    _seed_as_tp_rank(monkeypatch, 0)
    torch.rand(5)  # move the CPU streams on, then load the old state
    with get_rng_tracker().fork():
        torch.rand(5)
    set_rng_state(old)
    assert torch.equal(torch.rand(3), cpu_next) and torch.equal(fake.get_rng_state(), seeded)
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(3), forked_cpu) and torch.equal(fake.draw(), forked_dev)


@pytest.mark.distributed
def test_tp2_replicated_masks_equal_tp_local_masks_differ():
    """scripts/check_rng_streams.py: two real TP ranks draw dropout masks on the CPU."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_rng_streams.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert line, proc.stdout + proc.stderr
    got = json.loads(line[-1])
    assert got == {
        "check": "rng_streams",
        "device": "cpu",
        "replicated_equal": True,
        "tp_local_differ": True,
        "ok": True,
    }
    assert proc.returncode == 0


DROPOUT = [
    "--model.d_model", "64", "--model.layers", "2", "--model.heads", "4", "--model.d_ff", "128",
    "--model.vocab_size", "200", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "16", "--taper.multiple", "8", "--parallel.tp", "2", "--model.dropout", "0.3",
]  # fmt: skip


def _dropout_losses() -> tuple[float, float, float]:
    """Two training-mode losses (a new mask each) and the eval-mode loss of the tiny model."""
    cfg = load_config("quickstart", DROPOUT)
    model_parallel_seed(cfg.train.seed)
    model = build_model(cfg).train()
    ids = torch.randint(
        0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )
    first, second = model(ids, ids).item(), model(ids, ids).item()
    return first, second, model.eval()(ids, ids).item()


def _dropout_worker(rank: int, world: int) -> tuple[float, float, float]:
    init_model_parallel(tp=world, pp=1)
    return _dropout_losses()


@pytest.mark.distributed
def test_tp2_model_with_dropout_equals_one_process():
    """The model's dropout (on each block's replicated output) draws the same masks on both TP
    ranks as one process does: TP2 training-mode losses equal the TP1 ones."""
    ref = _dropout_losses()
    assert ref[0] != ref[1] and ref[0] != ref[2]  # dropout is on, a new mask each pass
    for got in run_workers(_dropout_worker, 2):
        assert got == pytest.approx(ref, rel=1e-5, abs=0)
