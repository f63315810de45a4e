"""Scale planner: enumeration, memory fit, ranking, filled DeepSpeed config and SLURM script."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from tapered_megatron.config import PRESET_DIR, load_config, preset_names
from tapered_megatron.models.counters import count_model
from tapered_megatron.models.language_model import meta_param_count, units
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.balance import partition
from tapered_megatron.planning.planner import (
    Candidate,
    ds_config,
    enumerate_candidates,
    evaluate,
    fill_slurm,
    overrides,
    plan,
)

SCALED = [p for p in preset_names() if p.endswith(("_1.3b", "_7b"))]


def test_meta_param_count_equals_counters() -> None:
    cfg = load_config("titans_7b")
    assert meta_param_count(cfg) == count_model(cfg).params_total


def test_bytes_per_param_follow_zero_stages() -> None:
    assert costlib.bytes_per_param("bf16", 0, 8, False) == 16
    assert costlib.bytes_per_param("bf16", 1, 4, False) == 2 + 2 + 4 + 3  # fp32 grad buffer
    assert costlib.bytes_per_param("bf16", 2, 4, False) == 2 + 1 + 3  # fp32 grad partition
    assert costlib.bytes_per_param("bf16", 3, 4, False) == 0.5 + 1 + 3
    # the pipeline's BF16_Optimizer: an fp32 gradient buffer and no bf16 gradients held
    assert costlib.bytes_per_param("bf16", 1, 1, True) == 2 + 12 + 4
    assert costlib.bytes_per_param("fp32", 0, 1, True) == 16
    assert costlib.bytes_per_param("fp32", 3, 4, False) == 20 / 4  # ZeRO's fp32 master copy


def test_enumeration_respects_deepspeed_rules() -> None:
    cfg = load_config("transformer_7b")
    cands = enumerate_candidates(cfg, 64, 8)
    assert cands
    for c in cands:
        assert c.tp * c.pp * c.dp == 64 and c.tp <= 8 and cfg.model.heads % c.tp == 0
        assert cfg.taper.multiple % c.tp == 0
        assert c.pp == 1 or c.zero <= 1  # DeepSpeed: pipeline only with ZeRO 0/1
        assert c.micro_batch_size * c.grad_accum * c.dp == cfg.train.global_batch_size


def test_enumeration_keeps_a_whole_model_first_pass_unpipelined() -> None:
    """Hope's teach signal needs a first pass of the whole model: its presets get pp = 1 only
    (the config check refuses pp > 1), while association keeps the pipeline layouts."""
    teach = load_config("hope_attention_440m")
    assert teach.model.hope.update == "teach"
    assert {c.pp for c in enumerate_candidates(teach, 64, 8)} == {1}
    association = teach.with_overrides(["--model.hope.update", "association"])
    assert max(c.pp for c in enumerate_candidates(association, 64, 8)) > 1


def test_plan_7b_on_64_gpus_fits_and_fills_templates() -> None:
    cfg = load_config("transformer_7b")
    dev = costlib.get_device("h100")
    cap = 0.9 * 80 * costlib.GiB
    ranked, rejected = plan(cfg, 64, dev, cap)
    assert ranked and rejected  # some layouts do not fit 80 GiB
    assert all(c.mem_gib * costlib.GiB <= cap * (1 + 1e-9) for c in ranked)
    assert [c.step_s for c in ranked] == sorted(c.step_s for c in ranked)
    best = ranked[0]
    assert 0.2 < best.mfu < 0.7
    ds = ds_config(cfg, best, dev)
    assert ds["train_batch_size"] == cfg.train.global_batch_size
    assert ds["zero_optimization"]["stage"] == best.zero
    text = fill_slurm("transformer_7b", best, 8, 8, "ds_configs/cluster_7b.json")
    assert "{{" not in text and f"--parallel.tp {best.tp}" in text


def test_plan_cli_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tapered_megatron.plan", "--config", "transformer_1.3b",
         "--gpus", "16", "--gpu-mem", "40", "--nodes", "2", "--json", "--top", "3"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    obj = json.loads(out.stdout.strip().splitlines()[-1])
    assert obj["best"] and len(obj["candidates"]) == 3 and obj["reasoning"]
    best = obj["best"]
    assert best["tp"] * best["pp"] * best["dp"] == 16
    assert best["mem_gib"] <= 0.9 * 40


@pytest.mark.parametrize("name", ["cluster_7b", "cluster_30b"])
def test_cluster_ds_configs_are_valid(name: str, monkeypatch) -> None:
    """The shipped SLURM script's command line (preset, overrides, world size) and its DeepSpeed
    config pass the launcher's own consistency checks (as on the GPU nodes they target: bf16
    allowed), and the batch arithmetic holds: ``train_batch_size = micro x accumulation x dp``
    with ``dp = world / (tp x pp)``."""
    import re
    import shlex
    from pathlib import Path

    from tapered_megatron.training import launch

    root = Path(__file__).resolve().parents[1]
    ds = json.loads((root / "ds_configs" / f"{name}.json").read_text())
    sbatch = (root / "scripts" / f"slurm_{name}.sbatch").read_text()
    assert "{{" not in sbatch and f"ds_configs/{name}.json" in sbatch
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", sbatch).group(1))
    per_node = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", sbatch).group(1))
    command = sbatch.split("exec python pretrain/main.py", 1)[1].split('"$@"', 1)[0]
    args = shlex.split(command.replace("\\\n", " "))
    preset = args[args.index("--config") + 1]
    taken = {k + d for k, a in enumerate(args) if a in ("--config", "--ds_config") for d in (0, 1)}
    cfg = load_config(preset, [a for k, a in enumerate(args) if k not in taken])
    world = nodes * per_node
    monkeypatch.setattr(launch, "_on_cpu", lambda: False)
    _, layout = launch.resolve(cfg, dict(ds), world)
    dp = world // (cfg.parallel.tp * cfg.parallel.pp)
    assert layout.dp == dp and layout.world_size == world
    assert ds["train_batch_size"] == cfg.train.global_batch_size
    assert ds["train_batch_size"] == (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * dp
    )
    assert ds["zero_optimization"]["stage"] in (0, 1, 2, 3)


@pytest.mark.parametrize("preset", SCALED)
def test_planner_and_balancer_choose_the_same_stages(preset) -> None:
    """A run launched with the planner's overrides gets the planner's stage boundaries from the
    trainer's balancer (same device and memory cap): one cost model, TP communication included.
    PP 4 and 8 on 64 GPUs, whole layers and sub-layers, with and without recomputation (Hope
    under association: its teach signal runs without a pipeline)."""
    cfg = load_config(preset)
    if cfg.model.arch == "hope_attention":
        cfg = cfg.with_overrides(["--model.hope.update", "association"])
    dev = costlib.get_device("h100")
    cap = 0.9 * 80 * costlib.GiB
    tp = cfg.parallel.tp
    checked = 0
    for pp in (4, 8):
        dp = 64 // (tp * pp)
        for rc, unit in (("none", "layer"), ("selective", "layer"), ("full", "sublayer")):
            gas = cfg.train.global_batch_size // dp
            cand = evaluate(cfg, Candidate(tp, pp, dp, 1, 1, gas, rc, unit), dev, cap)
            if isinstance(cand, str):  # does not fit: nothing to compare
                continue
            run = cfg.with_overrides(overrides(cfg, cand))
            parts = partition(
                run, pp, run.parallel.partition, gas, device=dev, gpu_mem=cap / costlib.GiB,
                dp=dp, zero_stage=cand.zero,
            )  # fmt: skip
            assert tuple(parts) == cand.parts, (pp, rc, unit)
            checked += 1
    assert checked >= 3


def test_zero3_unit_peak_holds_its_gradient() -> None:
    """Under ZeRO-3 a unit's transient adds its full gradient (before DeepSpeed copies it into
    the reduce bucket; the head's is already in its activations); the model state is divided
    over the ranks (fp32 master included)."""
    cfg = load_config("quickstart")
    dev = costlib.get_device("cpu")
    base = costlib.RunShape(micro_batch_size=1, seq_len=64, dp=4, precision="fp32")
    z2 = costlib.unit_costs(cfg, base, dev)
    z3 = costlib.unit_costs(cfg, replace(base, zero_stage=3), dev)
    for u, a, b in zip(units(cfg), z2, z3, strict=True):
        grads = 0 if a.kind == "head" else 4
        assert b.peak - a.peak == pytest.approx(a.params * grads)
        # weights, grads, master, Adam; buffers (RoPE's tables) whole
        assert b.static - costlib.buffer_bytes(u) == pytest.approx(a.params * 20 / 4)


@pytest.mark.parametrize(
    ("prefetch", "reuse", "most"),
    [
        (0, 0, 10),  # no prefetch, nothing kept: one unit at a time
        (0, 10**9, 20),  # every unit's backward within the reuse distance: all kept
        (0, 10, 10),  # the last two kept (2 x later < 10), the first alone is 10
        (5, 0, 20),  # the prefetch walks past held units into the backward: all kept
    ],
)
def test_zero3_gathered_replays_deepspeeds_coordinator(
    prefetch: int, reuse: int, most: int
) -> None:
    z = costlib.Zero3(prefetch_bucket_size=prefetch, max_reuse_distance=reuse)
    assert costlib.zero3_gathered([10, 5, 3, 2], z) == most


def test_zero3_gathered_grows_to_the_live_parameter_cap() -> None:
    """Each fetch prefetches up to a bucket ahead, so the gathered weights grow to
    ``max_live_parameters`` (plus the running unit and the last fetch), the whole model below
    it."""
    z = costlib.Zero3(prefetch_bucket_size=30, max_reuse_distance=0)
    assert costlib.zero3_gathered([10.0] * 48, z) == 480
    capped = replace(z, max_live_parameters=100)
    assert 100 <= costlib.zero3_gathered([10.0] * 48, capped) <= 100 + 10 + 30


def test_zero3_settings_are_the_repo_config() -> None:
    """The planner's default ZeRO-3 sizes are ds_configs/zero3.json's; a config without them
    gets DeepSpeed's defaults; a written ZeRO-3 config carries them."""
    ds = json.loads((PRESET_DIR.parents[1] / "ds_configs" / "zero3.json").read_text())
    assert costlib.Zero3.from_ds_config(ds) == costlib.Zero3()
    assert costlib.Zero3.from_ds_config({}).reduce_bucket_size == 5 * 10**8
    cfg = load_config("transformer_760m")
    best = Candidate(1, 1, 8, 3, 1, 1, "none", "layer")
    out = ds_config(cfg, best, costlib.get_device("h100"))
    assert costlib.Zero3.from_ds_config(out) == costlib.Zero3()


