"""The Markdown tables (a), (b), (c), (e) and (f) of RESULTS.md, beside the paper's figures."""

from __future__ import annotations

from typing import Any

from experiments.tlm import grid
from experiments.tlm.stats import Paired, Stat, pm, ppl_stat, rho_stats, signed_pm, zs_stat

# The paper's 440M validation perplexities (arXiv 2606.23670).
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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _compare_cells(v: grid.Variant, by: dict, base_key: str) -> list[str]:
    st = ppl_stat(by.get(v.key))
    seeds = ", ".join(f"{x:.2f}" for _, x in sorted(st.values.items())) or "—"
    if v.key == base_key or st.n == 0:
        return [pm(st), seeds, "—", "—"]
    p = Paired(st, ppl_stat(by.get(base_key)))
    return [pm(st), seeds, signed_pm(p.diffs), p.exceeds]


def compare_header(scale: str) -> list[str]:
    """Headers of the four comparison columns."""
    return [f"ours ({scale}): val ppl", "per seed", "Δ vs uniform (paired)", "beyond seed spread"]


def _widths(by: dict, v: grid.Variant, planned: dict[str, list[int]]) -> str:
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
    for v in grid.experiment_variants("controlled"):
        name = v.label.split(" ")[0]
        rows.append([v.label, _widths(by, v, planned), f"{PAPER_CONTROLLED[name]:.2f}"])
        rows[-1] += _compare_cells(v, by, grid.UNIFORM.key)
    head = ["configuration", f"d_ff per layer ({scale})", "paper 440M ppl"]
    return _table(head + compare_header(scale), rows)


def table_sweep(by: dict, scale: str) -> list[str]:
    """(b): schedule x ratio pair."""
    rows = [["uniform", "—", "16.28", *_compare_cells(grid.UNIFORM, by, grid.UNIFORM.key)]]
    for r in grid.SWEEP_RATIOS:
        for i, s in enumerate(grid.SWEEP_SCHEDULES):
            v = grid.Variant("transformer", s, r)
            rows.append([s, f"{r[0]:g}/{r[1]:g}", f"{PAPER_SWEEP[r][i]:.2f}"])
            rows[-1] += _compare_cells(v, by, grid.UNIFORM.key)
    return _table(["schedule", "ratio", "paper 440M ppl", *compare_header(scale)], rows)


def table_archs(by: dict, scale: str) -> list[str]:
    """(c): four architectures x {uniform, cosine 1.5/0.5, reverse}."""
    rows = []
    for v in grid.experiment_variants("archs"):
        base = grid.Variant(v.arch).key
        rows.append([v.arch, v.label, *_compare_cells(v, by, base)])
    return _table(["architecture", "configuration", *compare_header(scale)], rows)


def table_alignment(by: dict) -> list[str]:
    """(e): per-layer rho_block and rho_mlp of the uniform and tapered Transformer."""
    uni, tap = grid.experiment_variants("alignment")
    cols = [rho_stats(by, uni, "rho_block"), rho_stats(by, tap, "rho_block")]
    cols += [rho_stats(by, uni, "rho_mlp"), rho_stats(by, tap, "rho_mlp")]
    n = max(len(c) for c in cols)
    rows = [[str(i)] + [pm(c[i], 3) if i < len(c) else "—" for c in cols] for i in range(n)]
    head = ["layer", "uniform ρ_block", "tapered ρ_block", "uniform ρ_mlp", "tapered ρ_mlp"]
    return _table(head, rows)


def zeroshot_tasks(records: list[dict[str, Any]]) -> list[str]:
    """The zero-shot task names any record has, sorted."""
    return sorted({t for r in records if r.get("zeroshot") for t in r["zeroshot"]["tasks"]})


def table_zeroshot(by: dict, tasks: list[str], scale: str) -> list[str]:
    """(f): average zero-shot accuracy (percent) of the (c) models, with each task's accuracy."""
    rows = []
    for v in grid.experiment_variants("archs"):
        st = zs_stat(by.get(v.key))
        base = zs_stat(by.get(grid.Variant(v.arch).key))
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


# (c)'s architectures as implemented here: what each adds to or changes from its paper, one line.
ARCH_NOTES = {
    "transformer": "Transformer++ (RMSNorm, SwiGLU, RoPE), as the paper.",
    "gated_attention": "G1 sigmoid output gate per head (Qiu et al. 2025); the MLP width shrunk "
    "to give the gate's parameters back.",
    "titans": "MAG: sliding-window attention with 4 persistent tokens, the memory rule re-derived "
    "from the paper's equations; ours: chunk-start (mini-batch) gradients, a per-token clip of "
    "each memory gradient (its activity logged as memory_clip), forgetting half-lives spread "
    "over heads; the MLP width shrunk to give the memory branch's parameters back.",
    "hope_attention": "attention + a Continuum Memory System of SwiGLU levels splitting the MLP "
    "width; ours: updates inside the sequence at period boundaries, every level taught by the "
    "final layer's error signal (teach; not each level's own), normalised, clipped steps; "
    "1.7-2.1x the transformer's training FLOPs per token at equal parameters.",
}


def _against(r: dict, ref: dict | None, key: str) -> str:
    """`` (1.02x)``: ``r[key]`` over the transformer's ``ref[key]`` where that was recorded."""
    return f" ({r[key] / ref[key]:.2f}x)" if ref and key in ref else ""


def _probe(runs: dict | None, i: int) -> str:
    gaps = {
        s: r["memory_probe"][i]["gap"] for s, r in (runs or {}).items() if r.get("memory_probe")
    }
    return pm(Stat(gaps), 3)


def table_budget_and_memory(by: dict, scale: str) -> list[str]:
    """(c)'s budgets and memory probe: per configuration its parameters and training FLOPs per
    token (as run, and against the transformer's of the same configuration), its validation
    perplexity and, for the memory architectures, what switching the in-context memory off at
    evaluation costs (nats; at the training length and at 4x it)."""
    rows = []
    for v in grid.experiment_variants("archs"):
        runs = by.get(v.key)
        ref = by.get(grid.Variant("transformer", v.schedule, v.ratio, v.reverse).key)
        r = next(iter(runs.values())) if runs else None
        r0 = next(iter(ref.values())) if ref else None
        if r is None or "params" not in r:
            rows.append([v.arch, v.label, "—", "—", pm(ppl_stat(runs)), "—", "—"])
            continue
        mem, flops = v.arch in grid.MEMORY_ARCHS, "train_flops_per_token"
        rows.append(
            [
                v.arch,
                v.label,
                f"{r['params'] / 1e6:.3f}M{_against(r, r0, 'params')}",
                f"{r[flops] / 1e6:.1f}M{_against(r, r0, flops)}",
                pm(ppl_stat(runs)),
                _probe(runs, 0) if mem else "—",
                _probe(runs, 1) if mem else "—",
            ]
        )
    head = ["architecture", "configuration", "params", "train FLOPs/token"]
    head += [f"val ppl ({scale})", "memory off − on (nats)", "at 4x the sequence"]
    return _table(head, rows)
