"""Statistics, tables, plots and ``docs/RESULTS.md`` for ``scripts/reproduce_tlm.py``.

Everything in RESULTS.md is computed by :func:`render` from two kinds of saved files only:
``docs/results/runs/<run>/metrics.json`` (one per finished run, written by :func:`collect` from
the run directory) and ``docs/results/meta.json`` (command, wall time, machine, date, setup). So
the document can be regenerated, and checked, without the checkpoints.

Statistics over seeds: mean and sample standard deviation (n-1). A configuration is compared with
uniform seed by seed (same seed = same initialisation stream and data order): the paired
difference per seed, its mean and standard deviation. A difference "exceeds the seed-to-seed
spread" when its magnitude is larger than the largest of the configuration's std, the uniform
std and the paired differences' std (with one seed there is no spread and the answer is n/a).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tapered_megatron.eval import experiments as ex

# The paper's (arXiv 2606.23670) 440M validation perplexities.
PAPER_CONTROLLED = {
    "uniform": 16.28,
    "wider-early": 15.96,
    "wider-middle": 16.61,
    "wider-late": 17.29,
}
PAPER_SWEEP = {
    (1.25, 0.75): (15.18, 15.96, 16.44),
    (1.375, 0.625): (14.59, 15.80, 16.44),
    (1.5, 0.5): (14.44, 15.96, 16.12),
    (1.625, 0.375): (14.59, 15.64, 15.96),
    (1.75, 0.25): (15.49, 16.28, 17.12),
}
# 760M, average zero-shot accuracy, uniform -> tapered (the two the spec quotes).
PAPER_ZEROSHOT = {"titans": (52.30, 53.29), "transformer": (52.25, 52.84)}
PLOTS = {
    "controlled": "a_controlled.png",
    "sweep": "b_sweep.png",
    "archs": "c_archs.png",
    "curves": "d_curves.png",
    "alignment": "e_alignment.png",
    "zeroshot": "f_zeroshot.png",
}


# ----------------------------------------------------------------------------- statistics
def perplexity(loss: float) -> float:
    """``exp(loss)`` (capped like the trainer's logger)."""
    return math.exp(min(loss, 30.0))


@dataclass(frozen=True)
class Stat:
    """Mean and sample std of per-seed values."""

    values: dict[int, float]

    @property
    def n(self) -> int:
        """Number of seeds."""
        return len(self.values)

    @property
    def mean(self) -> float:
        """Mean over seeds."""
        return sum(self.values.values()) / self.n

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (0 for one seed)."""
        if self.n < 2:
            return 0.0
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values.values()) / (self.n - 1))


@dataclass(frozen=True)
class Paired:
    """A configuration against the baseline, seed by seed."""

    config: Stat
    base: Stat

    @property
    def diffs(self) -> Stat:
        """Per-seed differences ``config - base`` over the seeds both have."""
        common = sorted(set(self.config.values) & set(self.base.values))
        return Stat({s: self.config.values[s] - self.base.values[s] for s in common})

    @property
    def spread(self) -> float:
        """The seed-to-seed spread a difference must beat."""
        return max(self.config.std, self.base.std, self.diffs.std)

    @property
    def exceeds(self) -> str:
        """``yes`` / ``no`` / ``n/a`` (fewer than two paired seeds)."""
        d = self.diffs
        if d.n < 2:
            return "n/a"
        return "yes" if abs(d.mean) > self.spread else "no"


def pm(s: Stat | None, digits: int = 2) -> str:
    """``mean ± std`` (just the mean for one seed; an em dash for none)."""
    if s is None or s.n == 0:
        return "—"
    if s.n == 1:
        return f"{s.mean:.{digits}f}"
    return f"{s.mean:.{digits}f} ± {s.std:.{digits}f}"


def signed_pm(s: Stat, digits: int = 2) -> str:
    """Like :func:`pm` with an explicit sign on the mean."""
    if s.n == 0:
        return "—"
    if s.n == 1:
        return f"{s.mean:+.{digits}f}"
    return f"{s.mean:+.{digits}f} ± {s.std:.{digits}f}"


# ----------------------------------------------------------------------------- collecting
def _window_means(recs: list[dict[str, Any]], width: int) -> list[list[float]]:
    out = []
    for i in range(0, len(recs), width):
        chunk = recs[i : i + width]
        out.append([chunk[-1]["iteration"], sum(r["loss"] for r in chunk) / len(chunk)])
    return out


def run_record(settings: ex.Settings, run: ex.Run) -> dict[str, Any]:
    """The saved summary of one finished run (what RESULTS.md is computed from)."""
    from tapered_megatron.config import load_config

    d = settings.run_dir(run)
    job = ex.job_part(json.loads((d / "cmd.json").read_text())["command"])
    over = [a for a in job[1:] if a not in ("--resume", "auto")]
    preset = over[over.index("--config") + 1]
    del over[over.index("--config") : over.index("--config") + 2]
    cfg = load_config(preset, over)
    tokens_per_iter = (cfg.train.global_batch_size or cfg.train.micro_batch_size) * (
        cfg.model.seq_len
    )
    recs = ex.read_metrics(d / "metrics.jsonl")
    curve = [
        [r["iteration"], r["iteration"] * tokens_per_iter, r["val_loss"]]
        for r in recs
        if "val_loss" in r
    ]
    done = json.loads((d / "done").read_text())
    out: dict[str, Any] = {
        "run": run.name,
        "variant": run.variant.key,
        "arch": run.variant.arch,
        "schedule": run.variant.schedule,
        "ratio": list(run.variant.ratio),
        "reverse": run.variant.reverse,
        "seed": run.seed,
        "widths": list(cfg.taper_plan.widths),
        "model": {
            "d_model": cfg.model.d_model,
            "layers": cfg.model.layers,
            "d_ff": cfg.model.d_ff,
            "vocab_size": cfg.model.vocab_size,
            "seq_len": cfg.model.seq_len,
        },
        "tokens_per_iteration": tokens_per_iter,
        "iterations": recs[-1]["iteration"],
        "eval_tokens": cfg.eval.iters * tokens_per_iter,
        "lr": cfg.train.lr,
        "val_curve": curve,
        "train_curve": _window_means(recs, 10),
        "final_val_loss": curve[-1][2],
        "wall_s": round(done["wall_s"], 1),
    }
    align = d / "alignment.json"
    out["alignment"] = json.loads(align.read_text()) if align.exists() else None
    zs = d / "zeroshot" / "zeroshot.json"
    out["zeroshot"] = json.loads(zs.read_text()) if zs.exists() else None
    return out


def collect(settings: ex.Settings, runs: Iterable[ex.Run], dest: Path) -> int:
    """Write ``dest/<run>/metrics.json`` for every finished run; return how many were written.

    Saved runs no longer in the plan are left alone; ``dest`` holds small JSON only.
    """
    n = 0
    for run in runs:
        if not ex.is_done(settings, run):
            continue
        rec = run_record(settings, run)
        (dest / run.name).mkdir(parents=True, exist_ok=True)
        (dest / run.name / "metrics.json").write_text(json.dumps(rec, indent=1) + "\n")
        n += 1
    return n


def load_records(runs_dir: Path) -> list[dict[str, Any]]:
    """Every saved ``<run>/metrics.json`` under ``runs_dir``, sorted by run name."""
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*/metrics.json"))]


# ----------------------------------------------------------------------------- tables
def _by_variant(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["variant"], {})[r["seed"]] = r
    return out


def ppl_stat(runs: dict[int, dict[str, Any]] | None) -> Stat:
    """Final validation perplexity per seed."""
    return Stat({s: perplexity(r["final_val_loss"]) for s, r in (runs or {}).items()})


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _compare_cells(v: ex.Variant, by: dict, base_key: str) -> list[str]:
    st = ppl_stat(by.get(v.key))
    seeds = ", ".join(f"{x:.2f}" for _, x in sorted(st.values.items())) or "—"
    if v.key == base_key or st.n == 0:
        return [pm(st), seeds, "—", "—"]
    p = Paired(st, ppl_stat(by.get(base_key)))
    return [pm(st), seeds, signed_pm(p.diffs), p.exceeds]


def compare_header(scale: str) -> list[str]:
    """Headers of the four comparison columns."""
    return [f"ours ({scale}): val ppl", "per seed", "Δ vs uniform (paired)", "beyond seed spread"]


def late_drop_ratio(rec: dict[str, Any]) -> float | None:
    """How much the last evaluation interval moved the validation loss, as a fraction of the
    first interval's drop (small: the run is past its fast phase). None with < 3 points."""
    c = [p[2] for p in rec["val_curve"]]
    if len(c) < 3 or c[0] == c[1]:
        return None
    return abs(c[-1] - c[-2]) / abs(c[0] - c[1])


def _widths(by: dict, v: ex.Variant, planned: dict[str, list[int]]) -> str:
    runs = by.get(v.key)
    widths = next(iter(runs.values()))["widths"] if runs else planned.get(v.key)
    if not widths:
        return "—"
    groups: list[list[int]] = []
    for w in widths:
        if groups and groups[-1][0] == w:
            groups[-1][1] += 1
        else:
            groups.append([w, 1])
    return "/".join(f"{w}" if n == 1 else f"{w}×{n}" for w, n in groups)


def table_controlled(by: dict, scale: str, planned: dict[str, list[int]]) -> list[str]:
    """(a): uniform vs wider-early/middle/late (``planned``: widths by variant when not run)."""
    rows = []
    for v in ex.experiment_variants("controlled"):
        name = v.label.split(" ")[0]
        rows.append([v.label, _widths(by, v, planned), f"{PAPER_CONTROLLED[name]:.2f}"])
        rows[-1] += _compare_cells(v, by, ex.UNIFORM.key)
    head = ["configuration", f"d_ff per layer ({scale})", "paper 440M ppl"]
    return _table(head + compare_header(scale), rows)


def table_sweep(by: dict, scale: str) -> list[str]:
    """(b): schedule x ratio pair."""
    rows = [["uniform", "—", "16.28", *_compare_cells(ex.UNIFORM, by, ex.UNIFORM.key)]]
    for r in ex.SWEEP_RATIOS:
        for i, s in enumerate(ex.SWEEP_SCHEDULES):
            v = ex.Variant("transformer", s, r)
            rows.append([s, f"{r[0]:g}/{r[1]:g}", f"{PAPER_SWEEP[r][i]:.2f}"])
            rows[-1] += _compare_cells(v, by, ex.UNIFORM.key)
    return _table(["schedule", "ratio", "paper 440M ppl", *compare_header(scale)], rows)


def table_archs(by: dict, scale: str) -> list[str]:
    """(c): four architectures x {uniform, cosine 1.5/0.5, reverse}."""
    rows = []
    for v in ex.experiment_variants("archs"):
        base = ex.Variant(v.arch).key
        rows.append([v.arch, v.label, *_compare_cells(v, by, base)])
    return _table(["architecture", "configuration", *compare_header(scale)], rows)


def _rho(by: dict, v: ex.Variant, key: str) -> list[Stat]:
    runs = {s: r for s, r in (by.get(v.key) or {}).items() if r.get("alignment")}
    if not runs:
        return []
    layers = len(next(iter(runs.values()))["alignment"]["layers"])
    return [
        Stat({s: r["alignment"]["layers"][i][key] for s, r in runs.items()}) for i in range(layers)
    ]


def table_alignment(by: dict) -> list[str]:
    """(e): per-layer rho_block and rho_mlp of the uniform and tapered Transformer."""
    uni, tap = ex.experiment_variants("alignment")
    cols = [_rho(by, uni, "rho_block"), _rho(by, tap, "rho_block")]
    cols += [_rho(by, uni, "rho_mlp"), _rho(by, tap, "rho_mlp")]
    n = max(len(c) for c in cols)
    rows = [[str(i)] + [pm(c[i], 3) if i < len(c) else "—" for c in cols] for i in range(n)]
    head = ["layer", "uniform ρ_block", "tapered ρ_block", "uniform ρ_mlp", "tapered ρ_mlp"]
    return _table(head, rows)


def zs_stat(runs: dict[int, dict[str, Any]] | None, task: str | None = None) -> Stat:
    """Zero-shot accuracy per seed in percent (``task=None``: the average over tasks)."""
    vals = {}
    for s, r in (runs or {}).items():
        z = r.get("zeroshot")
        if z:
            acc = z["average_acc"] if task is None else z["tasks"][task]["acc"]
            vals[s] = 100.0 * acc
    return Stat(vals)


def _tasks(records: list[dict[str, Any]]) -> list[str]:
    return sorted({t for r in records if r.get("zeroshot") for t in r["zeroshot"]["tasks"]})


def table_zeroshot(by: dict, tasks: list[str], scale: str) -> list[str]:
    """(f): average zero-shot accuracy (percent) of the (c) models, with each task's accuracy."""
    rows = []
    for v in ex.experiment_variants("archs"):
        st = zs_stat(by.get(v.key))
        base = zs_stat(by.get(ex.Variant(v.arch).key))
        paper = PAPER_ZEROSHOT.get(v.arch)
        ref = "—"
        if paper and v.schedule == "uniform":
            ref = f"{paper[0]:.2f}"
        elif paper and not v.reverse:
            ref = f"{paper[1]:.2f}"
        if v.schedule == "uniform" or st.n == 0:
            delta, exc = "—", "—"
        else:
            p = Paired(st, base)
            delta, exc = signed_pm(p.diffs), p.exceeds
        per_task = [pm(zs_stat(by.get(v.key), t), 1) for t in tasks]
        rows.append([v.arch, v.label, ref, pm(st), delta, exc, *per_task])
    head = ["architecture", "configuration", "paper 760M avg acc", f"ours ({scale}) avg acc"]
    return _table([*head, "Δ vs uniform (paired)", "beyond seed spread", *tasks], rows)


# ----------------------------------------------------------------------------- plots
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


def plot_all(by: dict, keys: list[str], dest: Path) -> list[str]:
    """Write the PNGs named by ``keys`` (:func:`plot_keys`) under ``dest``; return the names."""
    plt = _plt()
    written = []

    def save(fig: Any, key: str) -> None:
        fig.tight_layout()
        fig.savefig(dest / PLOTS[key], dpi=110)
        plt.close(fig)
        written.append(PLOTS[key])

    dest.mkdir(parents=True, exist_ok=True)
    if "controlled" in keys:
        vs = ex.experiment_variants("controlled")
        fig, ax = plt.subplots(figsize=(5, 3.5))
        _dots(
            ax,
            [v.label.split(" ")[0] for v in vs],
            [ppl_stat(by.get(v.key)) for v in vs],
            "val ppl",
        )
        ax.set_title("(a) controlled: wider thirds (mean ± std over seeds)")
        save(fig, "controlled")
    if "sweep" in keys:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        xs = [r[0] for r in ex.SWEEP_RATIOS]
        for s in ex.SWEEP_SCHEDULES:
            st = [ppl_stat(by.get(ex.Variant("transformer", s, r).key)) for r in ex.SWEEP_RATIOS]
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
        u = ppl_stat(by.get(ex.UNIFORM.key))
        if u.n:
            ax.axhline(u.mean, color="k", ls="--", label="uniform")
            ax.axhspan(u.mean - u.std, u.mean + u.std, color="k", alpha=0.1)
        ax.set_xlabel("r_start (r_end = 2 - r_start)")
        ax.set_ylabel("val ppl")
        ax.set_title("(b) schedule sweep")
        ax.legend(fontsize=8)
        save(fig, "sweep")
    if "archs" in keys:
        fig, axes = plt.subplots(1, len(ex.ARCHS), figsize=(10, 3.6))
        for ax, a in zip(axes, ex.ARCHS, strict=True):
            vs = [v for v in ex.experiment_variants("archs") if v.arch == a]
            _dots(
                ax,
                ["uniform", "cosine 1.5/0.5", "reverse"],
                [ppl_stat(by.get(v.key)) for v in vs],
                "val ppl",
            )
            ax.set_title(a, fontsize=9)
        fig.suptitle("(c) architectures (mean ± std over seeds)")
        save(fig, "archs")
    if "curves" in keys:
        groups = [e for e in ("controlled", "sweep", "archs") if e in keys]
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False)
        for ax, e in zip(axes[0], groups, strict=True):
            for v in ex.experiment_variants(e):
                runs = by.get(v.key)
                if not runs:
                    continue
                curves = [r["val_curve"] for r in runs.values()]
                n = min(len(c) for c in curves)
                toks = [curves[0][i][1] for i in range(n)]
                ppl = [sum(perplexity(c[i][2]) for c in curves) / len(curves) for i in range(n)]
                name = v.label if e != "archs" else f"{v.arch} {v.label}"
                ax.plot(toks, ppl, label=name, lw=1)
            ax.set_xlabel("tokens")
            ax.set_ylabel("val ppl (mean over seeds)")
            ax.set_yscale("log")
            ax.set_title(f"(d) {e}")
            ax.legend(fontsize=5, ncol=2)
        save(fig, "curves")
    if "alignment" in keys:
        uni, tap = ex.experiment_variants("alignment")
        rho = {
            (n, k): _rho(by, v, k)
            for n, v in (("uniform", uni), ("tapered", tap))
            for k in ("rho_block", "rho_mlp")
        }
        if any(rho.values()):
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
            ax.set_xlabel("layer")
            ax.set_ylabel("cosine")
            ax.set_title("(e) alignment with the residual stream")
            ax.legend(fontsize=8)
            save(fig, "alignment")
    if "zeroshot" in keys:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        vs = ex.experiment_variants("archs")
        _dots(
            ax,
            [f"{v.arch} {v.label}" for v in vs],
            [zs_stat(by.get(v.key)) for v in vs],
            "avg zero-shot acc (%)",
        )
        ax.set_title("(f) zero-shot")
        save(fig, "zeroshot")
    return written


