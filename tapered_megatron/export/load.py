"""Load an exported model directory or a training checkpoint as our own module.

``load_model(model=OUT)`` reads ``config.json`` and the weights of an export (``model.safetensors``
or the shards ``model.safetensors.index.json`` lists), after checking every file against the
export's ``manifest.json`` (:func:`check_export`);
``load_model(checkpoint=DIR, tag=T)`` consolidates a training checkpoint in memory. Both give a
:class:`LoadedModel` with the single-process :class:`~tapered_megatron.models.LanguageModel`,
its :class:`~tapered_megatron.config.Config` and the tokenizer the model was trained with (when
known). Only ``safetensors`` is needed for exports; nothing here imports ``transformers``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapered_megatron.checkpoint.errors import ExportError
from tapered_megatron.checkpoint.manifest import EXPORT_MANIFEST, manifest_problem
from tapered_megatron.config import Config, ConfigError, config_from_dict
from tapered_megatron.models import LanguageModel, build_model

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # Hugging Face's index of a sharded model
CONFIG = "config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --dtype of export and eval
PLUGINS_HELP = (
    "model.plugins to import: modules or .py files defining the model's architecture (the ones a "
    "checkpoint or export names are never imported: importing runs their code)"
)
TOKENIZER_MODEL = "tokenizer.model"


@dataclass
class LoadedModel:
    """A model ready for evaluation, with where it came from."""

    module: LanguageModel
    cfg: Config
    tokenizer_model: str | None  # sentencepiece model the run was trained with, if known
    source: str  # the export directory or checkpoint tag directory
    iteration: int | None = None  # training iteration (checkpoints and exports)


def check_dtype(dtype: str) -> None:
    """Refuse a ``--dtype`` (export and evaluation) that is not one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")


