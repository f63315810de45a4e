"""Sequence parallelism in real processes: TP2 + SP and TP2 x PP2 + SP equal the TP1 single
process (loss and every gradient) for every architecture; dropout masks in the sequence-split
regions differ across TP ranks, are redrawn alike when a block is recomputed, and a run with
dropout equals itself on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_args import for_arch
from launch_helpers import assert_close, launch_ranks, losses
from pipeline_ref import KeepGrads, canonical_names, full_tensor, reference

from tapered_megatron.config import ConfigError, load_config
from tapered_megatron.models import build_model, set_recompute
from tapered_megatron.parallel import (
    get_rng_tracker,
    get_tensor_model_parallel_rank,
    init_model_parallel,
    model_parallel_seed,
)
from tapered_megatron.parallel.local_launch import run_workers

SHAPE = [
    "--model.d_model", "32", "--model.layers", "2", "--model.heads", "2", "--model.d_ff", "64",
    "--model.vocab_size", "128", "--model.seq_len", "16", "--taper.multiple", "8",
    "--model.titans.chunk_size", "4", "--model.hope.periods", "0", "8", "4",
]  # fmt: skip
ARCHS = ("transformer", "gated_attention", "titans", "hope_attention")
SP = ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
RTOL = 1e-5


#: ``arch+variant`` cases: Hope learning from the teach signal (its first pass gathers the
#: shards); one key/value head, replicated at TP2 (q and kv enter the TP region together)
VARIANTS = {"teach": ["--model.hope.update", "teach"], "gqa": ["--model.kv_heads", "1"]}


def _cfg(case: str, extra: list[str] = ()):
    arch, _, variant = case.partition("+")
    return load_config("quickstart", [*for_arch(arch, SHAPE), *VARIANTS.get(variant, []), *extra])


def _batches(cfg, n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.model.vocab_size, (n, 2, cfg.model.seq_len + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def _tp_run(arch: str) -> dict:
    """TP2 + SP, one process of the pair: mean loss over two micro-batches, full gradients."""
    cfg = _cfg(arch, SP)
    model = build_model(cfg)
    batches = _batches(cfg)
    loss = sum(model(x, y) for x, y in batches) / len(batches)
    loss.backward()
    return {
        "loss": loss.item(),
        "grads": {n: full_tensor(p.grad, p) for n, p in model.named_parameters()},
    }


def _dropout_masks() -> np.ndarray:
    """The keep-mask a block draws on this rank's part of the sequence (dropout 0.5)."""
    cfg = _cfg("transformer", [*SP, "--model.dropout", "0.5"])
    block = build_model(cfg).layers[0].train()
    return (block._drop(torch.ones(2, 8, 32)) != 0).numpy()


def _recompute_redraws_the_masks() -> bool:
    """With dropout under SP, a recomputed block (``full``) draws the masks of its forward and a
    selectively recomputed attention core (its input gathered from the sequence shards) gives
    the same gradients: those of the run that kept its activations."""
    cfg = _cfg("transformer", [*SP, "--model.dropout", "0.3"])
    (x, y), grads = _batches(cfg)[0], []
    for recompute in ("none", "full", "selective"):
        model = set_recompute(build_model(cfg).train(), recompute)
        streams = get_rng_tracker().get_states()
        model(x, y).backward()
        get_rng_tracker().set_states(streams)
        grads.append([p.grad for p in model.parameters()])
    return all(
        torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other, strict=True)
    )


def _tp_worker(rank: int, world: int, archs: tuple[str, ...]) -> dict:
    init_model_parallel(tp=world, pp=1)
    model_parallel_seed(1234)
    out = {arch: _tp_run(arch) for arch in archs}
    out["mask"] = _dropout_masks()
    out["recompute"] = _recompute_redraws_the_masks()
    return out


def _assert_equal_to_reference(arch: str, loss: float, grads: dict[str, np.ndarray]) -> None:
    cfg = _cfg(arch)
    ref_loss, ref_grads, _ = reference(cfg, _batches(cfg))
    assert loss == pytest.approx(ref_loss, rel=RTOL), arch
    assert sorted(grads) == sorted(ref_grads), arch
    for name, g in ref_grads.items():
        g = g.numpy()
        assert np.abs(g).max() > 0, (arch, name)
        np.testing.assert_allclose(
            grads[name], g, rtol=RTOL, atol=RTOL * np.abs(g).max(), err_msg=f"{arch} {name}"
        )


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_sp_equals_tp1_every_arch():
    """Loss and every gradient (norm gains summed over the TP group included) within 1e-5, every
    rank; dropout masks differ across TP ranks and a recomputed block redraws them. The default
    set's TP2 + SP case is ``transformer_sp`` in ``test_tp_parallel.py`` (its launch)."""
    cases = (*ARCHS, "hope_attention+teach", "gated_attention+gqa")
    per_rank = run_workers(_tp_worker, 2, cases)
    for case in cases:
        for r in per_rank:  # every rank holds the same loss and full gradients
            _assert_equal_to_reference(case, r[case]["loss"], r[case]["grads"])
    assert per_rank[0]["mask"].shape == (2, 8, 32)
    assert (per_rank[0]["mask"] != per_rank[1]["mask"]).any(), "TP ranks drew the same mask"
    assert all(r["recompute"] for r in per_rank), "a recomputed block drew other masks"