def test_zero3_stage_terms() -> None:
    """The stage term: the reduce bucket (whole on a GPU, the written part on a CPU), the kept
    weights and the bucket's interleaved copy, or the optimizer step's sub-group temporaries
    and the first unit's weights (gathered through the step) when larger."""
    cfg = load_config("transformer_760m", ["--model.layers", "2", "--model.seq_len", "64"])
    cpu = costlib.get_device("cpu")
    shape = costlib.RunShape(
        micro_batch_size=1, seq_len=64, dp=4, precision="fp32", zero_stage=3, pipeline=False
    )
    costs = costlib.unit_costs(cfg, shape, cpu)
    total = sum(c.params for c in costs)
    z = shape.zero3
    got = costlib.zero3_stage_bytes(cfg, costs, shape, cpu)
    kept = total  # a small model: the prefetch keeps every unit gathered into the backward
    assert got == pytest.approx(4 * z.reduce_bucket_size + 4 * (kept + z.reduce_bucket_size))
    big = replace(shape, zero3=replace(z, reduce_bucket_size=10**9))
    # a bucket larger than the model: a CPU holds the model's worth, a GPU all of it
    cpu_big = costlib.zero3_stage_bytes(cfg, costlib.unit_costs(cfg, big, cpu), big, cpu)
    assert cpu_big == pytest.approx(4 * total + 4 * (kept + total))
    gpu = replace(costlib.get_device("h100"), precision="fp32")
    gpu_big = costlib.zero3_stage_bytes(cfg, costlib.unit_costs(cfg, big, gpu), big, gpu)
    assert gpu_big == pytest.approx(4 * 10**9 + 4 * (kept + total))
    # nothing kept, a large sub-group: the optimizer step (fp32 gradient + 2 AdamW temporaries
    # on a CPU, 1 on a GPU) dominates
    opt = replace(shape, dp=1, zero3=replace(z, max_reuse_distance=0, sub_group_size=10**9))
    for dev, temps in ((cpu, 2), (gpu, 1)):
        c = costlib.unit_costs(cfg, opt, dev)
        units = sum(u.act for u in c) + costlib.units_transient(c)
        step = total * 4 * (1 + temps)
        first = 4 * c[0].local_params  # the first unit stays gathered through the step
        assert costlib.zero3_stage_bytes(cfg, c, opt, dev) == pytest.approx(
            4 * z.reduce_bucket_size + first + step - units
        )


