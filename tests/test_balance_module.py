"""BalancedPipelineModule: explicit boundaries in a real 2-process DeepSpeed pipeline (gloo)."""

from __future__ import annotations

import pytest

from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.layers", "4", "--model.d_model", "32", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "256", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "64", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
]  # fmt: skip


def _module_worker(rank: int, world: int, unit: str) -> dict:
    import deepspeed
    import torch

    from tapered_megatron.config import load_config
    from tapered_megatron.pipeline.balance import partition
    from tapered_megatron.pipeline.module import BalancedPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config("quickstart", [*TINY, "--parallel.pipeline_unit", unit])
    module = BalancedPipelineModule.from_config(cfg, num_stages=2, micro_batches=4)
    expected = partition(cfg, 2, "balanced", 4, unit=unit)
    lo, hi = expected[rank], expected[rank + 1]
    with pytest.raises(ValueError, match="at least one layer spec"):
        from tapered_megatron.models import pipeline_layer_specs

        n = len(pipeline_layer_specs(cfg, unit=unit))
        BalancedPipelineModule(pipeline_layer_specs(cfg, unit=unit), [0, 0, n], num_stages=2)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "train_batch_size": 8,
            "steps_per_print": 10**9,
        },
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 2, 17), generator=g)
    loss = engine.train_batch(iter([(x[:, :-1], x[:, 1:]) for x in ids]))
    return {
        "parts": list(module.parts),
        "expected": expected,
        "local": len(module.forward_funcs),
        "span": hi - lo,
        "loss": float(loss),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("unit", ["sublayer", pytest.param("layer", marks=pytest.mark.slow)])
def test_balanced_pipeline_module_trains_with_explicit_parts(unit: str) -> None:
    out = run_workers(_module_worker, 2, unit)
    for r in out:
        assert r["parts"] == r["expected"]
        assert r["local"] == r["span"]  # this rank built exactly its stage's specs
    assert out[0]["loss"] == pytest.approx(out[1]["loss"])
    assert 4.0 < out[1]["loss"] < 7.0  # ~ln(256) at initialisation