def _pipe_worker(rank: int, world: int) -> dict:
    import deepspeed

    from tapered_megatron.parallel.pipeline import BalancedPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    topo = init_model_parallel(tp=2, pp=2)
    model_parallel_seed(1234)
    out = {}
    for arch in ARCHS:
        cfg = _cfg(arch, [*SP, "--parallel.pp", "2"])
        module = BalancedPipelineModule.from_config(cfg, topology=topo, micro_batches=2)
        opt = KeepGrads(module.parameters(), lr=0.0)
        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,  # the raw gradients
            "steps_per_print": 10**9,
            "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
        }
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config)
        loss = float(engine.train_batch(iter(_batches(cfg))))
        names = canonical_names(module, cfg)
        grads = {names[p]: full_tensor(g, p) for p, g in opt.kept.items()}
        out[arch] = {"loss": loss, "grads": grads, "tp_rank": get_tensor_model_parallel_rank()}
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_pp2_sp_equals_tp1_every_arch():
    """Four ranks (two stages of two TP ranks) exchanging sequence shards between the stages."""
    per_rank = run_workers(_pipe_worker, 4)
    for arch in ARCHS:
        grads: dict[str, np.ndarray] = {}
        loss = None
        for r in per_rank:
            got = r[arch]
            for name, g in got["grads"].items():
                if name in grads:  # the other TP rank of the stage: the same full gradient
                    np.testing.assert_array_equal(grads[name], g, err_msg=name)
                grads[name] = g
            loss = got["loss"] if loss is None else loss
            assert got["loss"] == pytest.approx(loss, rel=1e-12)
        _assert_equal_to_reference(arch, loss, grads)


def test_sequence_parallel_needs_tp_and_a_divisible_sequence():
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", ["--parallel.sequence_parallel", "true"])
    assert "parallel.tp > 1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", [*SP, "--model.seq_len", "15"])
    assert "model.seq_len (15)" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.distributed
