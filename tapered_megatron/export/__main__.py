"""``python -m tapered_megatron.export``: a training checkpoint -> a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys

from tapered_megatron.export.load import PLUGINS_HELP, ExportError


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and export; one-line errors, exit status 2 on bad input."""
    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.export",
        description="Consolidate a checkpoint of any layout (DP, ZeRO 0-3, TP, PP) into one "
        "Hugging Face-style directory: model.safetensors, config.json, tokenizer, README.md.",
    )
    ap.add_argument("--checkpoint", required=True, help="a run's train.save_dir (or a tag dir)")
    ap.add_argument("--tag", default=None, help="e.g. global_step200 (default: latest)")
    ap.add_argument("--out", required=True, help="output directory (must be new or empty)")
    ap.add_argument(
        "--tokenizer-model",
        default=None,
        help="sentencepiece model to ship (default: the run's data.tokenizer_model or the "
        "sample-corpus tokenizer)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--plugins", nargs="+", default=[], help=PLUGINS_HELP)
    a = ap.parse_args(argv)
    from tapered_megatron.export.writer import export_checkpoint

    try:
        export_checkpoint(
            a.checkpoint, a.out, a.tag, a.tokenizer_model, a.overwrite, plugins=tuple(a.plugins)
        )
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
