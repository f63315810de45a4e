"""Properties of the taper plan: shape, rounding, pinned ends, exact budget, rejection."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tapered_megatron.taper import TaperError, make_plan, raw_schedule

RATIOS = [(1.25, 0.75), (1.375, 0.625), (1.5, 0.5), (1.625, 0.375), (1.75, 0.25), (1.0, 1.0)]
STEP = [(1.5, 1.0, 0.5), (0.75, 1.5, 0.75), (0.5, 1.0, 1.5), (1.25, 1.0, 0.75)]


def _is_monotone(widths: tuple[int, ...], increasing: bool) -> bool:
    pairs = itertools.pairwise(widths)
    return all((b >= a) if increasing else (b <= a) for a, b in pairs)


@st.composite
def plans(draw):
    schedule = draw(st.sampled_from(["uniform", "linear", "cosine", "sigmoid", "step"]))
    ratios = draw(st.sampled_from(STEP if schedule == "step" else RATIOS))
    layers = draw(st.integers(3 if schedule == "step" else 2, 128))
    multiple = draw(st.sampled_from([16, 64, 128, 256, 512]))
    d_ff = draw(st.integers(16, 8192))
    reverse = draw(st.booleans())
    return schedule, ratios, layers, multiple, d_ff, reverse


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_plan_properties(args):
    schedule, ratios, layers, multiple, d_ff, reverse = args
    unit = multiple
    raw = raw_schedule(schedule, layers, d_ff, ratios if schedule != "uniform" else (1.0, 1.0))
    if min(raw) < unit:
        with pytest.raises(TaperError, match="rounding unit"):
            make_plan(layers, d_ff, schedule, ratios, multiple, reverse=reverse)
        return
    plan = make_plan(layers, d_ff, schedule, ratios, multiple, reverse=reverse)
    w = plan.widths
    assert len(w) == layers and plan.unit == unit
    assert all(x % unit == 0 and x >= unit for x in w), "widths are positive multiples of the unit"
    raw_oriented = raw[::-1] if reverse else raw
    assert abs(w[0] - raw_oriented[0]) < unit and abs(w[-1] - raw_oriented[-1]) < unit, (
        "ends pinned"
    )
    monotone_schedule = schedule != "step" or list(ratios) == sorted(ratios, reverse=True)
    if monotone_schedule:
        assert _is_monotone(w, increasing=reverse)
    budget = layers * d_ff
    assert plan.budget == budget and plan.deviation == sum(w) - budget
    rem = budget % unit
    assert abs(plan.deviation) == min(rem, unit - rem), "exact budget, else the minimal deviation"


@pytest.mark.parametrize("layers,d_ff", [(24, 4096), (24, 3584), (32, 11008), (7, 100), (128, 688)])
def test_cosine_matches_formula_within_one_unit(layers, d_ff):
    plan = make_plan(layers, d_ff, "cosine", (1.5, 0.5), 16)
    for l, w in enumerate(plan.widths):
        x = l / (layers - 1)
        formula = 0.5 * d_ff + (1.5 * d_ff - 0.5 * d_ff) / 2 * (1 + math.cos(math.pi * x))
        assert abs(w - formula) <= plan.unit
    assert plan.widths[0] == round(1.5 * d_ff / 16) * 16 or abs(plan.widths[0] - 1.5 * d_ff) < 16


def test_reverse_is_mirror_and_uniform_is_flat():
    fwd = make_plan(24, 4096, "cosine", (1.5, 0.5))
    rev = make_plan(24, 4096, "cosine", (1.5, 0.5), reverse=True)
    assert rev.widths == fwd.widths[::-1]
    assert make_plan(12, 4096, "uniform").widths == (4096,) * 12


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(layers=8, d_ff=32, ratios=(1.9, 0.1)), "rounding unit"),
        (dict(layers=8, d_ff=512, ratios=(1.5, 0.6)), "must be 2"),
        (dict(layers=8, d_ff=512, ratios=(0.5, 1.5)), "r_start >= r_end"),
        (dict(layers=8, d_ff=512, schedule="step", ratios=(1.5, 1.0, 1.0)), "average to 1"),
        (dict(layers=8, d_ff=512, schedule="zigzag"), "unknown schedule"),
    ],
)
def test_rejections_name_the_limit(kwargs, match):
    with pytest.raises(TaperError, match=match):
        make_plan(**kwargs)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tapered_megatron.taper", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_table_json_and_plot(tmp_path):
    base = ["--layers", "24", "--d-ff", "4096", "--schedule", "cosine", "--ratio", "1.5", "0.5"]
    table = _cli(*base)
    assert table.returncode == 0 and "deviation=+0" in table.stdout
    out = _cli(*base, "--json", "--tp", "2", "--multiple", "64")
    obj = json.loads(out.stdout)
    assert obj["sum"] == obj["budget"] == 24 * 4096 and obj["deviation"] == 0
    assert obj["unit"] == 64 and all(w % 64 == 0 for w in obj["widths"])
    assert json.loads(_cli(*base, "--json", "--multiple", "64").stdout) == obj  # tp-independent
    odd = _cli(*base, "--tp", "3", "--multiple", "64")
    assert odd.returncode == 2 and "--tp 3 must divide --multiple 64" in odd.stderr
    png = tmp_path / "widths.png"
    assert _cli(*base, "--reverse", "--plot", str(png)).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = _cli("--layers", "8", "--d-ff", "32", "--ratio", "1.9", "0.1")
    assert bad.returncode == 2 and "rounding unit" in bad.stderr
