"""Grouped-query attention (``--model.kv_heads``): the config's checks, and every architecture at
TP 2 and 4 with key/value heads split (TP divides them) and replicated (they divide TP) equal to
the single-process model (logits and every gradient, in real processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from arch_args import for_arch

from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.models import ARCHITECTURES, build_model, lm_loss
from tapered_megatron.parallel import (
    col_layout,
    get_tensor_model_parallel_group,
    init_model_parallel,
    unshard,
)
from tapered_megatron.parallel.local_launch import run_workers

SHAPE = [
    "--model.d_model", "32", "--model.layers", "2", "--model.heads", "8", "--model.d_ff", "176",
    "--model.vocab_size", "200", "--model.seq_len", "16", "--model.make_vocab_size_divisible_by",
    "16", "--taper.multiple", "16", "--model.titans.chunk_size", "4", "--model.titans.window",
    "8", "--model.hope.periods", "0", "8", "4",
]  # fmt: skip
KV_HEADS = (8, 2, 1)  # heads, heads / 4, 1


def _cfg(arch: str, kv: int, tp: int = 1, *extra: str):
    args = [*SHAPE, "--model.kv_heads", str(kv), "--parallel.tp", str(tp), *extra]
    return load_config("quickstart", for_arch(arch, args))


def _run(cfg) -> dict[str, torch.Tensor]:
    """Forward + backward of a fixed batch: full logits, loss and every full gradient."""
    torch.manual_seed(0)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=g)
    logits = model(ids[:, :-1])
    loss = lm_loss(logits, ids[:, 1:])
    loss.backward()
    tp = dist.get_world_size(get_tensor_model_parallel_group()) if dist.is_initialized() else 1

    def full(t: torch.Tensor, layout) -> torch.Tensor:
        if tp == 1 or layout is None:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=get_tensor_model_parallel_group())
        return unshard(parts, layout)

    vocab = col_layout((*logits.shape[:-1], cfg.padded_vocab_size))
    out = {"logits": full(logits, vocab), "loss": loss.detach()}
    for name, p in model.named_parameters():
        out["g:" + name] = full(p.grad, getattr(p, "tp_layout", None))
    return out


def _worker(rank: int, world: int, archs: tuple[str, ...]) -> dict | None:
    init_model_parallel(tp=world, pp=1)
    got = {
        f"{arch}:{kv}": {k: v.numpy() for k, v in _run(_cfg(arch, kv, world)).items()}
        for arch in archs
        for kv in KV_HEADS
    }
    return got if rank == 0 else None


def _check_tp(tp: int, archs: tuple[str, ...]) -> None:
    got = run_workers(_worker, tp, archs)[0]
    for arch in archs:
        for kv in KV_HEADS:
            ref = _run(_cfg(arch, kv))
            case = got[f"{arch}:{kv}"]
            assert case.keys() == ref.keys()
            assert ("g:layers.0.mixer.qkv.weight" in ref) == (kv == 8 and arch != "titans")
            for key, want in ref.items():
                torch.testing.assert_close(
                    torch.from_numpy(case[key]), want, atol=1e-5, rtol=0, msg=f"{arch}:{kv} {key}"
                )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "tp, arch",
    [
        pytest.param(tp, arch, marks=[] if (tp, arch) == (2, "transformer") else pytest.mark.slow)
        for tp in (2, 4)
        for arch in ARCHITECTURES
    ],
)
def test_tp_equals_single_process_for_split_and_replicated_kv_heads(tp, arch):
    """TP 2: kv_heads 8 and 2 split, 1 replicated; TP 4: 8 split, 2 and 1 replicated."""
    _check_tp(tp, (arch,))


def test_kv_heads_default_to_heads():
    assert load_config("quickstart", ["--model.heads", "8"]).model.kv_heads == 8
    cfg = load_config("quickstart", ["--model.heads", "8", "--model.kv_heads", "2"])
    assert cfg.model.kv_heads == 2
    assert cfg.with_overrides(["--train.iters", "3"]).model.kv_heads == 2


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["--model.heads", "8", "--model.kv_heads", "3"], "model.kv_heads (3) must divide"),
        (
            ["--model.heads", "12", "--model.d_model", "48", "--model.kv_heads", "4",
             "--parallel.tp", "3", "--taper.multiple", "48",
             "--model.make_vocab_size_divisible_by", "96"],
            "parallel.tp (3) and model.kv_heads (4)",
        ),
        (["--model.kv_heads", "-1"], "model.kv_heads: must be >= 0"),
    ],
)  # fmt: skip
def test_bad_kv_heads_is_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", overrides)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg
