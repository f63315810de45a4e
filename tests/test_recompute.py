"""Activation recomputation (``train.recompute``): ``selective`` and ``full`` give gradients
bitwise equal to ``none`` (fp32) for every architecture (and grouped-query attention), with
dropout, in one process and on two tensor-parallel ranks (with and without sequence
parallelism); ``selective`` runs each module's core
again in backward (and only the cores); the recomputation replays the tracker's TP-local stream;
the ``train.checkpoint_activations`` alias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from arch_args import for_arch

from tapered_megatron.architectures import ARCHITECTURES
from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.models import base as model_base
from tapered_megatron.models import build_model
from tapered_megatron.parallel import get_rng_tracker, init_model_parallel, model_parallel_seed
from tapered_megatron.parallel.local_launch import run_workers
from tapered_megatron.parallel.random import recompute

TINY = [
    "--model.d_model", "64", "--model.layers", "2", "--model.heads", "4", "--model.d_ff", "128",
    "--model.vocab_size", "256", "--model.seq_len", "16", "--taper.multiple", "8",
    "--model.titans.chunk_size", "4", "--model.titans.window", "8",
    "--model.hope.levels", "2", "--model.hope.periods", "0", "4", "--model.dropout", "0.1",
]  # fmt: skip
CASES = {arch: (arch, []) for arch in sorted(ARCHITECTURES)} | {
    "titans_mac": ("titans", ["--model.titans.variant", "mac"]),
    "gqa": ("gated_attention", ["--model.kv_heads", "2"]),
}
#: Selectively recomputed cores per layer of the tiny model: the attention core; Titans' scan
#: and its windowed attention (MAC: both per segment, two segments of 8 tokens); Hope's attention
#: core and one window of its updating CMS level.
CORES = {
    "transformer": 1, "gated_attention": 1, "gqa": 1, "titans": 2, "titans_mac": 4,
    "hope_attention": 2,
}  # fmt: skip


def _cfg(case: str, mode: str, *extra: str):
    arch, own = CASES[case]
    return load_config(
        "quickstart", [*for_arch(arch, TINY), *own, "--train.recompute", mode, *extra]
    )


def _step(cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one forward + backward, dropout drawn from a fixed seed."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg).train()
    torch.manual_seed(5)
    loss = model(ids, ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_equal(got: tuple, want: tuple, what: str) -> None:
    assert torch.equal(got[0], want[0]), f"{what}: loss {got[0]} != {want[0]}"
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        assert g is not None and torch.equal(got[1][name], g), f"{what}: gradient of {name}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_recompute_gradients_equal_none(case, monkeypatch):
    """``selective`` and ``full``: loss and every gradient bitwise equal to ``none``; under
    ``selective`` each core runs twice (forward, backward) and only the cores are recomputed."""
    runs: list[int] = []

    def counting(fn, *args):
        def run(*a):
            runs.append(1)
            return fn(*a)

        calls.append(1)
        return recompute(run, *args)

    calls: list[int] = []
    monkeypatch.setattr(model_base, "recompute", counting)
    want = _step(_cfg(case, "none"))
    assert not calls
    got = _step(_cfg(case, "selective"))
    assert len(calls) == 2 * CORES[case], "one checkpointed core per core per layer"
    assert len(runs) == 2 * len(calls), "each core runs again in backward"
    _assert_equal(got, want, f"{case} selective")
    _assert_equal(_step(_cfg(case, "full")), want, f"{case} full")


def test_selective_hope_records_its_updates_once():
    """Hope's ``record_updates`` (positions at which a level's weights change) after a
    selective forward + backward: those of ``none``, not doubled by the recomputed windows."""
    from tapered_megatron.models.hope.modules import ContinuumMemory

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    for mode in ("none", "selective"):
        model = build_model(_cfg("hope_attention", mode)).train()
        cms = [m for m in model.modules() if isinstance(m, ContinuumMemory)]
        for m in cms:
            m.record_updates = True
        model(ids, ids).backward()
        seen.append([m.last_updates for m in cms])
    assert seen[0] == seen[1] and any(any(u) for u in seen[0])


def test_selective_titans_tallies_its_memory_clip_once():
    """Titans' ``memory_clip`` tally (clipped and all token-heads) after a selective forward +
    backward: that of ``none``, not doubled by the recomputed scan (recomputed whole: torch's
    early stop, which ends a recomputation at its last saved tensor, off)."""
    from tapered_megatron.models.titans.modules import NeuralMemory

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    for mode in ("none", "selective"):
        model = build_model(_cfg("titans", mode, "--model.titans.memory_clip", "0.05")).train()
        torch.manual_seed(5)  # the same dropout masks
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            model(ids, ids).backward()
        seen.append([m.clip_tally[0] for m in model.modules() if isinstance(m, NeuralMemory)])
    assert seen[0] and all(torch.equal(a, b) for a, b in zip(*seen, strict=True))
    assert all(0 < t[0] < t[1] for t in seen[0])  # the clip scaled some token-heads, not all


def _tracker_dropout_grads(replay: bool) -> torch.Tensor:
    model_parallel_seed(11)
    w = torch.ones(64, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork():
            return F.dropout(x * w, 0.5, training=True)

    x = torch.arange(64.0)
    y = recompute(fn, x) if replay else fn(x)
    (y * y).sum().backward()
    return w.grad


def test_recompute_replays_the_tracker_stream():
    """Dropout under the TP-local stream inside a recomputed function draws the forward's mask
    again in backward (its stream is advanced once, as without recomputation)."""
    plain = _tracker_dropout_grads(False)
    stream = "tensor-model-parallel-rng"
    after = get_rng_tracker().get_states()[stream]
    assert torch.equal(_tracker_dropout_grads(True), plain)
    now = get_rng_tracker().get_states()[stream]
    assert all(torch.equal(after[g], now[g]) for g in after)
    assert 0 < int((plain == 0).sum()) < 64  # the mask drops some, keeps some


def test_checkpoint_activations_is_an_alias_of_recompute_full():
    cfg = load_config("quickstart", ["--train.checkpoint_activations", "true"])
    assert cfg.train.recompute == "full"
    assert cfg.with_overrides(["--train.checkpoint_activations", "false"]).train.recompute == "none"
    assert cfg.with_overrides(["--train.recompute", "selective"]).train.recompute == "selective"
    with pytest.raises(ConfigError, match=r"train\.checkpoint_activations and train\.recompute"):
        load_config(
            "quickstart",
            ["--train.checkpoint_activations", "true", "--train.recompute", "selective"],
        )
    with pytest.raises(ConfigError, match=r"train\.recompute: 'some'; use one of none"):
        load_config("quickstart", ["--train.recompute", "some"])


def _tp_worker(rank: int, world: int) -> dict[str, bool]:
    init_model_parallel(tp=world, pp=1)
    out = {}
    for case in sorted(CASES):
        for sp in ("false", "true"):
            layout = ("--parallel.tp", "2", "--parallel.sequence_parallel", sp)
            model_parallel_seed(3)
            want = _step(_cfg(case, "none", *layout))
            for mode in ("selective", "full"):
                model_parallel_seed(3)
                got = _step(_cfg(case, mode, *layout))
                out[f"{case} {mode} sp={sp}"] = torch.equal(got[0], want[0]) and all(
                    torch.equal(got[1][n], g) for n, g in want[1].items()
                )
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_recompute_gradients_equal_none_on_tp2_ranks():
    """Two real TP ranks, with and without sequence parallelism: every architecture's selective
    and full gradients (each rank's shards) bitwise equal to its ``none`` run."""
    for rank, result in enumerate(run_workers(_tp_worker, 2)):
        assert all(result.values()), f"rank {rank}: {result}"
