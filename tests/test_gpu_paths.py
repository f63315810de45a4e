"""The GPU branches' logic on a CPU box: product-name lookups with the accelerator faked, the
profiler's accelerator path, and one pipeline split for all ranks whatever each rank measured."""

from __future__ import annotations

import pytest
import torch

from tapered_megatron import accelerator
from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.layers", "4", "--model.d_model", "32", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "256", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "64", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
]  # fmt: skip


class FakeCuda:
    """DeepSpeed's accelerator interface as a CUDA box shows it; tensors still live on the CPU."""

    def __init__(self) -> None:
        self.syncs = 0

    def device_name(self) -> str:
        return "cuda"

    def current_device_name(self) -> str:
        return "cpu"

    def synchronize(self) -> None:
        self.syncs += 1


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend DeepSpeed runs on a CUDA device named by ``set_name``."""
    fake = FakeCuda()
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: fake)
    name = {"value": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name["value"])
    fake.set_name = lambda v: name.update(value=v)
    return fake


def test_suite_is_pinned_to_the_cpu_accelerator():
    import os

    from deepspeed.accelerator import get_accelerator

    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert get_accelerator().device_name() == "cpu"


def test_lookup_matches_whole_name_tokens_only():
    table = {"A10": 1, "A10G": 2, "L40": 3, "L40S": 4, "A100": 5}
    assert accelerator.lookup("NVIDIA A10", table) == 1
    assert accelerator.lookup("NVIDIA A10G", table) == 2
    assert accelerator.lookup("NVIDIA L40", table) == 3
    assert accelerator.lookup("NVIDIA L40S", table) == 4
    assert accelerator.lookup("NVIDIA A100-SXM4-80GB", table) == 5
    assert accelerator.lookup("NVIDIA A30", table) is None


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA A10", 125.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
    ],
)
def test_logger_peak_table_on_a_faked_gpu(fake_gpu, name, peak):
    from tapered_megatron.training import logger

    fake_gpu.set_name(name)
    assert logger.device_product_name() == name
    assert logger.peak_tflops(0.0) == peak


@pytest.mark.parametrize(
    "name, preset",
    [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H100 PCIe", "h100")],
)
def test_cost_model_device_auto_on_a_faked_gpu(fake_gpu, name, preset):
    from tapered_megatron.planning import cost, profile

    fake_gpu.set_name(name)
    assert cost.resolve_device("auto").name == preset
    assert profile.device_label() == f"cuda:{name}"


def test_cost_model_unknown_gpu_says_how_to_choose(fake_gpu, capsys):
    from tapered_megatron.planning import cost

    fake_gpu.set_name("NVIDIA L4")
    assert cost.resolve_device("auto").name == "h100"
    assert "--device" in capsys.readouterr().out


def test_profiled_units_on_a_faked_gpu_time_between_synchronisations(fake_gpu):
    from tapered_megatron.config import load_config
    from tapered_megatron.models import units
    from tapered_megatron.planning.profile import measure_units

    cfg = load_config("quickstart", TINY)
    out = measure_units(cfg, "layer", 1, False, reps=1)
    n = len(units(cfg, "layer"))
    assert len(out["time"]) == n and all(t > 0 for t in out["time"])
    assert fake_gpu.syncs == 2 * 3 * n  # before and after each of 1 + 2 warm-up passes


def _split_worker(rank: int, world: int) -> dict:
    import deepspeed

    from tapered_megatron.config import load_config
    from tapered_megatron.models import units
    from tapered_megatron.parallel.pipeline import BalancedPipelineModule
    from tapered_megatron.planning import balance, profile

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config("quickstart", TINY)
    n = len(units(cfg, "layer"))
    # Each rank "measured" different unit times: rank 1 sees its first block 50x slower.
    times = [1e-3] * n
    if rank == 1:
        times[1] = 5e-2
    fake = {"time": times, "act_bytes": [0.0] * n}
    profile.profile_units = lambda *a, **k: fake
    kw = {"device": "cpu", "profiled": True, "zero_stage": 0}
    own = balance.partition(cfg, 2, "balanced", 4, **kw)
    module = BalancedPipelineModule.from_config(
        cfg, num_stages=2, micro_batches=4, partition_kwargs=kw
    )
    return {"own": own, "used": list(module.parts)}


@pytest.mark.distributed
def test_ranks_with_different_measured_times_use_one_split():
    got = run_workers(_split_worker, 2)
    assert got[0]["own"] != got[1]["own"], "the ranks' own choices should differ"
    assert got[0]["used"] == got[1]["used"] == got[0]["own"]
