"""The plots (a)-(g) of RESULTS.md (matplotlib, PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.tlm import grid
from experiments.tlm.stats import Stat, perplexity, ppl_stat, rho_stats, zs_stat
from experiments.tlm.tables import scale_comparisons, scale_size_names

PLOTS = {
    "controlled": "a_controlled.png",
    "sweep": "b_sweep.png",
    "archs": "c_archs.png",
    "curves": "d_curves.png",
    "alignment": "e_alignment.png",
    "zeroshot": "f_zeroshot.png",
    "scale": "g_scale.png",
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _dots(ax: Any, labels: list[str], stats: list[Stat], ylabel: str) -> None:
    """Mean ± std per label as points with error bars (no bar baseline to exaggerate gaps)."""
    xs = list(range(len(labels)))
    ok = [(x, s) for x, s in zip(xs, stats, strict=True) if s.n]
    ax.errorbar(
        [x for x, _ in ok], [s.mean for _, s in ok], [s.std for _, s in ok], fmt="o", capsize=3
    )
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.5, len(xs) - 0.5)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _dots_figure(
    plt: Any,
    size: tuple[float, float],
    labels: list[str],
    stats: list[Stat],
    ylabel: str,
    title: str,
) -> Any:
    """A one-panel figure of :func:`_dots`."""
    fig, ax = plt.subplots(figsize=size)
    _dots(ax, labels, stats, ylabel)
    ax.set_title(title)
    return fig


def _controlled(plt: Any, by: dict) -> Any:
    """(a): perplexity of the four controlled configurations."""
    vs = grid.experiment_variants("controlled")
    stats = [ppl_stat(by.get(v.key)) for v in vs]
    labels = [v.label.split(" ")[0] for v in vs]
    title = "(a) controlled: wider thirds (mean ± std over seeds)"
    return _dots_figure(plt, (5, 3.5), labels, stats, "val ppl", title)


def _sweep(plt: Any, by: dict) -> Any:
    """(b): perplexity against the ratio, one line per schedule, uniform as a band."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs = [r[0] for r in grid.SWEEP_RATIOS]
    for s in grid.SWEEP_SCHEDULES:
        st = [ppl_stat(by.get(grid.Variant("transformer", s, r).key)) for r in grid.SWEEP_RATIOS]
        ok = [(x, t) for x, t in zip(xs, st, strict=True) if t.n]
        if ok:
            ax.errorbar(
                [x for x, _ in ok],
                [t.mean for _, t in ok],
                [t.std for _, t in ok],
                marker="o",
                capsize=3,
                label=s,
            )
    u = ppl_stat(by.get(grid.UNIFORM.key))
    if u.n:
        ax.axhline(u.mean, color="k", ls="--", label="uniform")
        ax.axhspan(u.mean - u.std, u.mean + u.std, color="k", alpha=0.1)
    ax.set(xlabel="r_start (r_end = 2 - r_start)", ylabel="val ppl", title="(b) schedule sweep")
    ax.legend(fontsize=8)
    return fig


def _archs(plt: Any, by: dict) -> Any:
    """(c): perplexity of uniform, cosine 1.5/0.5 and reverse, one panel per architecture."""
    fig, axes = plt.subplots(1, len(grid.ARCHS), figsize=(10, 3.6))
    for ax, a in zip(axes, grid.ARCHS, strict=True):
        vs = grid.arch_variants(a)
        _dots(
            ax,
            ["uniform", "cosine 1.5/0.5", "reverse"],
            [ppl_stat(by.get(v.key)) for v in vs],
            "val ppl",
        )
        ax.set_title(a, fontsize=9)
    fig.suptitle("(c) architectures (mean ± std over seeds)")
    return fig


def _curves(plt: Any, by: dict, groups: list[str]) -> Any:
    """(d): validation perplexity against tokens, mean over seeds, one panel per experiment
    of ``groups``."""
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False)
    for ax, e in zip(axes[0], groups, strict=True):
        for v in grid.experiment_variants(e):
            runs = by.get(v.key)
            if not runs:
                continue
            curves = [r["val_curve"] for r in runs.values()]
            n = min(len(c) for c in curves)
            toks = [curves[0][i][1] for i in range(n)]
            ppl = [sum(perplexity(c[i][2]) for c in curves) / len(curves) for i in range(n)]
            name = v.label if e != "archs" else f"{v.arch} {v.label}"
            ax.plot(toks, ppl, label=name, lw=1)
        ax.set(xlabel="tokens", ylabel="val ppl (mean over seeds)", yscale="log", title=f"(d) {e}")
        ax.legend(fontsize=5, ncol=2)
    return fig


