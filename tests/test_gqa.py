"""Grouped-query attention (``--model.kv_heads``): the config's checks; every architecture at
TP 2 and 4 with key/value heads split (TP divides them) and replicated (they divide TP) equal to
the single-process model (logits and every gradient, in real processes); training through
``pretrain/main.py`` at TP 2 equal to one process, and a checkpoint saved with the heads split
resumed with them replicated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from arch_args import for_arch
from launch_helpers import ROOT, assert_close, launch_ranks, metrics
from safetensors.torch import load_file

from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.export.__main__ import main as export_main
from tapered_megatron.models import ARCHITECTURES, build_model, lm_loss, resolve_architecture
from tapered_megatron.parallel import (
    col_layout,
    get_tensor_model_parallel_group,
    init_model_parallel,
    unshard,
)
from tapered_megatron.parallel.local_launch import run_workers
from tapered_megatron.planning.cost import tp_local_params

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
    # one rank's mixer parameters, built and as the cost model counts them
    mixer = resolve_architecture(cfg.model.arch).mixer
    out["mixer_params"] = torch.tensor(
        [
            [sum(p.numel() for p in block.mixer.parameters()) for block in model.layers],
            [tp_local_params(mixer.counts(cfg, i), cfg, tp) for i in range(cfg.model.layers)],
        ]
    )
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
            built, counted = case.pop("mixer_params").tolist()
            whole = ref.pop("mixer_params")[0].tolist()
            assert built == counted, (arch, kv)
            if kv >= tp:
                assert counted == [w / tp for w in whole], (arch, kv)
            else:  # every rank holds all kv_heads key/value heads
                assert all(c > w / tp for c, w in zip(counted, whole, strict=True)), (arch, kv)
            assert case.keys() == ref.keys()
            assert ("g:layers.0.mixer.qkv.weight" in ref) == (kv == 8 and arch != "titans")
            for key, want in ref.items():
                torch.testing.assert_close(
                    torch.from_numpy(case[key]), want, atol=1e-5, rtol=0, msg=f"{arch}:{kv} {key}"
                )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tp_equals_single_process_for_split_and_replicated_kv_heads(arch, tp):
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


# ------------------------------------------------------------------ training in real ranks
TRAIN = ["--model.heads", "8", "--train.iters", "4", "--eval.interval", "0"]
T = 600  # seconds per launch (the shared CI box can be slow to start 4 ranks)
_single: dict[int, Path] = {}


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The single-process ZeRO-0 run with ``kv`` key/value heads (one per module and kv)."""

    def get(kv: int) -> Path:
        if kv not in _single:
            out = tmp_path_factory.mktemp(f"single-kv{kv}")
            launch_ranks(1, corpus, out, "zero0.json", [*TRAIN, "--model.kv_heads", str(kv)], T)
            _single[kv] = out
        return _single[kv]

    return get


# case: (ranks, ds_config, layout arguments, kv_heads)
LAYOUTS = {
    "tp2-kv1": (2, "zero1.json", ["--parallel.tp", "2"], 1),
    "tp2-dp2-zero3-kv1": (4, "zero3", ["--parallel.tp", "2"], 1),
    "tp2-pp2-kv2": (4, "pipeline.json", ["--parallel.tp", "2", "--parallel.pp", "2"], 2),
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case", [c if c == "tp2-kv1" else pytest.param(c, marks=pytest.mark.slow) for c in LAYOUTS]
)
def test_trained_layout_equals_single_process(case, corpus, single, tmp_path):
    """pretrain/main.py at TP 2 with key/value heads replicated (one head; also under ZeRO-3
    over DP 2) and split (two heads, under PP 2): every iteration's loss and gradient norm equal
    the single-process run's."""
    n, ds, layout, kv = LAYOUTS[case]
    if ds == "zero3":  # partition every parameter, however small
        cfg = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds = str(tmp_path / "zero3_all.json")
        Path(ds).write_text(json.dumps(cfg))
    ref = metrics(single(kv))
    launch_ranks(n, corpus, tmp_path, ds, [*TRAIN, "--model.kv_heads", str(kv), *layout], T)
    got = metrics(tmp_path)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    assert_close([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)
    assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_from_split_to_replicated_kv_heads(corpus, single, tmp_path):
    """kv_heads 2: saved at TP 2 (one head per rank), resumed at TP 4 (both heads on every
    rank) through the universal checkpoint; iterations 3-4 and the exported weights equal the
    uninterrupted single-process run."""
    ref = single(2)
    kv = ["--model.kv_heads", "2"]
    launch_ranks(2, corpus, tmp_path, "zero1.json",
                 [*TRAIN, *kv, "--parallel.tp", "2", "--train.exit_interval", "2"], T)  # fmt: skip
    assert (tmp_path / "ckpt" / "global_step2" / "universal" / "meta.pt").exists()
    launch_ranks(4, corpus, tmp_path, "zero1.json",
                 [*TRAIN, *kv, "--parallel.tp", "4", "--resume", "auto"], T)  # fmt: skip
    got, want = metrics(tmp_path), metrics(ref)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    assert "layout change: checkpoint" in (tmp_path / "log.txt").read_text()
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x")]) == 0
    assert export_main(["--checkpoint", str(ref / "ckpt"), "--out", str(tmp_path / "y")]) == 0
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("x", "y"))
    assert sorted(a) == sorted(b) and "layers.0.mixer.kv.weight" in a
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= 1e-5, name


def test_cost_model_counts_the_smaller_or_replicated_kv_projection():
    """The 7B transformer (32 heads, d 4096) at TP 8: 8 key/value heads (one per rank) shrink
    each mixer's parameters, model state, activations and FLOPs by the key/value projection's
    share; 4 (replicated) leave every rank the whole, 4-head projection."""
    from tapered_megatron.planning.cost import RunShape, bytes_per_param, get_device, unit_costs

    shape, dev = RunShape(tp=8, seq_len=4096), get_device("h100")
    cost = {}
    for kv in (32, 8, 4):
        cfg = load_config("transformer_7b", ["--model.kv_heads", str(kv)])
        cost[kv] = next(u for u in unit_costs(cfg, shape, dev, "sublayer") if u.kind == "mixer")
    d, hd, tok = 4096, 128, shape.tokens
    per_head = 2 * hd * d  # key/value projection parameters per key/value head
    full = cost[32]
    assert full.params - cost[8].params == 24 * per_head
    assert full.local_params - cost[8].local_params == 24 * per_head / 8
    # the mixer's norm gain (d) is whole on every rank too
    assert cost[4].local_params == (full.params - 32 * per_head - d) / 8 + d + 4 * per_head
    bpp = bytes_per_param(shape.precision, shape.zero_stage, shape.dp, shape.pipeline)
    assert full.static - cost[4].static == pytest.approx(
        (full.local_params - cost[4].local_params) * bpp
    )
    assert full.flops_fwd - cost[8].flops_fwd == 2 * 24 * per_head
    # bf16: the projection output's k and v and the rope'd k
    assert full.act - cost[8].act == pytest.approx(3 * 24 * hd * 2 * tok / 8)
