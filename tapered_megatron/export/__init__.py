"""Consolidate training checkpoints of any layout and export them as Hugging Face directories.

Command line::

    python -m tapered_megatron.export --checkpoint DIR [--tag global_stepN] --out OUT \\
        [--tokenizer-model tok.model] [--dtype float32|bfloat16] [--max_shard_size 5GB] \\
        [--overwrite]

From Python: :func:`export_checkpoint` (writes ``OUT``), :func:`load_model` (an export or a
checkpoint as our own single-process module, for evaluation), :func:`consolidate` (the full
state dict of a checkpoint). Needs the ``export`` extra (``safetensors``, ``transformers``)
for writing and reading exports; reading checkpoints needs only the core dependencies.
"""

from tapered_megatron.export.load import ExportError, LoadedModel, load_model

__all__ = ["ExportError", "LoadedModel", "consolidate", "export_checkpoint", "load_model"]


def __getattr__(name: str):
    """Import the heavier pieces on first use (deepspeed, transformers)."""
    if name == "consolidate":
        from tapered_megatron.checkpoint.consolidate import consolidate

        return consolidate
    if name == "export_checkpoint":
        from tapered_megatron.export.writer import export_checkpoint

        return export_checkpoint
    raise AttributeError(name)