def test_teach_first_pass_costs_one_static_forward_per_unit() -> None:
    """The cost model adds to every unit of a ``hope.update teach`` run the forward of its
    first pass: the unit at static CMS levels (``hope.lr 0``), one pass of the three a
    training step of that static unit costs."""
    shape = ["--model.arch", "hope_attention", "--model.layers", "4"]
    dev = costlib.get_device("cpu")
    run = costlib.RunShape(micro_batch_size=2, seq_len=256, precision="fp32", pipeline=False)
    costs = {
        key: costlib.unit_costs(load_config("quickstart", [*shape, *extra]), run, dev)
        for key, extra in (
            ("association", []),
            ("teach", ["--model.hope.update", "teach"]),
            ("static", ["--model.hope.lr", "0"]),
        )
    }
    for a, t, s in zip(costs["association"], costs["teach"], costs["static"], strict=True):
        assert t.time - a.time == pytest.approx(s.time / 3)
        assert (t.static, t.act, t.peak) == (a.static, a.act, a.peak)


def test_recompute_modes_in_the_cost_model() -> None:
    """Per block: ``selective`` keeps less than ``none`` (the cores' bytes, TP-sharded, and
    RoPE's tables, which the cores make) and more than ``full``, and costs one more forward of
    the cores (``full``: of the whole block)."""
    cfg = load_config("titans_7b")
    dev = costlib.get_device("h100")
    shape = costlib.RunShape(micro_batch_size=1, seq_len=cfg.model.seq_len, tp=4)
    none, sel, full = (
        costlib.unit_costs(cfg, replace(shape, recompute=rc), dev)
        for rc in ("none", "selective", "full")
    )
    from tapered_megatron.models import units

    for u, a, b, c in zip(units(cfg, "layer"), none, sel, full, strict=True):
        counts = u.counts(2)
        if u.kind != "layer":
            assert a == b
            continue
        assert counts.core_bytes > 0 and counts.core_flops > 0
        rope = costlib.rope_table_bytes(u)
        assert rope > 0
        assert b.act == pytest.approx(a.act - counts.core_bytes * shape.tokens / 4 - rope)
        assert c.act < b.act < a.act and a.time < b.time < c.time