def check_export(model_dir: str | Path) -> None:
    """Refuse an export whose files differ from its ``manifest.json`` (one line naming the
    file; streamed sha256, as a checkpoint's ``complete`` is checked): a manifest missing or not
    listing exactly the export's files, or a symbolic link in it, is refused too."""
    why = manifest_problem(Path(model_dir), record=EXPORT_MANIFEST)
    if why is not None:
        raise ExportError(f"{why}; refused (export the checkpoint again or fetch a good copy)")


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of an export: ``model.safetensors``, or the shards its index
    ``model.safetensors.index.json`` lists (plain file names inside the directory)."""
    d = Path(model_dir)
    if (d / WEIGHTS).is_file():
        return [d / WEIGHTS]
    if not (d / WEIGHTS_INDEX).is_file():
        raise ExportError(f"--model {d}: no {WEIGHTS} and no {WEIGHTS_INDEX}")
    index = _received_json(d / WEIGHTS_INDEX)
    files = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(files, dict):
        raise ExportError(f"{d / WEIGHTS_INDEX}: no 'weight_map' mapping; refused")
    names = sorted({str(name) for name in files.values()})
    for name in names:
        if Path(name).name != name or not (d / name).is_file():
            raise ExportError(f"{d / WEIGHTS_INDEX}: lists {name!r}, not a file of {d}")
    return [d / n for n in names]


def _received_json(path: Path) -> Any:
    """A JSON file of an export, parsed within the bounds of
    :mod:`tapered_megatron.checkpoint.received`."""
    from tapered_megatron.checkpoint.received import ReceivedFileError, load_json

    try:
        return load_json(path)
    except ReceivedFileError as e:
        raise ExportError(f"{e}; refused") from None


def read_export_config(
    model_dir: str | Path, plugins: tuple[str, ...] = ()
) -> tuple[Config, dict[str, Any]]:
    """The run config of an export directory and its raw ``config.json`` (its ``model.plugins``
    never imported; ``plugins``, the caller's ``--plugins``, are)."""
    d = Path(model_dir)
    path = d / CONFIG
    if not path.is_file():
        raise ExportError(
            f"--model {d}: no {CONFIG} (not an export directory; make one with "
            "python -m tapered_megatron.export --checkpoint DIR --out OUT)"
        )
    raw = _received_json(path)
    if not isinstance(raw, dict) or "tapered_config" not in raw:
        raise ExportError(f"--model {d}: {CONFIG} is not a tapered-megatron export")
    try:
        cfg = config_from_dict(raw["tapered_config"], plugins)
    except ConfigError as e:
        raise ExportError(f"recorded configuration is not valid here: {e}") from None
    if list(cfg.taper_plan.widths) != (raw.get("taper_widths") or list(cfg.taper_plan.widths)):
        raise ExportError(
            f"--model {d}: recorded taper widths {raw['taper_widths']} differ from the plan of "
            f"its configuration here ({list(cfg.taper_plan.widths)}); use the tapered_megatron "
            "version that exported it"
        )
    return cfg, raw


def module_from_state(cfg: Config, state: dict[str, torch.Tensor]) -> LanguageModel:
    """``build_model(cfg)`` on the meta device, then the given full weights assigned to it."""
    module = build_model(cfg, device="meta")
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ExportError(
            f"weights do not match the configuration: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    _reset_rope(module)
    return module.eval()


def _reset_rope(module: torch.nn.Module) -> None:
    """Compute the RoPE tables of a module built on the meta device (non-persistent buffers)."""
    from tapered_megatron.models.layers import RotaryEmbedding, rope_tables

    for m in module.modules():
        if isinstance(m, RotaryEmbedding):
            m.cos, m.sin = rope_tables(m.head_dim, m.cos.shape[0], m.theta)


def load_export(
    model_dir: str | Path, plugins: tuple[str, ...] = (), dtype: str = "float32"
) -> LoadedModel:
    """Our module from an export directory (``config.json`` + its weights, checked against its
    manifest first) in ``dtype`` (whatever the export stores); ``plugins`` as for
    :func:`read_export_config`."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    check_export(d)
    cfg, raw = read_export_config(d, plugins)
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        state.update(load_file(str(f)))
    module = module_from_state(cfg, state).to(DTYPES[dtype])
    tok = d / TOKENIZER_MODEL
    return LoadedModel(
        module, cfg, str(tok) if tok.is_file() else None, str(d), raw.get("iteration")
    )


def load_model(
    model: str | Path | None = None,
    checkpoint: str | Path | None = None,
    tag: str | None = None,
    plugins: tuple[str, ...] = (),
    dtype: str = "float32",
) -> LoadedModel:
    """An export directory (``model``) or a training checkpoint (``checkpoint`` [+ ``tag``]) in
    ``dtype`` (``--dtype``); ``plugins`` (``--plugins``) define an architecture from outside the
    package (the saved configuration's own list is never imported)."""
    if (model is None) == (checkpoint is None):
        raise ExportError("give exactly one of --model OUT or --checkpoint DIR")
    check_dtype(dtype)
    if model is not None:
        return load_export(model, plugins, dtype)
    from tapered_megatron.checkpoint.consolidate import consolidate, resolve_checkpoint

    ref = resolve_checkpoint(checkpoint, tag, plugins)
    module = module_from_state(ref.cfg, consolidate(ref)).to(DTYPES[dtype])
    return LoadedModel(module, ref.cfg, run_tokenizer(ref.cfg), str(ref.tag_dir), ref.iteration)


def check_tokenizer(path: str, cfg: Config) -> None:
    """Reject a tokenizer whose vocabulary cannot be the model's."""
    from tapered_megatron.data import load_tokenizer

    if not os.path.isfile(path):
        raise ExportError(f"tokenizer {path}: no such file")
    vocab = load_tokenizer(path).vocab_size
    if vocab > cfg.model.vocab_size:
        raise ExportError(
            f"tokenizer {path} has {vocab} tokens but the model's vocabulary is "
            f"{cfg.model.vocab_size}: not the tokenizer this model was trained with; pass "
            "--tokenizer-model with the run's data.tokenizer_model"
        )


def run_tokenizer(cfg: Config) -> str | None:
    """The sentencepiece model a run was trained with: ``data.tokenizer_model``, or the sample
    corpus tokenizer (prepared under ``data.cache_dir`` if needed) when ``data.path`` is empty;
    ``None`` for a dataset given without a tokenizer."""
    if cfg.data.tokenizer_model:
        return cfg.data.tokenizer_model
    if cfg.data.path:
        return None
    from tapered_megatron.data import prepare_sample_corpus

    return prepare_sample_corpus(cfg.data.cache_dir, cfg.model.vocab_size)[0]