def _alignment(plt: Any, by: dict) -> Any:
    """(e): ρ_block and ρ_mlp per layer, uniform and tapered (None without any)."""
    uni, tap = grid.experiment_variants("alignment")
    rho = {
        (n, k): rho_stats(by, v, k)
        for n, v in (("uniform", uni), ("tapered", tap))
        for k in ("rho_block", "rho_mlp")
    }
    if not any(rho.values()):
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for (n, k), st in rho.items():
        if st:
            ax.errorbar(
                range(len(st)),
                [s.mean for s in st],
                [s.std for s in st],
                marker="o",
                capsize=2,
                ls="-" if n == "tapered" else "--",
                label=f"{n} {k}",
            )
    ax.axhline(0, color="k", lw=0.5)
    ax.set(xlabel="layer", ylabel="cosine", title="(e) alignment with the residual stream")
    ax.legend(fontsize=8)
    return fig


def _zeroshot(plt: Any, by: dict) -> Any:
    """(f): average zero-shot accuracy of every (c) configuration."""
    vs = grid.experiment_variants("archs")
    stats = [zs_stat(by.get(v.key)) for v in vs]
    labels = [f"{v.arch} {v.label}" for v in vs]
    return _dots_figure(plt, (6, 3.8), labels, stats, "avg zero-shot acc (%)", "(f) zero-shot")


def _scale(plt: Any, by: dict) -> Any:
    """(g): each comparison's relative Δ perplexity with its 95 % interval at both sizes."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, c in enumerate(scale_comparisons(by)):
        pts = [(x + (i - 1.5) * 0.05, s) for x, s in enumerate(c.pct) if s.n]
        cis = [s.interval or (s.mean, s.mean) for _, s in pts]
        ax.errorbar(
            [x for x, _ in pts],
            [s.mean for _, s in pts],
            [[s.mean - lo for (_, s), (lo, _) in zip(pts, cis, strict=True)],
             [hi - s.mean for (_, s), (_, hi) in zip(pts, cis, strict=True)]],
            marker="o",
            capsize=3,
            label=f"{c.arch} {c.what}",
        )  # fmt: skip
    ax.axhline(0, color="k", lw=0.5)
    records = [r for runs in by.values() for r in runs.values()]
    ax.set_xticks([0, 1], list(scale_size_names(records)))
    ax.set_xlim(-0.5, 1.5)
    ax.set_ylabel("Δ val ppl vs uniform (% of uniform)")
    ax.set_title("(g) scale: mean and 95 % CI over seeds")
    ax.legend(fontsize=7)
    return fig


def plot_all(by: dict, keys: list[str], dest: Path) -> list[str]:
    """Write the PNGs named by ``keys`` (:func:`plot_keys`) under ``dest``; return the names.
    ``by``: the run records by variant key and seed (:func:`~experiments.tlm.stats.by_variant`)."""
    plt = _plt()
    groups = [e for e in ("controlled", "sweep", "archs") if e in keys]
    draw = {
        "controlled": lambda: _controlled(plt, by),
        "sweep": lambda: _sweep(plt, by),
        "archs": lambda: _archs(plt, by),
        "curves": lambda: _curves(plt, by, groups),
        "alignment": lambda: _alignment(plt, by),
        "zeroshot": lambda: _zeroshot(plt, by),
        "scale": lambda: _scale(plt, by),
    }
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for key, figure in draw.items():
        fig = figure() if key in keys else None
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(dest / PLOTS[key], dpi=110)
        plt.close(fig)
        written.append(PLOTS[key])
    return written


def plot_keys(by: dict, records: list[dict[str, Any]], only: list[str]) -> list[str]:
    """Which of the plots (a)-(g) have data (the same rule for drawing and for linking)."""
    keys = [k for k in ("controlled", "sweep", "archs") if k in only and records]
    if records and keys:
        keys.append("curves")
    uni, tap = grid.experiment_variants("alignment")
    if "alignment" in only and (rho_stats(by, uni, "rho_block") or rho_stats(by, tap, "rho_block")):
        keys.append("alignment")
    if "archs" in only and any(r.get("zeroshot") for r in records):
        keys.append("zeroshot")
    if "scale" in only and any(r.get("size") for r in records):
        keys.append("scale")
    return keys