def test_dp_communication_overlaps_where_deepspeed_overlaps_it() -> None:
    """ZeRO-1/2/3 without pipeline hide the gradient reduce behind backward but for the last
    bucket; ZeRO-2 reduces every micro-batch; ZeRO-0 and the pipeline engine hide nothing."""
    args = dict(stage_params=2e9, dp=16, micro_batches=4, elem=2.0, bw=50e9)
    one = 15 / 16 * 2e9 * 2.0 / 50e9
    z2 = costlib.dp_comm(zero_stage=2, pipeline=False, backward_s=1.0, compute_s=1.5, **args)
    assert z2.total == pytest.approx(4 * one + one)  # a reduce per micro-batch, one all-gather
    bucket = costlib.reduce_bucket_elems(2e9)
    assert bucket == 250_000_000
    assert z2.exposed == pytest.approx(one + 4 * one * bucket / 2e9)
    z1 = costlib.dp_comm(zero_stage=1, pipeline=False, backward_s=1.0, compute_s=1.5, **args)
    assert z1.total == pytest.approx(2 * one) and z1.overlapped == pytest.approx(one * 7 / 8)
    short = costlib.dp_comm(zero_stage=2, pipeline=False, backward_s=0.01, compute_s=0.015, **args)
    assert short.overlapped == pytest.approx(4 * 0.01)  # no more than the backward
    for zero, pipe in ((0, False), (1, True)):
        c = costlib.dp_comm(zero_stage=zero, pipeline=pipe, backward_s=1.0, compute_s=1.5, **args)
        assert c.overlapped == 0 and c.exposed == pytest.approx(2 * one)
    for pipe in (False, True):  # BF16_Optimizer: an all-reduce after backward, then a gather
        c = costlib.dp_comm(
            zero_stage=1, pipeline=pipe, backward_s=1.0, compute_s=1.5, bf16_optimizer=True, **args
        )
        assert c.overlapped == 0 and c.exposed == pytest.approx(3 * one)


