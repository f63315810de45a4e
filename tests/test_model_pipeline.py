"""The pipeline form under DeepSpeed (2 real stages, our balanced split) gives build_model's loss
and gradients (clipped by the global norm over both stages)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipeline_ref import KeepGrads, reference, stage_grads

from tapered_megatron.config import load_config
from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.d_model", "32", "--model.layers", "3", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "128", "--model.seq_len", "8", "--taper.multiple", "8",
    "--parallel.pp", "2",
]  # fmt: skip
UNITS = ("layer", "sublayer")
CLIP = 1.0  # below the gradients' norm: the stages must clip by the norm over both of them


def _cfg(unit: str):
    return load_config("quickstart", [*TINY, "--parallel.pipeline_unit", unit])


def _batches(cfg, n: int = 2):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.model.vocab_size, (n, 1, cfg.model.seq_len + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _pipe_worker(rank: int, world: int) -> dict[str, dict]:
    import deepspeed

    from tapered_megatron.parallel import init_model_parallel
    from tapered_megatron.parallel.pipeline import BalancedPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    topo = init_model_parallel(tp=1, pp=2)
    out = {}
    for unit in UNITS:
        cfg = _cfg(unit)
        module = BalancedPipelineModule.from_config(cfg, topology=topo, micro_batches=2)
        opt = KeepGrads(module.parameters(), lr=0.0)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": CLIP,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config)
        loss = float(engine.train_batch(iter(_batches(cfg))))
        out[unit] = {"loss": loss, "grads": stage_grads(module, cfg, opt)}
    return out


@pytest.mark.distributed
def test_pipeline_two_stages_matches_build_model_loss_and_gradients():
    per_rank = run_workers(_pipe_worker, 2)
    for unit in UNITS:
        cfg = _cfg(unit)
        ref_loss, ref_grads, _ = reference(cfg, _batches(cfg))
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref_grads.values())).item()
        assert norm > CLIP
        ref_grads = {n: g * (CLIP / (norm + 1e-6)) for n, g in ref_grads.items()}  # DeepSpeed's
        got: dict[str, np.ndarray] = {}
        for r in per_rank:
            assert not set(got) & set(r[unit]["grads"]), "a parameter on both stages"
            got.update(r[unit]["grads"])
            assert abs(r[unit]["loss"] - ref_loss) < 1e-5, (unit, r[unit]["loss"], ref_loss)
        assert sorted(got) == sorted(ref_grads), unit  # every parameter, on exactly one stage
        for name, g in ref_grads.items():
            assert g.abs().max() > 0, name
            np.testing.assert_allclose(got[name], g.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
