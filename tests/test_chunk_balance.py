"""Virtual-stage balancer: the schedule replay (torch's order), memory in flight, the P x v cut."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.chunks import ChunkSetup, balance_chunks, evaluate_chunks
from tapered_megatron.planning.schedule import (
    SCHEDULES,
    TORCH_SCHEDULES,
    ChunkTimes,
    pipeline_order,
    schedule_problem,
    simulate,
    stage_ranks,
)

LAYOUTS = [("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("zero_bubble", 2)]


def units(times: list[float], act: float = 1.0, static: float = 0.0) -> tuple:
    """Synthetic units with the given times (embedding first, head last)."""
    kinds = ["embedding"] + ["layer"] * (len(times) - 2) + ["head"]
    return tuple(
        costlib.UnitCost(f"u{i}", k, i, 1, 1.0, t, 0.0, 1.0, static, act, 0.0)
        for i, (k, t) in enumerate(zip(kinds, times, strict=True))
    )


@pytest.mark.parametrize(("schedule", "v"), LAYOUTS)
def test_every_pass_once_on_its_rank(schedule: str, v: int) -> None:
    pp, m = 2, 4
    order = pipeline_order(schedule, pp, v, m)
    ranks = stage_ranks(schedule, pp, v)
    seen = [a for acts in order for a in acts]
    assert len(seen) == len(set(seen))
    for r, acts in enumerate(order):
        assert all(ranks[s] == r for _, s, _ in acts)
    for s, mb in itertools.product(range(pp * v), range(m)):
        assert ("F", s, mb) in seen
        assert ("B", s, mb) in seen or {("I", s, mb), ("W", s, mb)} <= set(seen)


@pytest.mark.parametrize("pp", [2, 4])
def test_equal_chunks_match_the_closed_forms(pp: int) -> None:
    m, t = 8, 3.0
    one = simulate("1f1b", pp, 1, m, ChunkTimes.split([t] * pp), [1.0] * pp)
    assert one.makespan == pytest.approx((m + pp - 1) * t)
    assert list(one.live) == costlib.inflight(pp, m)  # DeepSpeed's 1F1B holds min(P - j, M)
    v = 2
    inter = simulate("interleaved", pp, v, m, ChunkTimes.split([t / v] * pp * v), [1.0] * pp * v)
    assert inter.makespan == pytest.approx(m * t + (pp - 1) * t / v)  # bubble shrinks by v
    assert inter.rank_busy == pytest.approx([m * t] * pp)


def test_zero_bubble_fills_the_bubble_with_weight_passes() -> None:
    pp, m, t = 4, 8, 3.0
    ones = [1.0] * pp * 2
    chunks = ChunkTimes.split([t / 2] * pp * 2)
    inter = simulate("interleaved", pp, 2, m, chunks, ones).makespan
    for schedule in ("zbv", "zero_bubble"):
        sim = simulate(schedule, pp, 2, m, chunks, ones)
        assert sim.makespan < inter
        # activations stay until the weight pass: every rank holds P micro-batches of its two
        # chunks at its worst moment (ZB-V's peak is 1F1B's first stage's, arXiv 2401.10241)
        assert sim.peak_act == (2.0 * pp,) * pp


def test_balancer_cuts_by_rank_sums_and_finds_the_optimum() -> None:
    # wide early layers, narrow late ones: the min-max chunk cut leaves rank sums uneven
    times = [0.5, 6, 6, 5, 4, 3, 2, 2, 1, 1, 1, 0.5]
    setup = ChunkSetup(units(times), "interleaved", 2, 2, 4)
    plans = balance_chunks(setup)
    best = plans["balancer"].sim.makespan
    assert best < plans["solver"].sim.makespan and best < plans["uniform"].sim.makespan
    n = len(times)
    brute = min(
        evaluate_chunks(setup, [0, *cuts, n], "x").sim.makespan
        for cuts in itertools.combinations(range(1, n), 3)
    )
    assert best == pytest.approx(brute)


def test_balancer_respects_the_memory_cap() -> None:
    times = [0.5, 4, 4, 3, 3, 2, 2, 1, 1, 0.5]
    free = ChunkSetup(units(times, act=1.0, static=2.0), "zbv", 2, 2, 4)
    unconstrained = balance_chunks(free)["balancer"]
    cap = max(unconstrained.rank_mem) - 0.5
    capped = balance_chunks(ChunkSetup(free.costs, "zbv", 2, 2, 4, cap=cap))["balancer"]
    assert capped.fits and max(capped.rank_mem) <= cap
    assert capped.sim.makespan >= unconstrained.sim.makespan


@pytest.mark.parametrize(
    ("schedule", "v", "m", "needle"),
    [
        ("zbv", 3, 8, "virtual_stages 2"),
        ("dualpipev", 2, 2, "at least 4 micro-batches"),
        ("interleaved", 1, 8, "virtual_stages 2 or more"),
        ("1f1b", 2, 8, "virtual_stages 1"),
        ("interleaved", 2, 5, "multiple of"),
        ("gpipe", 1, 8, "unknown pipeline schedule"),
    ],
)
def test_schedule_problems_are_named(schedule: str, v: int, m: int, needle: str) -> None:
    assert needle in (schedule_problem(schedule, 2, v, m) or "")
    assert all(schedule_problem(s, 2, v, 8) is None for s, v in LAYOUTS)
    assert set(SCHEDULES) == {s for s, _ in LAYOUTS} == set(TORCH_SCHEDULES)


def test_cli_chunk_table(capsys: pytest.CaptureFixture[str]) -> None:
    from tapered_megatron.planning.balance import main

    args = ["--config", "quickstart", "--pp", "2", "--micro-batches", "4"]
    assert main([*args, "--schedule", "interleaved", "--virtual-stages", "2"]) == 0
    table = capsys.readouterr().out
    assert "pipeline chunks [balancer] schedule=interleaved pp=2 v=2" in table
    assert "(predicted)" in table and table.count("\n    3    1 ") == 1  # chunk 3 on rank 1
    assert main([*args, "--schedule", "zbv", "--virtual-stages", "2", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["predicted"]["balancer"]["ranks"] == [0, 1, 1, 0]
    assert main([*args, "--schedule", "zbv", "--virtual-stages", "3"]) == 1
    assert "virtual_stages 2" in capsys.readouterr().err


@pytest.mark.slow
def test_local_search_against_exhaustive_search() -> None:
    """docs/balancer.md: on 60 random small cases the balancer finds the exhaustive optimum of
    the replayed makespan in all but a few, and is never more than 3 % above it."""
    import random

    rng = random.Random(0)
    gaps = []
    for _ in range(60):
        n = rng.randint(6, 12)
        schedule = rng.choice(["interleaved", "zbv", "dualpipev", "zero_bubble"])
        times = [rng.choice([0.5, 1, 2, 3, 5, 8]) for _ in range(n)]
        setup = ChunkSetup(units(times), schedule, 2, 2, 4)
        got = balance_chunks(setup)["balancer"].sim.makespan
        best = min(
            evaluate_chunks(setup, [0, *cuts, n], "x").sim.makespan
            for cuts in itertools.combinations(range(1, n), 3)
        )
        gaps.append(got / best - 1)
    assert sum(g > 1e-9 for g in gaps) <= 4 and max(gaps) < 0.03, gaps


@pytest.mark.slow
def test_planner_replays_schedules_on_a_pipeline_layout() -> None:
    from tapered_megatron.config import load_config
    from tapered_megatron.planning.planner import Candidate, evaluate, overrides, with_schedule

    cfg = load_config("transformer_1.3b")
    dev = costlib.get_device("h100")
    cap = 72 * costlib.GiB
    c = evaluate(cfg, Candidate(1, 2, 1, 1, 1, 8, "none", "layer"), dev, cap)
    assert not isinstance(c, str)
    one = with_schedule(cfg, c, dev, cap, "1f1b", 1)  # the trainer's stages, replayed
    inter = with_schedule(cfg, c, dev, cap, "interleaved", 2)
    assert not isinstance(one, str) and not isinstance(inter, str)
    assert one.parts == c.parts and one.step_s == pytest.approx(c.step_s, rel=0.02)
    # a runtime cost per action moves the closed form as it moves the replay
    slow = replace(dev, schedule_overhead={"1f1b": 5e-3})
    cs = evaluate(cfg, Candidate(1, 2, 1, 1, 1, 8, "none", "layer"), slow, cap)
    ones = with_schedule(cfg, cs, slow, cap, "1f1b", 1)
    assert not isinstance(cs, str) and not isinstance(ones, str)
    grown = cs.breakdown["pipeline_s"] - c.breakdown["pipeline_s"]
    assert grown == pytest.approx(2 * 5e-3 * (8 + 1), rel=1e-6)  # (m + pp - 1) F/B pairs
    assert ones.step_s == pytest.approx(cs.step_s, rel=0.02)
    assert inter.step_s < one.step_s and len(inter.parts) == 5  # 2 ranks x 2 chunks
    assert overrides(cfg, inter)[-4:] == [
        "--parallel.schedule", "interleaved", "--parallel.virtual_stages", "2",
    ]  # fmt: skip
    assert "--parallel.schedule" not in overrides(cfg, one)
    recomputed = with_schedule(cfg, replace(c, recompute="full"), dev, cap, "zbv", 2)
    assert isinstance(recomputed, str) and "not supported" in recomputed


def test_device_runtime_constants_enter_the_prediction() -> None:
    from tapered_megatron.config import load_config
    from tapered_megatron.planning.balance import chunk_setup

    cfg = load_config("quickstart", ["--parallel.pp", "2", "--parallel.schedule", "zbv"])
    cpu = costlib.get_device("cpu")
    per_action, m = 2e-3, 8
    slow = replace(
        cpu, schedule_overhead={"zbv": per_action}, p2p_latency_s=1e-4, split_backward=(1.0, 1.0)
    )
    plain, costly = (chunk_setup(cfg, 2, 2, "zbv", m, device=d) for d in (cpu, slow))
    assert (plain.action, costly.action) == (0.0, per_action)
    parts = balance_chunks(plain)["balancer"].parts
    a, b = (evaluate_chunks(s, parts, "x") for s in (plain, costly))
    order = pipeline_order("zbv", 2, 2, m)
    # every compute action of a rank carries the runtime's cost, and a split backward costing
    # two whole backwards adds one more backward (2/3 of a chunk's time) per micro-batch
    extra = [
        len(acts) * per_action + m * 2 / 3 * t for acts, t in zip(order, a.rank_times, strict=True)
    ]
    grown = [y - x for x, y in zip(a.sim.rank_busy, b.sim.rank_busy, strict=True)]
    assert grown == pytest.approx(extra)
    assert b.sim.makespan - a.sim.makespan >= min(extra) - 1e-12
    assert costlib.p2p_time(1e6, 1e9, slow) == pytest.approx(1e-4 + 1e-3)
    assert costlib.optimizer_time(1e6, 16.0, cpu) == pytest.approx(2 * 16e6 / cpu.mem_bw)