def test_planner_charges_bf16_zero1_as_bf16_optimizer() -> None:
    """A bf16 ZeRO-1 candidate runs DeepSpeed's BF16_Optimizer (fp32 accumulation): its DP
    communication is three reduce-scatter-sized units, none hidden; fp32 ZeRO-1 keeps two."""
    cfg = load_config("transformer_1.3b")
    cap = 0.9 * 80 * costlib.GiB
    cand = Candidate(2, 1, 8, 1, 1, 8, "none", "layer")
    bf16 = evaluate(cfg, cand, costlib.get_device("h100", precision="bf16"), cap)
    fp32 = evaluate(cfg, cand, costlib.get_device("h100", precision="fp32"), cap)
    assert "BF16_Optimizer" in bf16.dp_comm and bf16.breakdown["dp_overlapped_s"] == 0
    assert "BF16_Optimizer" not in fp32.dp_comm and fp32.breakdown["dp_overlapped_s"] > 0
    # the same bytes per unit (bf16 gradients are half fp32's): 3 units against 2
    ratio = bf16.breakdown["dp_comm_s"] / fp32.breakdown["dp_comm_s"]
    assert ratio == pytest.approx(3 / 2 * 2 / 4)


def test_planner_writes_overlapped_zero_configs() -> None:
    """A ZeRO-2 candidate: its DeepSpeed config overlaps the reduce with the planner's bucket
    size, the memory prediction holds its two reduce buckets, the breakdown names the overlap;
    bf16 ZeRO-1 holds no buckets."""
    cfg = load_config("transformer_1.3b")
    dev = costlib.get_device("h100")
    cap = 0.9 * 80 * costlib.GiB
    cand = evaluate(cfg, Candidate(2, 1, 8, 2, 1, 8, "none", "layer"), dev, cap)
    z = ds_config(cfg, cand, dev)["zero_optimization"]
    assert z["overlap_comm"] and z["contiguous_gradients"]
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == cand.reduce_bucket
    assert cand.reduce_bucket == costlib.reduce_bucket_elems(count_model(cfg).params_total / 2)
    b = cand.breakdown
    assert 0 < b["dp_overlapped_s"] < b["dp_comm_s"] and "overlap_comm" in cand.dp_comm
    z0 = evaluate(cfg, replace(cand, zero=0), dev, cap)
    z1 = evaluate(cfg, replace(cand, zero=1), dev, cap)
    assert z0.breakdown["dp_overlapped_s"] == 0
    local = sum(u.local_params for u in costlib.unit_costs(cfg, costlib.RunShape(tp=2), dev))
    state = local * (costlib.bytes_per_param("bf16", 2, 8, False) - 16)  # ZeRO-2 vs ZeRO-0
    buckets = 2 * 2 * cand.reduce_bucket  # ZeRO-2 reduces in the model's dtype
    assert (cand.mem_gib - z0.mem_gib) * costlib.GiB == pytest.approx(state + buckets, rel=1e-6)
    # bf16 ZeRO-1 runs DeepSpeed's BF16_Optimizer: no reduce buckets, only the state differs
    # (its reduce's flat copies come after backward, when the activations are gone)
    state = local * (costlib.bytes_per_param("bf16", 1, 8, False) - 16)
    assert (z1.mem_gib - z0.mem_gib) * costlib.GiB == pytest.approx(state, rel=1e-6)


