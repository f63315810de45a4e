"""The pipeline form under DeepSpeed's PipelineModule (2 real stages) gives build_model's loss."""

from __future__ import annotations

import pytest
import torch

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, lm_loss, pipeline_layer_specs
from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.d_model", "32", "--model.layers", "3", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "128", "--model.seq_len", "8", "--taper.multiple", "8",
]  # fmt: skip


def _batches(cfg, n: int = 2):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.model.vocab_size, (n, 1, cfg.model.seq_len + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _pipe_worker(rank: int, world: int) -> dict[str, float]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from tapered_megatron.parallel import init_model_parallel

    deepspeed.init_distributed(dist_backend="gloo")
    topo = init_model_parallel(tp=1, pp=2)
    losses = {}
    for unit in ("layer", "sublayer"):
        cfg = load_config("quickstart", [*TINY, "--parallel.pp", "2"])
        module = PipelineModule(
            layers=pipeline_layer_specs(cfg, unit),
            loss_fn=lm_loss,
            topology=topo,
            partition_method="uniform",
        )
        opt = torch.optim.SGD(module.parameters(), lr=0.0)
        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config)
        losses[unit] = float(engine.train_batch(iter(_batches(cfg))))
    return losses


@pytest.mark.distributed
def test_pipeline_module_two_stages_matches_build_model():
    per_rank = run_workers(_pipe_worker, 2)
    cfg = load_config("quickstart", TINY)
    model = build_model(cfg)
    ref = sum(lm_loss(model(x), y).item() for x, y in _batches(cfg)) / 2
    # DeepSpeed computes the loss on the last stage and broadcasts it to every stage
    for losses in per_rank:
        for unit, loss in losses.items():
            assert abs(loss - ref) < 1e-5, (unit, losses, ref)
