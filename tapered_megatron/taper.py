"""MLP width schedules of Tapered Language Models and their budget-exact rounding.

A TLM keeps every dimension of the uniform model except the MLP intermediate width ``d_ff(l)``,
which follows a schedule over depth (Tapered Language Models, arXiv 2606.23670) and whose sum
over layers equals the uniform budget ``L * d_ff_base``. :func:`make_plan` turns a schedule into
integer widths that are multiples of one rounding unit, ``multiple`` (a tensor-parallel size must
divide it, so each rank holds an integer slice and the widths are the same at every TP size),
keeps the schedule's shape (monotone for linear/cosine/sigmoid), pins the first and last layers
to the rounded endpoints and meets the budget exactly whenever the budget is a multiple of the
unit; otherwise the smallest deviation is reported in the plan, never hidden.

The resulting :class:`TaperPlan` is immutable and is the one object that the model builder, the
parameter/FLOP counters and the pipeline balancer read.

CLI::

    python -m tapered_megatron.taper --layers 24 --d-ff 4096 --schedule cosine --ratio 1.5 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from itertools import pairwise, product
from typing import Literal, get_args

Schedule = Literal["uniform", "linear", "cosine", "sigmoid", "step"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
DEFAULT_STEP_MULTIPLIERS = (1.5, 1.0, 0.5)


class TaperError(ValueError):
    """A schedule that cannot be realised; the message names the limit and the fix."""


@dataclass(frozen=True)
class TaperPlan:
    """Per-layer MLP widths of one model, computed once.

    Attributes:
        widths: ``d_ff(l)`` for l = 0..L-1, each a multiple of ``unit``.
        schedule: schedule name (one of :data:`SCHEDULES`).
        ratios: ``(r_start, r_end)`` for linear/cosine/sigmoid, the step multipliers for ``step``,
            ``(1.0, 1.0)`` for uniform. Always given in the un-reversed orientation.
        reverse: whether the schedule is mirrored (narrow early, wide late).
        d_ff_base: the uniform baseline width.
        unit: rounding unit, ``multiple``.
        budget: ``L * d_ff_base``.
        deviation: ``sum(widths) - budget`` (0 whenever the budget is a multiple of ``unit``).
        raw: the unrounded schedule values, for reports and tests.
    """

    widths: tuple[int, ...]
    schedule: str
    ratios: tuple[float, ...]
    reverse: bool
    d_ff_base: int
    unit: int
    budget: int
    deviation: int
    raw: tuple[float, ...]

    @property
    def layers(self) -> int:
        """Number of layers."""
        return len(self.widths)

    @property
    def total(self) -> int:
        """Sum of the widths."""
        return sum(self.widths)

    def to_dict(self) -> dict:
        """JSON-ready dictionary (includes ``sum``)."""
        d = asdict(self)
        d["sum"] = self.total
        d["widths"] = list(self.widths)
        d["ratios"] = list(self.ratios)
        d["raw"] = [round(x, 4) for x in self.raw]
        return d

    def table(self) -> str:
        """Human-readable per-layer table."""
        lines = [
            f"taper: {self.schedule}{' (reversed)' if self.reverse else ''} "
            f"ratios={list(self.ratios)} d_ff_base={self.d_ff_base} unit={self.unit}",
            f"{'layer':>5} {'d_ff':>7} {'x base':>7} {'raw':>9}",
        ]
        for i, (w, r) in enumerate(zip(self.widths, self.raw)):
            lines.append(f"{i:>5} {w:>7} {w / self.d_ff_base:>7.3f} {r:>9.1f}")
        lines.append(f"sum={self.total} budget={self.budget} deviation={self.deviation:+d}")
        return "\n".join(lines)


def raw_schedule(
    schedule: str,
    layers: int,
    d_ff: int,
    ratios: tuple[float, ...],
    sigmoid_k: float = 10.0,
) -> list[float]:
    """Unrounded widths of a schedule in its forward (un-reversed) orientation."""
    if schedule == "uniform":
        return [float(d_ff)] * layers
    if schedule == "step":
        sizes = _group_sizes(layers, len(ratios))
        return [m * d_ff for m, n in zip(ratios, sizes) for _ in range(n)]
    s, e = ratios[0] * d_ff, ratios[1] * d_ff
    out = []
    for l in range(layers):
        x = l / (layers - 1) if layers > 1 else 0.0
        if schedule == "linear":
            out.append(s - (s - e) * x)
        elif schedule == "cosine":
            out.append(e + (s - e) / 2 * (1 + math.cos(math.pi * x)))
        elif schedule == "sigmoid":
            out.append(e + (s - e) / (1 + math.exp(sigmoid_k * (x - 0.5))))
        else:
            raise TaperError(
                f"taper.schedule: unknown schedule {schedule!r}; use one of {SCHEDULES}"
            )
    return out


def _group_sizes(layers: int, groups: int) -> list[int]:
    """Split ``layers`` into ``groups`` contiguous groups as equal as possible (larger first)."""
    base, extra = divmod(layers, groups)
    return [base + (1 if i < extra else 0) for i in range(groups)]


def _check_ratios(schedule: str, ratios: tuple[float, ...], layers: int) -> tuple[float, ...]:
    if schedule == "uniform":
        return (1.0, 1.0)
    if schedule == "step":
        if len(ratios) < 2:
            raise TaperError("taper.step_multipliers: give at least two group multipliers")
        if layers < len(ratios):
            raise TaperError(
                f"taper.step_multipliers: {len(ratios)} groups need at least that many layers "
                f"(model.layers={layers})"
            )
        if abs(sum(ratios) / len(ratios) - 1.0) > 1e-9:
            raise TaperError(
                f"taper.step_multipliers: {list(ratios)} must average to 1 to keep the budget"
            )
        if min(ratios) <= 0:
            raise TaperError("taper.step_multipliers: multipliers must be positive")
        return tuple(float(r) for r in ratios)
    if len(ratios) != 2:
        raise TaperError(f"taper.ratio: expected two values (r_start r_end), got {list(ratios)}")
    r_start, r_end = float(ratios[0]), float(ratios[1])
    if not r_start >= r_end > 0:
        raise TaperError(
            f"taper.ratio: need r_start >= r_end > 0, got {r_start} {r_end} "
            "(use taper.reverse for narrow-early schedules)"
        )
    if abs(r_start + r_end - 2.0) > 1e-9:
        raise TaperError(
            f"taper.ratio: r_start + r_end must be 2 to keep the budget, got {r_start + r_end:g}"
        )
    return (r_start, r_end)


def _edge_directions(raw: list[float]) -> list[int]:
    """For each adjacent pair, +1 if widths may not increase there, -1 if they may not decrease.

    Pairs with equal raw values follow the schedule's overall (non-increasing) direction, so the
    nudging that meets the budget never creates a bump that the schedule does not have.
    """
    return [-1 if b > a else 1 for a, b in pairwise(raw)]


def _fit(raw: list[float], first: int, last: int, unit: int, target: int) -> list[int]:
    """Round ``raw`` to multiples of ``unit`` with pinned ends, then nudge towards ``target``.

    Each nudge moves one interior layer by one unit, choosing the layer whose rounding error is
    largest in the needed direction among those whose move keeps every adjacent-pair direction.
    """
    n = len(raw)
    dirs = _edge_directions(raw)
    if n == 1:
        return [first]
    w = [first] + [max(round(r / unit), 1) * unit for r in raw[1:-1]] + [last]
    # Rounding keeps every direction except possibly next to the pinned ends; repair those.
    for i in range(1, n - 1):
        if dirs[i - 1] == 1 and w[i] > w[i - 1]:
            w[i] = w[i - 1]
        if dirs[i - 1] == -1 and w[i] < w[i - 1]:
            w[i] = w[i - 1]
    for i in range(n - 2, 0, -1):
        if dirs[i] == 1 and w[i] < w[i + 1]:
            w[i] = w[i + 1]
        if dirs[i] == -1 and w[i] > w[i + 1]:
            w[i] = w[i + 1]

    def ok(i: int, v: int) -> bool:
        left = w[i - 1] >= v if dirs[i - 1] == 1 else w[i - 1] <= v
        right = v >= w[i + 1] if dirs[i] == 1 else v <= w[i + 1]
        return v >= unit and left and right

    total = sum(w)
    while total != target:
        step = unit if total < target else -unit
        best, best_err = -1, -math.inf
        for i in range(1, n - 1):
            if ok(i, w[i] + step):
                err = (raw[i] - w[i]) * (1 if step > 0 else -1)
                if err > best_err:
                    best, best_err = i, err
        if best < 0:
            break
        w[best] += step
        total += step
    return w


def make_plan(
    layers: int,
    d_ff: int,
    schedule: str = "cosine",
    ratios: tuple[float, ...] = (1.5, 0.5),
    multiple: int = 16,
    *,
    reverse: bool = False,
    sigmoid_k: float = 10.0,
) -> TaperPlan:
    """Compute the budget-exact, rounded widths of a schedule (see module docstring).

    ``ratios`` is ``(r_start, r_end)`` for linear/cosine/sigmoid and the group multipliers for
    ``step``; it is ignored for ``uniform``. Raises :class:`TaperError` for impossible requests.
    """
    if schedule not in SCHEDULES:
        raise TaperError(f"taper.schedule: unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if layers < 1:
        raise TaperError(f"model.layers: need at least one layer, got {layers}")
    if d_ff < 1:
        raise TaperError(f"model.d_ff: must be positive, got {d_ff}")
    if multiple < 1:
        raise TaperError(f"taper.multiple: must be >= 1, got {multiple}")
    ratios = _check_ratios(schedule, tuple(ratios), layers)
    unit = multiple
    budget = layers * d_ff
    raw = raw_schedule(schedule, layers, d_ff, ratios, sigmoid_k)
    if min(raw) < unit:
        raise TaperError(
            f"taper: the narrowest layer would be {min(raw):.1f} wide, below one rounding unit "
            f"(taper.multiple = {unit}); raise model.d_ff, make the taper gentler "
            "or lower taper.multiple"
        )
    target_lo = (budget // unit) * unit
    targets = sorted({target_lo, target_lo + unit}, key=lambda t: (abs(t - budget), t))

    def candidates(x: float) -> list[int]:
        near = max(round(x / unit), 1) * unit
        alt = [v for v in (math.floor(x / unit) * unit, math.ceil(x / unit) * unit) if v >= unit]
        return [near] + [v for v in alt if v != near]

    best: tuple | None = None
    for first, last in product(candidates(raw[0]), candidates(raw[-1])):
        if layers == 1:
            last = first
        if (first < last) if raw[0] >= raw[-1] else (first > last):
            continue
        for target in targets:
            w = _fit(raw, first, last, unit, target)
            score = (
                abs(sum(w) - budget),
                abs(first - raw[0]) + abs(last - raw[-1]),
                sum(abs(a - b) for a, b in zip(w, raw)),
            )
            if best is None or score < best[0]:
                best = (score, w)
    assert best is not None
    widths = best[1]
    if reverse:
        widths, raw = widths[::-1], raw[::-1]
    return TaperPlan(
        widths=tuple(int(w) for w in widths),
        schedule=schedule,
        ratios=ratios,
        reverse=reverse,
        d_ff_base=d_ff,
        unit=unit,
        budget=budget,
        deviation=int(sum(widths) - budget),
        raw=tuple(raw),
    )


def plot_plan(plan: TaperPlan, path: str) -> None:
    """Write a PNG of widths by layer, with the uniform baseline for comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(plan.layers)
    ax.step(xs, plan.widths, where="mid", label=f"{plan.schedule} (rounded)", lw=2)
    ax.plot(xs, plan.raw, "--", lw=1, label="schedule formula")
    ax.axhline(plan.d_ff_base, color="gray", lw=1, ls=":", label="uniform baseline")
    ax.set_xlabel("layer")
    ax.set_ylabel("MLP width d_ff(l)")
    ax.set_title(f"sum {plan.total} / budget {plan.budget} (dev {plan.deviation:+d})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: print (or plot) the taper plan of one schedule."""
    p = argparse.ArgumentParser(
        prog="python -m tapered_megatron.taper", description=__doc__.split("\n")[0]
    )
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--d-ff", type=int, required=True, help="uniform baseline MLP width")
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    p.add_argument(
        "--ratio",
        type=float,
        nargs="+",
        default=None,
        help="r_start r_end (default 1.5 0.5), or the step multipliers",
    )
    p.add_argument("--multiple", type=int, default=16, help="widths are multiples of it")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size the widths must split over"
    )
    p.add_argument("--reverse", action="store_true")
    p.add_argument("--sigmoid-k", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write a plot of widths by layer")
    a = p.parse_args(argv)
    ratios = a.ratio or (DEFAULT_STEP_MULTIPLIERS if a.schedule == "step" else (1.5, 0.5))
    try:
        if a.tp < 1 or a.multiple % a.tp:
            raise TaperError(
                f"--tp {a.tp} must divide --multiple {a.multiple} (each rank holds d_ff/tp "
                f"columns); use a multiple of {max(a.tp, 1)}"
            )
        plan = make_plan(
            a.layers,
            a.d_ff,
            a.schedule,
            tuple(ratios),
            a.multiple,
            reverse=a.reverse,
            sigmoid_k=a.sigmoid_k,
        )
    except TaperError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict()) if a.json else plan.table())
    if a.plot:
        plot_plan(plan, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