def test_layout_flag_predicts_the_printed_pick(capsys) -> None:
    """``--layout`` takes a label as the table prints it and predicts exactly what
    :func:`evaluate` predicts for that candidate; ``--json`` carries it as ``best``."""
    from tapered_megatron.planning.planner import main, parse_layout

    label = "tp2 sp pp4 dp2 zero1 mbs2 gas8 rc-selective sublayer"
    c = parse_layout(label)
    assert c.label == label
    cfg = load_config("transformer_1.3b")
    dev = costlib.get_device("h100", mem_bytes=40 * costlib.GiB, gpus_per_node=8)
    want = evaluate(cfg, c, dev, 0.9 * 40 * costlib.GiB)
    argv = ["--config", "transformer_1.3b", "--gpus", "16", "--gpu-mem", "40", "--layout"]
    assert main([*argv, label, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["best"]["step_s"] == pytest.approx(want.step_s, rel=1e-12)
    assert obj["best"]["parts"] == list(want.parts) and obj["candidates"] == [obj["best"]]
    assert any(line.startswith(f"layout: {label}: predicted") for line in obj["reasoning"])
    assert main([*argv, label]) == 0
    assert f"   1 {label}" in capsys.readouterr().out


def test_layout_flag_takes_a_scheduled_pick() -> None:
    """A label with a pipeline schedule (what ``--schedules`` prints) reads back: the 1F1B
    candidate replayed under that schedule, as the search's :func:`with_schedule` gives it."""
    from tapered_megatron.planning.planner import (
        VIRTUAL_DP_COMM,
        evaluate_layout,
        parse_layout,
        with_schedule,
    )

    label = "tp1 pp2 zbv v2 dp8 zero1 mbs4 gas4 rc-none layer"
    c = parse_layout(label)
    assert (c.schedule, c.virtual_stages, c.label) == ("zbv", 2, label)
    cfg = load_config("transformer_1.3b")
    dev = costlib.get_device("h100", mem_bytes=80 * costlib.GiB, gpus_per_node=8)
    cap = 0.9 * 80 * costlib.GiB
    one = evaluate_layout(cfg, label, 16, dev, cap)
    want = with_schedule(
        cfg,
        evaluate(cfg, replace(c, schedule="1f1b", virtual_stages=1), dev, cap),
        dev,
        cap,
        "zbv",
        2,
    )
    assert one.label == label and one.step_s == pytest.approx(want.step_s, rel=1e-12)
    # the runtime reduces after its schedule: the DP communication is all exposed
    assert one.dp_comm == VIRTUAL_DP_COMM and one.breakdown["dp_overlapped_s"] == 0
    assert (
        one.breakdown["pipeline_s"]
        != evaluate(cfg, replace(c, schedule="1f1b", virtual_stages=1), dev, cap).breakdown[
            "pipeline_s"
        ]
    )


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ("tp2 pp4", "is not a layout"),
        ("tp2 pp4 dp4 zero1 mbs1 gas8 rc-none layer", "not --gpus 16"),
        ("tp2 pp4 dp2 zero3 mbs1 gas8 rc-none layer", "ZeRO 0-1 only"),
        ("tp3 pp1 dp5 zero1 mbs1 gas8 rc-none layer", "not --gpus 16"),
    ],
)
def test_layout_flag_refuses_a_bad_layout(layout: str, why: str, capsys) -> None:
    from tapered_megatron.planning.planner import main

    argv = ["--config", "transformer_1.3b", "--gpus", "16", "--gpu-mem", "40", "--layout"]
    assert main([*argv, layout]) == 2
    err = capsys.readouterr().err
    assert why in err and len(err.strip().splitlines()) == 1
