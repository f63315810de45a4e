"""Print a model's parameters, FLOPs and activation bytes per layer, with its taper plan.

    python -m tapered_megatron.models.summary --config transformer_760m [overrides] [--json]
    python -m tapered_megatron.models.summary --compare 440m 760m 1.3b [--json]

Counts come from :func:`tapered_megatron.models.count_model`; the model is also built on the
meta device (no memory) and its parameter count printed beside the counted one, so multi-billion
presets are summarised without allocating. ``--compare`` prints the built-in architectures'
presets ``<arch>_<scale>`` side by side: parameters and training FLOPs per token (forward and
backward, Hope's teach-signal pass included), each as a ratio to the transformer's.
"""

from __future__ import annotations

import argparse
import json
import sys

from tapered_megatron.architectures import BUILT_IN, ArchitectureError
from tapered_megatron.config import ConfigError, load_config, preset_names
from tapered_megatron.models.counters import count_model
from tapered_megatron.models.language_model import meta_param_count


def _fmt(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def compare(scales: list[str]) -> list[dict]:
    """One row per scale and built-in architecture with a preset ``<arch>_<scale>``: its
    parameters and training FLOPs per token, and their ratios to ``transformer_<scale>``'s."""
    archs = BUILT_IN
    presets = set(preset_names())
    rows = []
    for scale in scales:
        if f"transformer_{scale}" not in presets:
            known = sorted(
                n.removeprefix("transformer_") for n in presets if n.startswith("transformer_")
            )
            raise ConfigError(f"--compare {scale}: no preset transformer_{scale}; pick a scale "
                              f"with presets ({', '.join(known)})")  # fmt: skip
        base = count_model(load_config(f"transformer_{scale}"))
        for arch in archs:
            if f"{arch}_{scale}" not in presets:
                continue
            c = count_model(load_config(f"{arch}_{scale}"))
            rows.append(
                {
                    "scale": scale,
                    "arch": arch,
                    "params": c.params_total,
                    "params_ratio": c.params_total / base.params_total,
                    "train_flops_per_token": c.train_flops_per_token,
                    "flops_ratio": c.train_flops_per_token / base.train_flops_per_token,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m tapered_megatron.models.summary")
    ap.add_argument("--config", default="quickstart", help="preset name or YAML path")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--dtype-bytes", type=int, default=2, help="activation element size (2 bf16, 4 fp32)"
    )
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="SCALE",
        help="the architectures' presets <arch>_<SCALE> side by side (params, FLOPs per token)",
    )
    a, rest = ap.parse_known_args(argv)
    if a.compare:
        try:
            rows = compare(a.compare)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps(rows))
            return 0
        print(f"{'scale':>6} {'architecture':<16} {'params':>14} {'x transformer':>13} "
              f"{'train FLOP/token':>16} {'x transformer':>13}")  # fmt: skip
        for r in rows:
            print(
                f"{r['scale']:>6} {r['arch']:<16} {r['params']:>14,} {r['params_ratio']:>13.3f} "
                f"{_fmt(r['train_flops_per_token']):>16} {r['flops_ratio']:>13.3f}"
            )
        return 0
    try:
        cfg = load_config(a.config, rest)
        counts = count_model(cfg, a.dtype_bytes)
        meta_params = meta_param_count(cfg)
    except (ConfigError, ArchitectureError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = counts.to_dict()
    out.update(
        config=cfg.name,
        params_meta=meta_params,
        seq_len=cfg.model.seq_len,
        taper_plan=cfg.taper_plan.to_dict(),
    )
    if a.json:
        print(json.dumps(out))
        return 0
    m = cfg.model
    print(
        f"{cfg.name}: {m.arch}, d_model {m.d_model}, {m.layers} layers, {m.heads} heads, "
        f"vocab {cfg.padded_vocab_size} (padded), seq {m.seq_len}"
    )
    print(
        f"params {counts.params_total:,} (meta-built {meta_params:,}); embedding "
        f"{counts.embedding.params:,}, head {counts.head.params:,}"
    )
    print(
        f"FLOPs/token forward {_fmt(counts.flops_per_token)}, fwd+bwd "
        f"{_fmt(counts.train_flops_per_token)}; activations/token "
        f"{_fmt(counts.act_bytes_per_token)}B at {a.dtype_bytes} B/element"
    )
    print(
        f"{'layer':>5} {'d_ff':>6} {'params':>10} {'mixer':>10} {'mlp':>10} "
        f"{'fwd+bwd FLOP/tok':>16} {'act B/tok':>10}"
    )
    for l in counts.layers:
        print(
            f"{l.layer:>5} {l.d_ff:>6} {_fmt(l.total.params):>10} {_fmt(l.mixer.params):>10} "
            f"{_fmt(l.mlp.params):>10} {_fmt(3 * l.total.flops):>16} "
            f"{_fmt(l.total.act_bytes):>10}"
        )
    print(cfg.taper_plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
