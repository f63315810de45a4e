"""``python -m tapered_megatron.export``: a training checkpoint -> a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys

from tapered_megatron.export.load import PLUGINS_HELP, ExportError
from tapered_megatron.export.writer import MAX_SHARD_SIZE, export_checkpoint


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and export; one-line errors, exit status 2 on bad input."""
    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.export",
        description="Consolidate a checkpoint of any layout (DP, ZeRO 0-3, TP, PP) into one "
        "Hugging Face-style directory: model.safetensors (or shards and their index), "
        "config.json, tokenizer, README.md, manifest.json. Tensors are read and written one at "
        "a time.",
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
    ap.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    ap.add_argument(
        "--max_shard_size",
        "--max-shard-size",
        default=MAX_SHARD_SIZE,
        help="largest safetensors file, as save_pretrained reads it (bytes, 500MB, 5GB, 2GiB; "
        f"default {MAX_SHARD_SIZE}); a larger model is sharded with an index",
    )
    a = ap.parse_args(argv)
    try:
        export_checkpoint(
            a.checkpoint,
            a.out,
            a.tag,
            a.tokenizer_model,
            a.overwrite,
            plugins=tuple(a.plugins),
            dtype=a.dtype,
            max_shard_size=a.max_shard_size,
        )
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
