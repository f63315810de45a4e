"""BalancedPipelineModule: explicit boundaries in a real 2-process DeepSpeed pipeline (gloo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipeline_ref import canonical_names, reference

from tapered_megatron.config import load_config
from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.layers", "4", "--model.d_model", "32", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "256", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "64", "--train.micro_batch_size", "2", "--train.global_batch_size", "8",
]  # fmt: skip
LR = 0.1


def _module_worker(rank: int, world: int, unit: str) -> dict:
    import deepspeed

    from tapered_megatron.parallel.pipeline import BalancedPipelineModule
    from tapered_megatron.planning.balance import partition

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
        optimizer=torch.optim.SGD(module.parameters(), lr=LR),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "train_batch_size": 8,
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
        },
    )
    loss = engine.train_batch(iter(_batches()))
    names = canonical_names(module, cfg)
    return {
        "parts": list(module.parts),
        "expected": expected,
        "local": len(module.forward_funcs),
        "span": hi - lo,
        "loss": float(loss),
        "after": {names[p]: p.detach().numpy().copy() for p in module.parameters()},
    }


def _batches() -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 2, 17), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


@pytest.mark.distributed
@pytest.mark.parametrize("unit", ["sublayer", pytest.param("layer", marks=pytest.mark.slow)])
def test_balanced_pipeline_module_trains_with_explicit_parts(unit: str) -> None:
    """Each rank builds exactly its stage's units; one training step (4 micro-batches, SGD) ends
    with the loss and the parameters of the same step in one process."""
    out = run_workers(_module_worker, 2, unit)
    for r in out:
        assert r["parts"] == r["expected"]
        assert r["local"] == r["span"]  # this rank built exactly its stage's specs
    cfg = load_config("quickstart", [*TINY, "--parallel.pipeline_unit", unit])
    loss, _, after = reference(cfg, _batches(), lr=LR)
    assert out[1]["loss"] == pytest.approx(loss, rel=1e-5)  # the last stage computes it
    got = {**out[0]["after"], **out[1]["after"]}
    assert sorted(got) == sorted(after)
    for name, p in after.items():
        np.testing.assert_allclose(got[name], p.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
