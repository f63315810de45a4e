"""Tensor parallelism in real processes: TP=2 equals TP=1 (logits, loss, every gradient,
through both the logits path and the fused chunked LM-head loss), with and without sequence
parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.models import build_model, lm_loss
from tapered_megatron.parallel import (
    col_layout,
    cross_entropy,
    get_tensor_model_parallel_group,
    init_model_parallel,
    unshard,
    vocab_parallel_cross_entropy,
)
from tapered_megatron.parallel.local_launch import run_workers

TINY = [
    "--model.d_model", "64", "--model.layers", "3", "--model.heads", "4", "--model.d_ff", "160",
    "--model.vocab_size", "200", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "16", "--taper.multiple", "8", "--parallel.tp", "2",
]  # fmt: skip
CASES = {
    "transformer": ["--model.arch", "transformer"],
    "gated_elementwise": ["--model.arch", "gated_attention", "--model.gate", "elementwise"],
    "gated_headwise": ["--model.arch", "gated_attention", "--model.gate", "headwise"],
    # sequence parallelism (the reference, one process, builds the plain model)
    "transformer_sp": ["--model.arch", "transformer", "--parallel.sequence_parallel", "true"],
    # selective recompute of the attention core on the gathered projections
    "transformer_sp_selective": [
        "--model.arch", "transformer", "--parallel.sequence_parallel", "true",
        "--train.recompute", "selective",
    ],
}  # fmt: skip


def _cfg(case: str):
    return load_config("quickstart", TINY + CASES[case])


def _batch(cfg):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _run(cfg) -> dict:
    """Forward + backward; full logits and full-shape gradients (gathered over the TP group)."""
    model = build_model(cfg)
    inputs, labels = _batch(cfg)
    logits = model(inputs)
    loss = lm_loss(logits, labels)
    loss.backward()
    tp = dist.get_world_size(get_tensor_model_parallel_group()) if dist.is_initialized() else 1
    chunk_bytes = cross_entropy.CHUNK_BYTES

    def full(t: torch.Tensor, layout) -> torch.Tensor:
        if tp == 1 or layout is None:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=get_tensor_model_parallel_group())
        return unshard(parts, layout)

    vocab_layout = col_layout((*logits.shape[:-1], cfg.padded_vocab_size))
    out = {"loss": loss.item(), "logits": full(logits, vocab_layout)}
    for name, p in model.named_parameters():
        layout = getattr(p, "tp_layout", None)
        out["w:" + name] = full(p.detach(), layout)
        out["g:" + name] = full(p.grad, layout)
    # the fused, chunked LM-head loss (7-token chunks: per-chunk TP all-reduces) on a twin model
    twin = build_model(cfg)
    cross_entropy.CHUNK_BYTES = 7 * 4 * cfg.padded_vocab_size // tp
    fused = twin(inputs, labels)
    fused.backward()
    cross_entropy.CHUNK_BYTES = chunk_bytes
    out["fused_loss"] = fused.item()
    for name, p in twin.named_parameters():
        out["fused_g:" + name] = full(p.grad, getattr(p, "tp_layout", None))
    return out


def _tp_worker(rank: int, world: int) -> dict:
    init_model_parallel(tp=world, pp=1)
    results = {case: _run(_cfg(case)) for case in CASES}
    # vocab-parallel cross-entropy against torch's on gathered logits, with targets in both halves
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2 * 11, generator=g, requires_grad=True)
    target = torch.tensor([0, 10, 11, 21, 5])
    local = logits.chunk(world, dim=-1)[rank].detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    loss.sum().backward()
    results["ce"] = {"loss": loss.detach(), "grad": local.grad}
    # tensors crossing the process boundary as numpy (torch shares them through file handles)
    return {k: {n: _np(v) for n, v in d.items()} for k, d in results.items()}


def _np(v):
    return v.numpy() if isinstance(v, torch.Tensor) else v


@pytest.mark.distributed
def test_tp2_matches_tp1_logits_and_every_gradient():
    per_rank = run_workers(_tp_worker, 2)
    for case in CASES:
        ref = _run(_cfg(case))
        for rank_out in per_rank:
            got = rank_out[case]
            assert got.keys() == ref.keys()
            assert abs(got["loss"] - ref["loss"]) < 1e-5, case
            assert abs(got["fused_loss"] - ref["loss"]) < 1e-5, case
            for key in ref:
                if key in ("loss", "fused_loss"):
                    continue
                got_t = torch.from_numpy(got[key])
                torch.testing.assert_close(got_t, ref[key], atol=1e-5, rtol=0, msg=key)
                if key.startswith("fused_g:"):  # the fused loss's gradients equal the plain ones
                    plain = ref["g:" + key.removeprefix("fused_g:")]
                    torch.testing.assert_close(got_t, plain, atol=1e-5, rtol=0, msg=key)
    logits = torch.randn(5, 22, generator=torch.Generator().manual_seed(3), requires_grad=True)
    target = torch.tensor([0, 10, 11, 21, 5])
    ref_loss = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    ref_loss.sum().backward()
    for rank, rank_out in enumerate(per_rank):
        loss, grad = (torch.from_numpy(rank_out["ce"][k]) for k in ("loss", "grad"))
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, logits.grad.chunk(2, dim=-1)[rank], atol=1e-6, rtol=0)


# ------------------------------------------------------------------ layout-invariant shape
SHAPE = [
    "--model.d_model", "64", "--model.layers", "2", "--model.heads", "4", "--model.d_ff", "176",
    "--model.vocab_size", "200", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "16", "--taper.multiple", "16",
]  # fmt: skip
ARCH_CASES = {
    "transformer": [],
    "gated_attention": ["--model.arch", "gated_attention"],
    "titans": ["--model.arch", "titans", "--model.titans.chunk_size", "4"],
    "hope_attention": ["--model.arch", "hope_attention", "--model.hope.periods", "0", "8", "4"],
}


def _full_weights(tp: int) -> tuple[dict, list[str]]:
    """Every architecture's full weights as built at TP ``tp`` (gathered over the TP group), and
    the parameters whose ``tensor_model_parallel`` flag disagrees with their split (grad norms
    sum TP shards by that flag: an unflagged shard counts on TP rank 0 only, a flagged replica
    ``tp`` times)."""
    out, wrong = {}, []
    for arch, extra in ARCH_CASES.items():
        cfg = load_config("quickstart", [*SHAPE, *extra, "--parallel.tp", str(tp)])
        for name, p in build_model(cfg).named_parameters():
            layout = getattr(p, "tp_layout", None)
            split = layout is not None and not layout.replicated(tp)
            if getattr(p, "tensor_model_parallel", False) != split:
                wrong.append(f"{arch}:{name}")
            if tp > 1 and layout is not None:
                parts = [torch.empty_like(p) for _ in range(tp)]
                dist.all_gather(
                    parts, p.detach().contiguous(), group=get_tensor_model_parallel_group()
                )
                full = unshard(parts, layout)
            else:
                full = p.detach()
            out[f"{arch}:{name}"] = full.numpy()
    return out, wrong


def _shape_worker(rank: int, world: int) -> tuple[dict, list[str]] | None:
    init_model_parallel(tp=world, pp=1)
    built = _full_weights(world)
    return built if rank == 0 else None


@pytest.mark.distributed
def test_same_config_builds_identical_full_weights_at_tp_1_2_4():
    """The model is a function of the model config alone: at TP 1, 2 and 4 the same widths, the
    same padded vocabulary and the same values; every split parameter, and only those, flagged
    model-parallel."""
    ref, _ = _full_weights(1)
    for tp in (2, 4):
        got, wrong_flags = run_workers(_shape_worker, tp)[0]
        assert wrong_flags == []
        assert got.keys() == ref.keys()
        for key, value in ref.items():
            assert got[key].shape == value.shape, key
            assert (got[key] == value).all(), key


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["--parallel.tp", "4"], "model.heads"),
        (["--parallel.tp", "2", "--taper.multiple", "9"], "taper.multiple"),
        (
            ["--parallel.tp", "2", "--model.make_vocab_size_divisible_by", "63"],
            "model.make_vocab_size_divisible_by",
        ),
    ],
)
def test_tp_that_does_not_divide_the_model_is_rejected(overrides, key):
    """Rejected when the config is loaded (no process group), naming the key and the fix."""
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", overrides)
    msg = str(e.value)
    assert f"must divide {key}" in msg and f"--{key}" in msg and "\n" not in msg
