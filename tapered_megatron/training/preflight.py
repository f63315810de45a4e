"""Pre-flight: every input of a run checked before any process group starts.

:func:`check_inputs` runs in every process right after the configuration is parsed (see
:func:`tapered_megatron.training.launch.setup`) and raises a one-line
:class:`~tapered_megatron.config.ConfigError` naming the problem and the fix; ``pretrain/main.py``
prints it and exits 2. It reads only file headers, sizes and the tokenizer (the data package's
own MMIDIDX validation on open), writes nothing, and creates no directory.

Checked: the ds_config's optimizer and scheduler parameters (numbers, not quoted numbers), the
dataset files (missing, unreadable, corrupt or truncated index, truncated or oversized data,
fewer tokens than one sample, a ``data.split`` leaving training no sample), blend weights, the
tokenizer (missing, unreadable, larger than ``model.vocab_size``), ``train.save_dir``
(writable, enough free disk for the next checkpoint from the parameter and optimizer bytes; no
other run's checkpoints in it unless resumed or moved aside), ``train.resume`` (exists,
complete, same model and taper as this run; saved under this run's parallel layout unless it
holds the layout-free ``universal/`` copy) and ``logging.wandb_project`` (the ``wandb`` package
present). The checks of ``train.save_dir`` and ``train.resume`` are
:mod:`tapered_megatron.checkpoint.preflight`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tapered_megatron.checkpoint.layout import ParallelLayout
from tapered_megatron.checkpoint.preflight import check_owner, check_resume, check_save_dir
from tapered_megatron.config import Config, ConfigError
from tapered_megatron.config_fields import first_line


def check_inputs(
    cfg: Config, ds_config: dict[str, Any], layout: ParallelLayout | None = None
) -> None:
    """Raise :class:`ConfigError` for the first bad input of ``cfg``; touch nothing.

    ``layout`` (:class:`~tapered_megatron.checkpoint.layout.ParallelLayout`) is the run's layout;
    with it, resuming under another layout needs a checkpoint holding ``universal/``."""
    check_ds_params(ds_config)
    check_data(cfg)
    check_tokenizer(cfg)
    check_save_dir(cfg, ds_config)
    check_resume(cfg, layout)
    check_owner(cfg)
    check_logging(cfg)


#: DeepSpeed optimizer and scheduler parameters that take numbers (``betas``: a list of them).
_NUMERIC_PARAMS = {
    "lr", "betas", "eps", "weight_decay", "momentum", "dampening", "max_grad_norm",
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps",
    "warmup_min_ratio", "cos_min_ratio", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate",
}  # fmt: skip


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_ds_params(ds_config: dict[str, Any]) -> None:
    """The ds_config's ``optimizer.params`` / ``scheduler.params`` hold numbers where DeepSpeed
    needs them (a quoted ``"3e-4"`` fails inside ``deepspeed.initialize``, after the process
    group): every key of :data:`_NUMERIC_PARAMS`, and any value written as a quoted number."""
    for section in ("optimizer", "scheduler"):
        params = (ds_config.get(section) or {}).get("params", {})
        if not isinstance(params, dict):
            raise ConfigError(
                f'ds_config "{section}.params": {json.dumps(params)[:60]} is not a JSON object'
            )
        for key, value in params.items():
            items = value if isinstance(value, list) else [value]
            quoted = any(isinstance(v, str) and _is_number(v) for v in items)
            if (key in _NUMERIC_PARAMS or quoted) and not all(_number(v) for v in items):
                fix = [float(v) if isinstance(v, str) and _is_number(v) else v for v in items]
                shown = json.dumps(fix if isinstance(value, list) else fix[0])
                raise ConfigError(
                    f'ds_config "{section}.params.{key}": {json.dumps(value)[:60]} is not a '
                    f'number; write "{key}": {shown} (without quotes)'
                )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_logging(cfg: Config) -> None:
    """``logging.wandb_project`` needs the ``wandb`` package (the optional ``wandb`` extra)."""
    if not cfg.logging.wandb_project:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"logging.wandb_project: the wandb package does not import ({e}); "
            "pip install 'tapered-megatron[wandb]' (or wandb), or drop --logging.wandb_project"
        ) from None


def check_data(cfg: Config) -> None:
    """``data.path``: blend weights, each prefix's .idx/.bin (MMIDIDX validation), sample size;
    the same for every prefix of ``eval.extra_paths``."""
    from tapered_megatron.data import parse_blend

    for prefix in cfg.eval.extra_paths:
        _check_prefix(cfg, "eval.extra_paths", prefix)
    if not cfg.data.path:
        return  # the sample corpus shipped in the repo, built on first use
    try:
        pairs = parse_blend(cfg.data.path)
    except ValueError as e:
        raise ConfigError(
            f"data.path: {e}; write a prefix or 'w1 prefix1 w2 prefix2 ...' "
            "with finite weights >= 0 and a positive sum"
        ) from None
    for weight, prefix in pairs:
        _check_prefix(cfg, "data.path", prefix, sampled=weight > 0)


def _check_prefix(cfg: Config, key: str, prefix: str, sampled: bool = True) -> None:
    """One token-file pair of ``key``: readable, valid, (when ``sampled``) holding at least
    one sample of ``model.seq_len + 1`` tokens, and every token id below ``model.vocab_size``
    (scanned once per content; a marker in ``data.cache_dir`` remembers it)."""
    from tapered_megatron.data import IndexedDataset, IndexedDatasetError

    try:
        ds = IndexedDataset(prefix)
    except IndexedDatasetError as e:
        raise ConfigError(
            f"{key}: {e}; point --{key} at a complete .bin/.idx pair "
            "(re-run data_tools/tokenize.py to rebuild it)"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"{key}: cannot read {prefix}.idx/.bin ({e.strerror}); fix its permissions"
        ) from None
    need = cfg.model.seq_len + 1
    if sampled and ds.num_tokens < need:
        raise ConfigError(
            f"{key}: {prefix} holds {ds.num_tokens} tokens, fewer than one sample of "
            f"model.seq_len + 1 = {need}; use more data or a smaller --model.seq_len"
        )
    if sampled and key == "data.path":
        _check_split(cfg, prefix, ds)
    from tapered_megatron.data.blended import check_vocab_cached

    try:
        check_vocab_cached(ds, cfg.model.vocab_size, cfg.data.cache_dir)
    except IndexedDatasetError as e:
        raise ConfigError(
            f"{key}: {e}; tokenize with a tokenizer of at most model.vocab_size = "
            f"{cfg.model.vocab_size} entries or raise --model.vocab_size"
        ) from None


def _check_split(cfg: Config, prefix: str, ds: Any) -> None:
    """``data.split`` leaves the training split of ``prefix`` at least one sample."""
    from tapered_megatron.data import split_ranges

    start, end = split_ranges(cfg.data.split, ds.num_documents)[0]
    tokens = int(ds.document_lengths[start:end].sum()) if end > start else 0
    if tokens < cfg.model.seq_len + 1:
        raise ConfigError(
            f"data.split {cfg.data.split!r} leaves the training split of {prefix} {end - start} "
            f"documents ({tokens} tokens), fewer than one sample of model.seq_len + 1 = "
            f"{cfg.model.seq_len + 1}; give training a larger share, e.g. --data.split 969,30,1"
        )


def check_tokenizer(cfg: Config) -> None:
    """``data.tokenizer_model`` exists, loads, and fits in ``model.vocab_size``."""
    path = cfg.data.tokenizer_model
    if not path:
        return
    if not os.path.isfile(path):
        raise ConfigError(
            f"data.tokenizer_model: {path} does not exist; pass the sentencepiece .model file "
            "the data was tokenized with"
        )
    from tapered_megatron.data import load_tokenizer

    try:
        vocab = load_tokenizer(path).vocab_size
    except (OSError, RuntimeError) as e:
        raise ConfigError(
            f"data.tokenizer_model: {path} is not a readable sentencepiece model "
            f"({first_line(e)}); "
            "pass the .model file the data was tokenized with"
        ) from None
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({vocab}); set --model.vocab_size {vocab}"
        )