def test_dropout_under_sp_resumes_exactly(corpus, tmp_path):
    """pretrain/main.py at TP2 + SP with dropout: 10 steps, save, resume to 20 equals 20 straight
    (the TP-local streams are saved and restored with the checkpoint)."""
    drop = [*SP, "--model.dropout", "0.2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch_ranks(2, corpus, straight, "zero1.json", drop)
    launch_ranks(2, corpus, resumed, "zero1.json", [*drop, "--train.exit_interval", "10"])
    launch_ranks(2, corpus, resumed, "zero1.json", [*drop, "--resume", "auto"])
    assert len(losses(straight)) == 20
    assert_close(losses(resumed), losses(straight), rtol=1e-6)
    assert "resumed from" in (resumed / "log.txt").read_text()


def _unit_costs(arch: str, sp: bool, recompute: str = "none") -> list:
    from tapered_megatron.planning import cost as costlib

    cfg = load_config("quickstart", for_arch(arch, SHAPE))
    shape = costlib.RunShape(
        micro_batch_size=2, seq_len=16, tp=2, sequence_parallel=sp, recompute=recompute
    )
    return costlib.unit_costs(cfg, shape, costlib.get_device("h100"))


def test_cost_model_counts_sequence_shards_and_their_communication():
    """Per block, SP keeps one replicated copy of each half's input instead of two (the norm's
    input is a shard), and a checkpointed block keeps a shard; the reduce-scatter + all-gather
    pairs cost the all-reduces' ring time, and a whole-sequence half adds one all-gather."""
    d, tok, elem = 32, 2 * 16, 2
    for arch in ARCHS:
        plain, split = _unit_costs(arch, False), _unit_costs(arch, True)
        for a, b in zip(plain, split, strict=True):
            if a.kind == "layer":  # 2 halves x one d-sized input, half of it on each rank
                assert a.act - b.act == pytest.approx(2 * d * elem * tok / 2), arch
            whole = {"transformer": 0, "gated_attention": 0, "titans": 1, "hope_attention": 1}
            extra = 0.5 * whole[arch] / 2 if a.kind == "layer" else 0  # per all-reduce
            assert b.tp_comm == pytest.approx(a.tp_comm * (1 + extra)), (arch, a.kind)
    ck_plain, ck_split = (
        _unit_costs("transformer", False, "full"),
        _unit_costs("transformer", True, "full"),
    )
    for a, b in zip(ck_plain, ck_split, strict=True):
        if a.kind == "layer":
            assert b.act == pytest.approx(a.act / 2)


#: a shape where the per-token activations dominate the per-sequence ones (RoPE tables, the
#: memory's initial state) as at training sizes
MEM_SHAPE = [
    "--model.d_model", "64", "--model.layers", "2", "--model.heads", "2", "--model.d_ff", "128",
    "--model.vocab_size", "128", "--model.seq_len", "64", "--taper.multiple", "8",
    "--model.titans.chunk_size", "8", "--model.titans.window", "32",
    "--model.hope.periods", "0", "16", "8",
]  # fmt: skip


def _mem_cfg(arch: str, tp: int, sp: bool, recompute: str):
    parallel = ["--parallel.tp", str(tp), "--parallel.sequence_parallel", str(sp).lower()]
    return load_config(
        "quickstart", [*for_arch(arch, MEM_SHAPE), *parallel, "--train.recompute", recompute]
    )


def _saved_per_rank(rank: int, world: int, settings: list) -> dict:
    from tapered_megatron.planning.profile import model_saved_bytes

    init_model_parallel(tp=world, pp=1)
    model_parallel_seed(1234)
    return {k: model_saved_bytes(_mem_cfg(k[0], world, *k[1:]), 2) for k in settings}


def test_activation_memory_matches_what_autograd_keeps():
    """Per rank, the bytes autograd keeps in one training forward (fp32) are the cost model's
    activations of the micro-batch within 15 % for every architecture at TP1, TP2 and TP2 + SP,
    without recompute and with selective recompute, and SP saves the predicted bytes within
    15 %."""
    from tapered_megatron.planning import cost as costlib

    runs = {
        1: [(a, False, r) for a in ARCHS for r in ("none", "selective")],
        2: [(a, sp, "none") for a in ARCHS for sp in (False, True)]
        + [(a, True, "selective") for a in ARCHS],
    }
    for tp, settings in runs.items():
        measured = run_workers(_saved_per_rank, tp, settings)
        pred = {}
        for arch, sp, recompute in settings:
            cfg = _mem_cfg(arch, tp, sp, recompute)
            shape = costlib.RunShape(
                micro_batch_size=2, seq_len=cfg.model.seq_len, tp=tp, sequence_parallel=sp,
                precision="fp32", pipeline=False, recompute=recompute,
            )  # fmt: skip
            units = costlib.unit_costs(cfg, shape, costlib.get_device("cpu"))
            key = (arch, sp, recompute)
            pred[key] = sum(u.act for u in units)
            for rank in measured:
                assert rank[key] == pytest.approx(pred[key], rel=0.15), (key, tp)
        for arch in ARCHS if tp > 1 else ():
            no_sp, sp = (arch, False, "none"), (arch, True, "none")
            saving = [m[no_sp] - m[sp] for m in measured]
            assert saving == pytest.approx([pred[no_sp] - pred[sp]] * tp, rel=0.15), arch


def test_planner_searches_sequence_parallelism_and_takes_it_where_memory_needs_it():
    """Both settings where SP costs time; transformer_7b on 64 H100s: TP4 with micro-batch 8
    fits 90 % of 80 GiB only with SP."""
    from dataclasses import replace

    from tapered_megatron.planning import cost as costlib
    from tapered_megatron.planning.planner import (
        Candidate,
        ds_config,
        enumerate_candidates,
        evaluate,
        overrides,
    )

    # SP off is searched where it can be faster: a memory architecture's whole-sequence half
    for preset, searched in (("transformer_7b", {True}), ("titans_7b", {False, True})):
        cands = enumerate_candidates(load_config(preset), 64, 8)
        assert all(c.tp > 1 for c in cands if c.sequence_parallel)
        assert {c.sequence_parallel for c in cands if c.tp > 1} == searched, preset
    cfg = load_config("transformer_7b")
    dev, cap = costlib.get_device("h100"), 0.9 * 80 * costlib.GiB
    with_sp = evaluate(cfg, Candidate(4, 1, 16, 2, 8, 1, "none", "layer", True), dev, cap)
    without = evaluate(cfg, replace(with_sp, sequence_parallel=False, parts=()), dev, cap)
    assert isinstance(with_sp, Candidate) and with_sp.mem_gib < 0.9 * 80
    assert isinstance(without, str) and without.startswith("out of memory")
    assert "--parallel.sequence_parallel true" in " ".join(overrides(cfg, with_sp))
    pipe = ds_config(cfg, replace(with_sp, pp=2), dev)["pipeline"]
    assert not pipe["pipe_partitioned"] and not pipe["grad_partitioned"]


def test_pipeline_stages_send_the_shards_whole():
    """With SP the trainer turns off DeepSpeed's own partitioning of the stages' tensors over the
    TP group (``ds_configs/pipeline.json`` turns it on)."""
    import json

    from launch_helpers import ROOT

    from tapered_megatron.training.launch import resolve

    ds = json.loads((ROOT / "ds_configs" / "pipeline.json").read_text())
    assert ds["pipeline"]["pipe_partitioned"] and ds["pipeline"]["grad_partitioned"]
    for sp, want in ((False, True), (True, False)):
        cfg = _cfg("transformer", [*SP[:2], "--parallel.pp", "2"])
        cfg = cfg.with_overrides(["--parallel.sequence_parallel", str(sp).lower()])
        filled, _ = resolve(cfg, ds, 4)
        assert filled["pipeline"]["pipe_partitioned"] is want
        assert filled["pipeline"]["grad_partitioned"] is want