def plot_keys(by: dict, records: list[dict[str, Any]], only: list[str]) -> list[str]:
    """Which of the plots (a)-(f) have data (the same rule for drawing and for linking)."""
    keys = [k for k in ("controlled", "sweep", "archs") if k in only and records]
    if records and keys:
        keys.append("curves")
    uni, tap = ex.experiment_variants("alignment")
    if "alignment" in only and (_rho(by, uni, "rho_block") or _rho(by, tap, "rho_block")):
        keys.append("alignment")
    if "archs" in only and any(r.get("zeroshot") for r in records):
        keys.append("zeroshot")
    return keys


# ----------------------------------------------------------------------------- reading
def verdict(p: Paired, expect_negative: bool) -> str:
    """How a paper claim "config is lower (better) / higher than uniform" fared in ours."""
    d = p.diffs
    if d.n == 0:
        return "not measured"
    held = (d.mean < 0) == expect_negative and d.mean != 0
    if p.exceeds == "n/a":
        return "held in direction (one seed, no spread)" if held else "did not hold (one seed)"
    if held:
        return (
            "held, beyond the seed spread"
            if p.exceeds == "yes"
            else ("held in the mean only, within the seed spread")
        )
    return (
        "did not hold: the opposite, beyond the seed spread"
        if p.exceeds == "yes"
        else ("did not hold (opposite sign, within the seed spread)")
    )


