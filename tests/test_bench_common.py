"""scripts/bench_common.py: the benchmarks' interleaved timing loop and run stamp."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "bench_common", Path(__file__).resolve().parents[1] / "scripts" / "bench_common.py"
)
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def _recording(names: str) -> tuple[dict, list[str]]:
    calls: list[str] = []
    return {k: (lambda k=k: calls.append(k)) for k in names}, calls


def test_interleaved_orders_repeats_and_synchronises():
    steps, calls = _recording("abc")
    syncs: list[int] = []
    times = bench.interleaved(steps, 2, order="alternate", repeats=2, sync=lambda: syncs.append(1))
    assert calls == list("aabbcc") + list("ccbbaa")
    assert len(syncs) == 2 * len(calls)  # before and after each timed call
    assert {k: len(v) for k, v in times["wall"].items()} == {"a": 4, "b": 4, "c": 4}

    steps, calls = _recording("abcd")
    ticks = iter(range(1000))
    times = bench.interleaved(steps, 3, clocks={"n": lambda: float(next(ticks))})
    assert calls == list("abcd") * 3
    assert all(t == [1.0] * 3 for t in times["n"].values())  # one reading before, one after


def test_interleaved_shuffle_is_a_fresh_permutation_each_round_and_seeded():
    steps, calls = _recording("abcdef")
    bench.interleaved(steps, 8, order="shuffle", seed=1)
    rounds = [calls[i : i + 6] for i in range(0, len(calls), 6)]
    assert all(sorted(r) == list("abcdef") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    again, calls2 = _recording("abcdef")
    bench.interleaved(again, 8, order="shuffle", seed=1)
    assert calls2 == calls


def test_stamp_names_commit_machine_and_date():
    s = bench.stamp("NVIDIA H200")
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", s["commit"])
    assert s["machine"].startswith("NVIDIA H200, ") and "cpus" in s["machine"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", s["date"])