def _ppl_pair(by: dict, v: ex.Variant, base: ex.Variant) -> Paired:
    return Paired(ppl_stat(by.get(v.key)), ppl_stat(by.get(base.key)))


def reading(by: dict, records: list[dict[str, Any]], only: list[str]) -> list[str]:
    """Plain-language sentences, generated from the numbers, on what held relative to the paper."""
    out: list[str] = []
    if "controlled" in only:
        vs = ex.experiment_variants("controlled")
        names = {v: v.label.split(" ")[0] for v in vs}
        st = {v: ppl_stat(by.get(v.key)) for v in vs}
        if all(s.n for s in st.values()):
            order = " < ".join(names[v] for v in sorted(vs, key=lambda v: st[v].mean))
            out.append(
                "- (a) Controlled thirds. Paper (440M): wider-early < uniform < wider-middle < "
                f"wider-late. Ours, by mean perplexity: {order}."
            )
            for v, neg, claim in zip(
                vs[1:],
                (True, False, False),
                ("beats", "is worse than", "is worse than"),
                strict=True,
            ):
                p = _ppl_pair(by, v, ex.UNIFORM)
                out.append(
                    f'  - "{names[v]} {claim} uniform": {verdict(p, neg)} '
                    f"(Δ {signed_pm(p.diffs)} ppl)."
                )
    if "sweep" in only:
        tapered = [
            ex.Variant("transformer", s, r) for r in ex.SWEEP_RATIOS for s in ex.SWEEP_SCHEDULES
        ]
        pairs = {v: _ppl_pair(by, v, ex.UNIFORM) for v in tapered if by.get(v.key)}
        if pairs and by.get(ex.UNIFORM.key):
            better = [v for v, p in pairs.items() if p.diffs.n and p.diffs.mean < 0]
            strong = [v for v in better if pairs[v].exceeds == "yes"]
            worse = [v for v, p in pairs.items() if p.exceeds == "yes" and p.diffs.mean > 0]
            best = min(pairs, key=lambda v: pairs[v].config.mean)
            cos = [v for v in pairs if v.schedule == "cosine"]
            cos_better = [v for v in cos if v in better]
            wins = {s: 0 for s in ex.SWEEP_SCHEDULES}
            for r in ex.SWEEP_RATIOS:
                row = [v for v in pairs if v.ratio == r]
                if len(row) == len(ex.SWEEP_SCHEDULES):
                    wins[min(row, key=lambda v: pairs[v].config.mean).schedule] += 1
            out.append(
                "- (b) Schedule sweep. Paper (440M): every cosine point beats uniform (16.28), the "
                "best is cosine 1.5/0.5 (14.44), and cosine is the best schedule at all five "
                f"ratios. Ours: {len(better)} of {len(pairs)} tapered configurations have a lower "
                f"mean perplexity than uniform, {len(strong)} of them beyond the seed spread; "
                f"{len(worse)} are worse beyond the spread. Cosine beats uniform at "
                f"{len(cos_better)} of {len(cos)} ratios. Our best is {best.label} "
                f"({pm(pairs[best].config)} vs uniform {pm(ppl_stat(by[ex.UNIFORM.key]))}). "
                "Lowest mean perplexity per ratio: "
                + ", ".join(f"{s} {n}x" for s, n in wins.items())
                + "."
            )
    if "archs" in only:
        lines = []
        for a in ex.ARCHS:
            uni, cos, rev = [v for v in ex.experiment_variants("archs") if v.arch == a]
            if by.get(uni.key) and by.get(cos.key):
                p = _ppl_pair(by, cos, uni)
                text = f"  - {a}: cosine 1.5/0.5 vs uniform {signed_pm(p.diffs)} ppl, "
                text += verdict(p, True)
                if by.get(rev.key):
                    q = _ppl_pair(by, rev, uni)
                    text += f"; reverse vs uniform {signed_pm(q.diffs)} ppl, {verdict(q, False)}"
                lines.append(text + ".")
        if lines:
            out.append(
                "- (c) Architectures (validation perplexity; the paper reports zero-shot accuracy "
                "here, tapered above uniform in 8/8 cases, and that the reverse taper hurts):"
            )
            out += lines
    if "alignment" in only:
        for v in ex.experiment_variants("alignment"):
            rb = _rho(by, v, "rho_block")
            if len(rb) >= 3:
                early = [s.mean for s in rb[: len(rb) * 2 // 3]]
                late = rb[-1].mean
                rises = late > max(early)
                out.append(
                    f"- (e) Alignment, {v.label} Transformer: ρ_block over the first two thirds of "
                    f"the layers ranges {min(early):.3f}..{max(early):.3f}, last layer {late:.3f}: "
                    + (
                        "the late rise the paper describes is there."
                        if rises
                        else "the paper's late rise is not there."
                    )
                )
    if "archs" in only and any(r.get("zeroshot") for r in records):
        up = total = 0
        for a in ex.ARCHS:
            uni, cos, _ = [v for v in ex.experiment_variants("archs") if v.arch == a]
            p = Paired(zs_stat(by.get(cos.key)), zs_stat(by.get(uni.key)))
            if p.diffs.n:
                total += 1
                up += p.diffs.mean > 0
        out.append(
            f"- (f) Zero-shot: tapered above uniform in average accuracy for {up} of {total} "
            "architectures (paper: 8/8 at 760M/1.3B). Differences at this scale are to be read "
            "against the `beyond seed spread` column."
        )
    return out or ["- No finished runs yet."]


# ----------------------------------------------------------------------------- document
def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The whole RESULTS.md text from saved run records and the driver's metadata."""
    only = meta["only"]
    scale = meta["scale"] + (" smoke" if meta["smoke"] else "")
    by = _by_variant(records)
    lines = [
        "# Reproducing Tapered Language Models",
        "",
        "Generated by `scripts/reproduce_tlm.py` from `docs/results/runs/*/metrics.json` and "
        "`docs/results/meta.json` (every number below is recomputed from those files by "
        "`tests/test_reproduce.py`). Paper figures are from the paper (arXiv 2606.23670), at its "
        f"scale (440M / 760M); ours are at the `{scale}` scale.",
        "",
        f"- Command: `{meta['command']}`",
        "- Wall time: "
        + (
            f"{meta['wall_s'] / 60:.1f} min (all invocations)"
            if meta["wall_s"]
            else ("none (plan only)" if meta.get("plan") else "in progress")
        )
        + f"; machine: {meta['machine']}; date: {meta['date']}",
        f"- Runs: {len(records)} finished of {meta['runs_planned']} planned "
        f"({meta['seeds']} seed(s) per configuration)"
        + (
            f"; {sum(r['wall_s'] for r in records) / len(records):.0f} s wall per training run "
            f"on average ({meta.get('jobs', 1)} at a time)"
            if records
            else ""
        )
        + (
            f"; evaluation tools missing: {', '.join(meta['missing_tools'])}"
            if meta["missing_tools"]
            else ""
        ),
    ]
    if meta.get("note"):
        lines.append(f"- Note: {meta['note']}")
    if records:
        r0 = records[0]
        m = r0["model"]
        lines += [
            f"- Setup: d_model {m['d_model']}, {m['layers']} layers, baseline d_ff {m['d_ff']}, "
            f"vocabulary {m['vocab_size']}, sequence {m['seq_len']}; {r0['iterations']} iterations "
            f"x {r0['tokens_per_iteration']} tokens = "
            f"{r0['iterations'] * r0['tokens_per_iteration']:,} "
            f"training tokens per run, peak LR {r0['lr']:g} (cosine decay); validation perplexity "
            f"over the same {r0['eval_tokens']:,} held-out tokens for every run.",
        ]
        ratios = [x for x in map(late_drop_ratio, records) if x is not None]
        if ratios:
            lines.append(
                f"- Convergence: the last evaluation interval moved the validation loss by at most "
                f"{100 * max(ratios):.0f}% (median {100 * statistics.median(ratios):.0f}%) of what "
                "the first interval did, over all runs (curves in (d))."
            )
    lines += [
        "",
        "Statistics: mean ± sample std over seeds; Δ = the configuration minus uniform for the "
        "same seed, averaged over seeds (± std of those differences); `beyond seed spread` is "
        "`yes` when the mean difference is larger than each of the two std's and the std of "
        "the differences.",
        "",
    ]
    keys = plot_keys(by, records, only)
    sections = [
        (
            "controlled",
            "(a) Controlled experiment: which third gets the width",
            table_controlled(by, scale, meta.get("widths", {})) if "controlled" in only else None,
        ),
        ("sweep", "(b) Schedule sweep", table_sweep(by, scale) if "sweep" in only else None),
        ("archs", "(c) Four architectures", table_archs(by, scale) if "archs" in only else None),
    ]
    for key, title, table in sections:
        if table is None:
            continue
        lines += [f"## {title}", "", *table, ""]
        if key in keys:
            lines += [f"![{key}](results/{PLOTS[key]})", ""]
    if "curves" in keys:
        lines += [
            "## (d) Validation curves",
            "",
            "Validation perplexity against training tokens, mean over seeds.",
            "",
            f"![curves](results/{PLOTS['curves']})",
            "",
        ]
    if "alignment" in only:
        lines += ["## (e) Alignment with the residual stream", ""]
        if "alignment" in keys:
            lines += [
                "ρ_block(l) = cos(h_{l+1} - h_l, h_l), ρ_mlp(l) = cos(F_l(z_l), h_l), averaged "
                "over tokens; mean ± std over seeds. Paper: near 0 in early and middle layers, "
                "rising in late layers.",
                "",
                *table_alignment(by),
                "",
                f"![alignment](results/{PLOTS['alignment']})",
                "",
            ]
        else:
            lines += ["Not measured (the alignment tool was not available or no run finished).", ""]
    if "archs" in only:
        lines += ["## (f) Zero-shot accuracy", ""]
        if "zeroshot" in keys:
            lines += [
                "Accuracy in percent on the shipped local tasks, mean ± std over seeds.",
                "",
                *table_zeroshot(by, _tasks(records), scale),
                "",
                f"![zeroshot](results/{PLOTS['zeroshot']})",
                "",
            ]
        else:
            lines += ["Not measured (the zero-shot tool was not available or no run finished).", ""]
    if meta.get("plan"):
        lines += ["## Launch plan", "", "```", *meta["plan"].splitlines(), "```", ""]
    lines += ["## Reading", "", *reading(by, records, only), ""]
    return "\n".join(lines)


def write_results(results_dir: Path, meta: dict[str, Any]) -> Path:
    """Write ``meta.json``, the plots and ``RESULTS.md`` under ``results_dir`` from saved files."""
    res = results_dir / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    records = load_records(res / "runs")
    by = _by_variant(records)
    keys = plot_keys(by, records, meta["only"])
    for name in PLOTS.values():
        (res / name).unlink(missing_ok=True)
    plot_all(by, keys, res)
    out = results_dir / "RESULTS.md"
    out.write_text(render(records, meta))
    return out


def sync_records(settings: ex.Settings, runs: list[ex.Run], dest: Path) -> int:
    """:func:`collect`, after removing saved records of runs outside this plan."""
    names = {r.name for r in runs}
    if dest.exists():
        for d in dest.iterdir():
            if d.is_dir() and d.name not in names:
                shutil.rmtree(d)
    return collect(settings, runs, dest)


# ----------------------------------------------------------------------------- GPU scales
def planned_widths(settings: ex.Settings, runs: list[ex.Run]) -> dict[str, list[int]]:
    """Per-layer d_ff of every planned variant, from its preset (for tables of runs not run)."""
    from tapered_megatron.config import load_config

    out = {}
    for v in {r.variant for r in runs}:
        cfg = load_config(
            settings.scale.presets[v.arch], [*settings.scale.overrides, *v.overrides()]
        )
        out[v.key] = list(cfg.taper_plan.widths)
    return dict(sorted(out.items()))


def _gpus(launcher: list[str]) -> int:
    for flag in ("--num_gpus", "--nproc_per_node", "-np", "-n"):
        if flag in launcher[:-1]:
            return int(launcher[launcher.index(flag) + 1])
    return 8


def launch_plan(settings: ex.Settings, runs: list[ex.Run], device: str = "h100") -> str:
    """The commands of every run and their cost in GPU-hours (planner step-time estimate)."""
    from tapered_megatron import plan as planner
    from tapered_megatron.config import ConfigError, load_config
    from tapered_megatron.pipeline import cost as costlib

    gpus = _gpus(settings.launcher)
    dev = costlib.get_device(device, gpus_per_node=min(gpus, 8))
    cap = 0.9 * dev.mem_bytes
    lines = [f"{len(runs)} runs on {gpus} x {dev.name} each (planner estimate, best layout):"]
    per_arch: dict[str, float] = {}
    total = 0.0
    for a in sorted({r.variant.arch for r in runs}, key=ex.ARCHS.index):
        cfg = load_config(settings.scale.presets[a])
        try:
            ranked, _ = planner.plan(cfg, gpus, dev, cap)
        except ConfigError as e:  # a layout the planner tried is not a valid config
            lines.append(f"  {a} ({cfg.name}): the planner failed ({e})")
            continue
        if not ranked:
            lines.append(f"  {a}: nothing fits on {gpus} GPUs; use more GPUs")
            continue
        best = ranked[0]
        hours = best.step_s * cfg.train.iters * gpus / 3600
        per_arch[a] = hours
        n = sum(r.variant.arch == a for r in runs)
        total += n * hours
        lines.append(
            f"  {a} ({cfg.name}): {best.label}, {best.step_s:.2f} s/step x {cfg.train.iters} "
            f"steps = {hours:,.0f} GPU-hours per run x {n} runs"
        )
    lines.append(f"total: {total:,.0f} GPU-hours ({total / gpus:,.0f} h wall on {gpus} GPUs)")
    lines.append("commands (run from the repo root; the driver runs them in this order):")
    lines += ["  " + " ".join(settings.command(r)) for r in runs]
    return "\n".join(lines)
