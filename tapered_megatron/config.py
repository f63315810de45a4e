"""Typed configuration: dataclasses loaded from YAML presets, overridable with dotted flags.

Presets live in ``pretrain/configs/<name>.yaml``; a preset may start from another with
``base: <name>`` and then list only what differs. The architecture presets ``<arch>_<scale>`` are
composed: a scale's file plus the architecture record's settings at that scale
(:func:`arch_preset`). Command-line overrides use the dotted key path::

    --model.arch titans --taper.schedule uniform --train.iters 20 --taper.ratio 1.5 0.5

Unknown keys, wrong types and impossible combinations raise :class:`ConfigError` whose message
names the key, before any process group exists. A leaf: it reads the architecture records
(:mod:`tapered_megatron.architectures`, plain data) and imports neither torch nor the model or
data code.

Public entry (stable, used by outside scripts)::

    from tapered_megatron.config import load_config
    cfg = load_config("quickstart", ["--model.arch", "gated_attention"])

CLI: ``python -m tapered_megatron.config --config X [overrides] --print``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tapered_megatron import architectures
from tapered_megatron.architectures import Architecture, ArchitectureError
from tapered_megatron.config_fields import ConfigError, at_least
from tapered_megatron.resources import resource
from tapered_megatron.taper import (
    DEFAULT_STEP_MULTIPLIERS,
    Schedule,
    TaperError,
    TaperPlan,
    make_plan,
)

PRESET_DIR = Path(os.environ.get("TM_CONFIG_DIR", resource("presets")))
Partition = Literal["balanced", "uniform", "parameters", "megatron"]
PipelineUnit = Literal["layer", "sublayer"]
PipelineSchedule = Literal["1f1b", "interleaved", "zbv", "dualpipev", "zero_bubble"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class ModelConfig:
    """Model shape. ``d_ff`` is the uniform baseline width the taper redistributes.

    The settings of ``arch`` (its record's options dataclass) are fields too: a config's
    ``model`` is of the type :func:`model_type` makes for its architecture, this class plus the
    options under the architecture's own key, written, given on the command line and read alike
    (``model.titans.chunk_size``, ``cfg.model.hope.levels``), or flat (``cfg.model.gate``). A
    config carries no other architecture's settings. ``plugins`` are modules, package folders or
    ``.py`` files imported before ``arch`` is looked up (architectures defined outside the
    package).
    """

    arch: str = "transformer"  # any registered architecture (tapered_megatron.architectures)
    d_model: int = at_least(1, 256)
    layers: int = at_least(1, 8)
    heads: int = at_least(1, 4)
    # key/value heads of every attention (grouped-query attention); must divide heads; 0: heads
    kv_heads: int = at_least(0, 0)
    d_ff: int = at_least(1, 688)
    vocab_size: int = at_least(1, 8192)
    seq_len: int = at_least(1, 256)
    make_vocab_size_divisible_by: int = at_least(1, 128)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    dropout: float = at_least(0, 0.0)  # on each block's mixer and MLP output (training only); < 1
    plugins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_heads == 0:  # the default: one key/value head per query head
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.d_model // self.heads

    def to_dict(self) -> dict[str, Any]:
        """Plain dictionary; the options sit under the architecture's own key."""
        return _plain(dataclasses.asdict(self))

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # rebuilt from its plain form: the type of an architecture's model config is made at
        # run time (model_type), so it cannot be pickled by name
        return _model_from_plain, (self.to_dict(),)


@functools.cache
def model_type(arch: Architecture) -> type[ModelConfig]:
    """:class:`ModelConfig` with ``arch``'s options as fields: the options dataclass under its
    key, or (a record with ``section=""``) each option as a field of its own."""
    key = arch.options_key
    if key is None:
        return ModelConfig
    if key:
        own = [(key, arch.options, field(default_factory=arch.options))]
    else:
        hints = typing.get_type_hints(arch.options)
        own = [
            (
                f.name,
                hints[f.name],
                field(default=f.default, default_factory=f.default_factory, metadata=f.metadata),
            )
            for f in dataclasses.fields(arch.options)
        ]
    cls = dataclasses.make_dataclass(
        f"ModelConfig[{arch.name}]", own, bases=(ModelConfig,), frozen=True
    )
    cls.__module__ = __name__
    return cls


def _model_from_plain(data: dict[str, Any]) -> ModelConfig:
    return _model_from_dict(data, "model.")


@dataclass(frozen=True)
class TaperConfig:
    """MLP width schedule (see :mod:`tapered_megatron.taper`)."""

    schedule: Schedule = "cosine"
    ratio: tuple[float, ...] = (1.5, 0.5)
    step_multipliers: tuple[float, ...] = DEFAULT_STEP_MULTIPLIERS
    reverse: bool = False
    multiple: int = at_least(1, 16)  # widths are multiples of it; tp must divide it
    sigmoid_k: float = 10.0


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout; data parallelism is whatever remains of the world size."""

    tp: int = at_least(1, 1)
    pp: int = at_least(1, 1)
    partition: Partition = "balanced"
    pipeline_unit: PipelineUnit = "layer"  # sublayer: mixer and MLP as separate pipeline units
    # split norms, residual adds, dropout and the stage boundaries along the sequence over the
    # TP group (Megatron's sequence parallelism; needs tp > 1)
    sequence_parallel: bool = False
    schedule: PipelineSchedule = "1f1b"  # 1f1b: DeepSpeed's engine; others: torch
    virtual_stages: int = at_least(1, 1)  # pipeline chunks per rank (interleaved: 2 or more)


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from. An empty ``path`` means the sample corpus shipped in the repo."""

    path: str = ""  # "prefix" or Megatron blend "w1 prefix1 w2 prefix2"
    split: str = "969,30,1"
    tokenizer_model: str = ""  # empty: the sample corpus tokenizer (built on first use)
    cache_dir: str = ".cache/tapered_megatron"
    seed: int = 1234
    num_workers: int = 0


def parse_split(split: str | tuple | list) -> list[float]:
    """``"969,30,1"`` (or ``"98/2/0"``, or a list) -> three normalised weights."""
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
        try:
            weights = [float(p) for p in parts]
        except ValueError as e:
            raise ValueError(f"split {split!r}: expected numbers like '969,30,1'") from e
    else:
        weights = [float(p) for p in split]
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r}: need 1-3 non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and checkpointing."""

    iters: int = at_least(1, 200)
    micro_batch_size: int = at_least(1, 8)
    global_batch_size: int = at_least(0, 0)  # 0: micro_batch_size * data-parallel size
    lr: float = at_least(0, 1e-3)
    min_lr: float = at_least(0, 1e-4)
    warmup_iters: int = at_least(0, 20)
    lr_decay_iters: int = at_least(0, 0)  # 0: train.iters
    weight_decay: float = at_least(0, 0.1)
    adam_beta1: float = at_least(0, 0.9, below=1)
    adam_beta2: float = at_least(0, 0.95, below=1)
    adam_eps: float = at_least(0, 1e-8)
    clip_grad: float = at_least(0, 1.0)  # 0: no clipping
    seed: int = 1234
    save_interval: int = at_least(0, 0)  # 0: only at the end
    save_dir: str = "checkpoints/quickstart"
    keep_last: int = at_least(1, 2)
    # also save universal/ (full fp32 weights + Adam moments per parameter, +12 bytes/param on
    # disk) so the checkpoint resumes under any other parallel layout; false: same layout only
    universal_checkpoint: bool = True
    resume: str = ""  # "" (fresh), "auto" (newest complete checkpoint in save_dir) or a path
    # a fresh run into a save_dir holding checkpoints: move them aside into
    # save_dir/earlier-run-<UTC time>/ (nothing is deleted); false: refuse to start
    start_over: bool = False
    exit_interval: int = at_least(0, 0)  # stop (after saving) at multiples of it; 0: never
    # on this signal (e.g. SIGUSR1, which SLURM's --signal sends before the time limit) every
    # rank stops at the same iteration boundary after saving; exit code 75. "": no handler
    exit_signal: str = ""
    compile: bool = False  # torch.compile via DeepSpeed's engine.compile (where arch compiles)
    max_skipped_steps: int = at_least(1, 10)  # consecutive non-finite steps that stop the run
    loss_spike_factor: float = at_least(0, 3.0)  # log a loss above this x running mean; 0: off
    collective_timeout_s: float = at_least(1, 600.0)  # a collective waiting longer ends the job
    # activation recomputation in backward: "none"; "selective" (the attention core and the
    # memory architectures' scan / update, keeping the linear layers' outputs); "full" (each
    # block / pipeline unit). train.checkpoint_activations true is an alias of "full"
    recompute: Recompute = "none"


@dataclass(frozen=True)
class EvalConfig:
    """Validation during training."""

    interval: int = 100  # 0: never
    iters: int = 10
    # more token-file prefixes (all their documents) whose loss is measured at each evaluation
    extra_paths: tuple[str, ...] = ()
    alignment: bool = False  # rho_block / rho_mlp per layer on the validation batches


@dataclass(frozen=True)
class LoggingConfig:
    """Console, tensorboardX and (optional) Weights & Biases logging."""

    interval: int = at_least(1, 10)
    tensorboard_dir: str = ""  # empty: <train.save_dir>/tensorboard
    peak_tflops: float = at_least(0, 0.0)  # per-device peak for MFU; 0: known device or probe
    metrics_file: str = ""  # JSON line per iteration (loss, lr, grad_norm, val_loss); "": none
    wandb_project: str = ""  # Weights & Biases project (rank 0 logs there too); "": no wandb
    wandb_mode: Literal["online", "offline"] = "online"  # offline: files only, `wandb sync` later


@dataclass(frozen=True)
class Config:
    """The whole resolved configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    taper: TaperConfig = field(default_factory=TaperConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    name: str = "custom"

    @functools.cached_property
    def taper_plan(self) -> TaperPlan:
        """The one taper plan of this configuration (computed once, immutable)."""
        t, m = self.taper, self.model
        ratios = t.step_multipliers if t.schedule == "step" else t.ratio
        return make_plan(
            m.layers,
            m.d_ff,
            t.schedule,
            tuple(ratios),
            t.multiple,
            reverse=t.reverse,
            sigmoid_k=t.sigmoid_k,
        )

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded (Megatron habit) to a multiple of the divisor; the same at any TP
        size (validation makes ``parallel.tp`` divide the divisor)."""
        unit = self.model.make_vocab_size_divisible_by
        return -(-self.model.vocab_size // unit) * unit

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dictionary (YAML/JSON ready)."""
        return _plain(dataclasses.asdict(self))

    def with_overrides(self, overrides: list[str]) -> Config:
        """A new validated config with dotted command-line overrides applied."""
        return _build(_override(self.to_dict(), parse_overrides(overrides)))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML or CLI value to the field's declared type."""
    origin = typing.get_origin(tp)
    if tp is ModelConfig:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of model fields, got {value!r}")
        return _model_from_dict(value, key + ".")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if origin is Literal:
        choices = typing.get_args(tp)
        value = _coerce(value, type(choices[0]), key)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r}; use one of {', '.join(map(str, choices))}")
        return value
    if origin in (tuple, list):
        (elem, *_rest) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_coerce(v, elem, key) for v in value)
    if origin in (typing.Union, types.UnionType):
        return _coerce(value, next(a for a in typing.get_args(tp) if a is not type(None)), key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = int(value)
        if isinstance(value, int):
            if abs(value) >= 2**62:
                raise ConfigError(f"{key}: {value} is out of range; use a value below 2**62")
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}: must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


#: Keys that were renamed: old dotted key -> new one (the old key fails with the new name).
RENAMED = {"parallel.activation_checkpointing": "train.checkpoint_activations"}


def _aliased(layer: dict[str, Any]) -> dict[str, Any]:
    """One config layer (a file, the overrides) with ``train.checkpoint_activations`` (a
    boolean alias of ``train.recompute``: true is ``full``, false ``none``) written as
    ``train.recompute``; both in one layer must agree."""
    train = layer.get("train")
    if not isinstance(train, dict) or "checkpoint_activations" not in train:
        return layer
    train = dict(train)
    flag = _coerce(train.pop("checkpoint_activations"), bool, "train.checkpoint_activations")
    value = "full" if flag else "none"
    if train.setdefault("recompute", value) != value:
        raise ConfigError(
            f"train.checkpoint_activations and train.recompute ({train['recompute']}) disagree; "
            "give train.recompute only"
        )
    return {**layer, "train": train}


def _from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """``cls(**data)`` with every value type-checked (``Literal`` choices and ``at_least``
    bounds included)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if prefix + k in RENAMED:
            raise ConfigError(f"{prefix}{k} was renamed: use {RENAMED[prefix + k]}")
        if k not in fields:
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"{prefix}{k}: unknown key; valid keys here: {valid}")
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = value = _coerce(v, hints[k], prefix + k)
        low, below = fields[k].metadata.get("min"), fields[k].metadata.get("below")
        for x in value if isinstance(value, tuple) else (value,):
            if low is not None and x < low:
                raise ConfigError(f"{prefix}{k}: must be >= {low}, got {x}")
            if below is not None and x >= below:
                raise ConfigError(f"{prefix}{k}: must be < {below}, got {x}")
    return cls(**kwargs)


def _model_from_dict(data: dict[str, Any], prefix: str) -> ModelConfig:
    """The ``model`` section: plugins imported, ``arch`` looked up in the registry, and the
    whole section (the architecture's own settings included) parsed into its
    :func:`model_type`."""
    data = dict(data)
    plugins = _coerce(data.pop("plugins", ()), tuple[str, ...], prefix + "plugins")
    name = _coerce(data.pop("arch", ModelConfig.arch), str, prefix + "arch")
    arch = _architecture(name, plugins)
    own = arch.option_names()
    for k in data:
        owners = [a.name for a in architectures.ARCHITECTURES.values() if k in a.option_names()]
        if owners and k not in own and not hasattr(ModelConfig, k):
            raise ConfigError(
                f"{prefix}{k}: a setting of model.arch {' / '.join(owners)}, but model.arch is "
                f"{name}; remove it (a config carries only its own architecture's settings)"
            )
    if arch.options_key and data.get(arch.options_key) is None:
        data.pop(arch.options_key, None)  # an empty section: the defaults
    return _from_dict(model_type(arch), {**data, "arch": name, "plugins": plugins}, prefix)


def _architecture(name: str, plugins: tuple[str, ...] | list[str] = ()) -> Architecture:
    """The record of ``name``, ``plugins`` imported first; a :class:`ConfigError` when either
    fails."""
    _load_plugins(plugins)
    try:
        return architectures.resolve_architecture(name)
    except ArchitectureError as e:
        raise ConfigError(str(e)) from None


def _load_plugins(plugins: Any) -> None:
    """:func:`tapered_megatron.architectures.load_plugins`; a :class:`ConfigError` when one
    does not load."""
    try:
        architectures.load_plugins(_coerce(plugins, tuple[str, ...], "model.plugins"))
    except ArchitectureError as e:
        raise ConfigError(str(e)) from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _override(base: dict, over: dict) -> dict:
    """``over`` merged into ``base``; when ``over`` changes ``model.arch``, the settings of the
    old architecture are dropped from ``base`` (the architecture is an override)."""
    base, over = _aliased(base), _aliased(over)
    old = base.get("model", {}).get("arch", ModelConfig.arch)
    if over.get("model", {}).get("arch", old) != old:
        model = dict(base["model"])
        _load_plugins(model.get("plugins", ()))
        arch = architectures.ARCHITECTURES.get(old)
        for key in arch.option_names() if arch else ():
            model.pop(key, None)
        base = {**base, "model": model}
    return _merge(base, over)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--a.b", "1", "--c.d=x", "--taper.ratio", "1.5", "0.5"]`` into a nested dict.

    Values stay strings (lists for several values); types are checked against the dataclasses.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            raise ConfigError(
                f"unexpected argument {tok!r}: overrides look like --section.key value"
            )
        key, eq, val = tok[2:].partition("=")
        vals: list[str] = [val] if eq else []
        i += 1
        while (
            not eq and i < len(args) and not (args[i].startswith("--") and not _is_number(args[i]))
        ):
            vals.append(args[i])
            i += 1
        if not vals:
            raise ConfigError(f"--{key}: missing value")
        if "." not in key:
            raise ConfigError(f"--{key}: unknown option; config overrides look like --section.key")
        node = out
        *path, leaf = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        if leaf in node:
            raise ConfigError(f"--{key}: given twice")
        node[leaf] = vals[0] if len(vals) == 1 else vals
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def preset_path(name_or_path: str) -> Path:
    """Resolve a preset name (``quickstart``) or a YAML path to a file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"--config: file {name_or_path} does not exist")
        return p
    q = PRESET_DIR / f"{name_or_path}.yaml"
    if not q.exists():
        raise ConfigError(
            f"--config: no preset named {name_or_path!r}; known presets: "
            f"{', '.join(preset_names())}"
        )
    return q


def scales() -> list[str]:
    """The scales of the architecture presets: the files ``scales/<scale>.yaml`` of the preset
    folder (a name starting with ``_`` is a shared base, not a scale)."""
    return sorted(p.stem for p in (PRESET_DIR / "scales").glob("[!_]*.yaml"))


def preset_names() -> list[str]:
    """Every preset: the files of the preset folder and ``<arch>_<scale>`` for each registered
    architecture and scale (:func:`arch_preset`)."""
    files = {p.stem for p in PRESET_DIR.glob("*.yaml")}
    return sorted(files | {f"{a}_{s}" for a in architectures.ARCHITECTURES for s in scales()})


def arch_preset(name: str) -> dict[str, Any] | None:
    """The preset ``<arch>_<scale>`` where no file has that name: the scale's file, then
    ``model.arch``, ``train.save_dir`` (``checkpoints/<name>``) and the record's layer for that
    scale (:attr:`~tapered_megatron.architectures.Architecture.presets`); ``None`` when
    ``name`` is a file or names no registered architecture and scale."""
    if Path(name).suffix in (".yaml", ".yml") or (PRESET_DIR / f"{name}.yaml").exists():
        return None
    for arch in architectures.ARCHITECTURES.values():
        scale = name.removeprefix(f"{arch.name}_")
        if scale != name and scale in scales():
            own = {"model": {"arch": arch.name}, "train": {"save_dir": f"checkpoints/{name}"}}
            layer = _merge(own, copy.deepcopy(dict(arch.presets.get(scale, {}))))
            return _override(_load_yaml(str(PRESET_DIR / "scales" / f"{scale}.yaml")), layer)
    return None


def _load_yaml(name_or_path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    composed = arch_preset(name_or_path)
    if composed is not None:
        return composed
    path = preset_path(name_or_path)
    if str(path) in seen:
        raise ConfigError(f"{path}: 'base' chain loops back on itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base:
        base_path = Path(base)
        if not base_path.is_absolute() and base_path.suffix in (".yaml", ".yml"):
            base = str(path.parent / base_path)
        data = _override(_load_yaml(base, (*seen, str(path))), data)
    return data


def _build(data: dict[str, Any]) -> Config:
    cfg = _from_dict(Config, {"model": {}, **_aliased(data)})
    validate(cfg)
    return cfg


def load_config(name_or_path: str = "quickstart", overrides: list[str] | None = None) -> Config:
    """Load a preset (name or YAML path), apply dotted overrides, validate, return the config.

    The overrides' ``model.plugins`` are imported first, so their architectures have presets
    too (:func:`arch_preset`)."""
    over = parse_overrides(list(overrides or []))
    _load_plugins(over.get("model", {}).get("plugins", ()))
    data = _load_yaml(name_or_path)
    data.setdefault("name", Path(name_or_path).stem)
    return _build(_override(data, over))


def config_from_dict(
    data: dict[str, Any], plugins: tuple[str, ...] = (), fix: str = "pass --plugins {}"
) -> Config:
    """A validated :class:`Config` from its ``to_dict()`` form (e.g. an export's
    ``config.json``), through the same loader as presets; its ``model.plugins`` are never
    imported (:func:`received_model`: ``plugins``, the caller's own, are)."""
    _refuse_base(data, "config.json")
    model = received_model(dict(data.get("model") or {}), "config.json", plugins, fix)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump({**data, "model": model}, sort_keys=False))
        return load_config(str(path))


def _refuse_base(data: dict[str, Any], where: str) -> None:
    """A saved or received configuration is complete: its ``base`` (an inclusion that could
    name any file, whose ``model.plugins`` would be imported) is refused, never followed."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the configuration is not a mapping; refused")
    if "base" in data:
        raise ConfigError(
            f"{where}: 'base: {data['base']!r:.80}' is not followed in a saved or received "
            "configuration (it is complete as saved; an inclusion could name any file); refused"
        )


def _received_layer(path: Path) -> dict[str, Any]:
    """A checkpoint's ``config.yaml`` as one layer: parsed within the bounds of
    :mod:`tapered_megatron.checkpoint.received` (size, nesting depth, alias expansion), no
    ``base``."""
    from tapered_megatron.checkpoint.received import ReceivedFileError, load_yaml

    try:
        data = load_yaml(path)
    except ReceivedFileError as e:
        raise ConfigError(str(e)) from None
    _refuse_base(data, str(path))
    return data


def received_model(
    model: dict[str, Any], where: str, plugins: tuple[str, ...], fix: str
) -> dict[str, Any]:
    """The ``model`` section of a saved or received config with its ``plugins`` replaced by
    ``plugins`` (the user's own flag), which are imported: a file's own list is never imported,
    since importing runs its code. When the file's architecture is registered by none of them,
    :class:`ConfigError` saying how to pass its plugins (``fix``, formatted with their names)."""
    _load_plugins(plugins)
    saved = " ".join(str(p) for p in model.get("plugins") or ())
    arch = model.get("arch", ModelConfig.arch)
    if saved and arch not in architectures.ARCHITECTURES:
        raise ConfigError(
            f"{where}: model.arch {arch!r} comes from model.plugins {saved}, which is not "
            f"imported from a saved file; if you trust that code, {fix.format(saved)}"
        )
    return {**model, "plugins": list(plugins)}


def load_saved_config(
    path: str | Path, plugins: tuple[str, ...] = (), fix: str = "pass --model.plugins {}"
) -> Config:
    """The resolved config a checkpoint saved (``config.yaml``), validated like a preset; its
    ``model.plugins`` are never imported, ``plugins`` (the caller's own flag) are
    (:func:`received_model`).

    Checkpoints written before the architecture records carried every architecture's settings;
    the settings owned by another architecture than the saved ``model.arch`` are dropped. Keys
    saved under an old name (:data:`RENAMED`) move to the new one."""
    data = _received_layer(Path(path))
    for old, new in RENAMED.items():
        (sec, key), (new_sec, new_key) = old.split("."), new.split(".")
        section = dict(data.get(sec) or {})
        if key in section:
            data[sec] = section
            data[new_sec] = {**(data.get(new_sec) or {}), new_key: section.pop(key)}
    model = received_model(dict(data.get("model") or {}), str(path), plugins, fix)
    try:
        own = architectures.resolve_architecture(model.get("arch", ModelConfig.arch))
    except ArchitectureError as e:
        raise ConfigError(f"{path}: {e}") from None
    every = {k for a in architectures.ARCHITECTURES.values() for k in a.option_names()}
    foreign = every - set(own.option_names())
    data["model"] = {k: v for k, v in model.items() if k not in foreign or hasattr(ModelConfig, k)}
    return _build(data)


def load_config_or_exit(name_or_path: str, overrides: list[str]) -> Config:
    """:func:`load_config` for command-line tools: a bad config prints one line and exits 2."""
    try:
        return load_config(name_or_path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def tp_problem(cfg: Config, tp: int) -> str | None:
    """Why tensor-parallel size ``tp`` cannot split ``cfg``'s model evenly (``None``: it can).

    The model's shape is a function of the model config alone (widths are multiples of
    ``taper.multiple``, the vocabulary is padded to ``model.make_vocab_size_divisible_by``), so
    a TP size must divide those and the heads, and divide or be a multiple of the key/value
    heads (split over TP ranks, or replicated); it never changes the model.
    """
    m = cfg.model
    for key, value in (
        ("model.heads", m.heads),
        ("taper.multiple", cfg.taper.multiple),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
    ):
        if value % tp:
            return (
                f"parallel.tp ({tp}) must divide {key} ({value}); use a parallel.tp that "
                f"divides it or set --{key} to a multiple of {tp}"
            )
    if m.kv_heads % tp and tp % m.kv_heads:
        return (
            f"parallel.tp ({tp}) and model.kv_heads ({m.kv_heads}): key/value heads are split "
            "over TP ranks when parallel.tp divides them and replicated when they divide "
            "parallel.tp; use a parallel.tp that divides or is a multiple of model.kv_heads"
        )
    return None


def _is_signal(name: str) -> bool:
    import signal

    return isinstance(getattr(signal, name, None), signal.Signals)


def validate(cfg: Config) -> None:
    """Reject impossible combinations with a message naming the key (types, choices and bounds
    are checked while parsing; the architecture's own checks run last)."""
    m, p, tr = cfg.model, cfg.parallel, cfg.train
    arch = _architecture(m.arch)
    _require(
        m.d_model % m.heads == 0,
        f"model.d_model ({m.d_model}) must be divisible by model.heads ({m.heads})",
    )
    _require(
        m.heads % m.kv_heads == 0,
        f"model.kv_heads ({m.kv_heads}) must divide model.heads ({m.heads}); use a divisor "
        f"of {m.heads} (1 for multi-query attention, {m.heads} or 0 for one per query head)",
    )
    _require(m.dropout < 1, f"model.dropout ({m.dropout}) must be below 1 (0 turns it off)")
    _require(m.head_dim % 2 == 0, f"model.d_model/model.heads = {m.head_dim} must be even for RoPE")
    problem = tp_problem(cfg, p.tp)
    _require(problem is None, str(problem))
    _require(
        not p.sequence_parallel or p.tp > 1,
        "parallel.sequence_parallel splits the sequence over the TP group and needs "
        "parallel.tp > 1; pass --parallel.tp 2 (or more) or --parallel.sequence_parallel false",
    )
    _require(
        not p.sequence_parallel or m.seq_len % p.tp == 0,
        f"parallel.sequence_parallel: model.seq_len ({m.seq_len}) must be a multiple of "
        f"parallel.tp ({p.tp}); change --model.seq_len or --parallel.tp",
    )
    units = m.layers * (2 if p.pipeline_unit == "sublayer" else 1)
    _require(
        p.pp <= units, f"parallel.pp ({p.pp}) exceeds the {units} pipeline units of model.layers"
    )
    _require(
        0 <= tr.min_lr <= tr.lr, f"train.min_lr ({tr.min_lr}) must lie in [0, train.lr={tr.lr}]"
    )
    _require(
        not tr.exit_signal or _is_signal(tr.exit_signal),
        f"train.exit_signal: {tr.exit_signal!r} is not a signal name; use e.g. SIGUSR1 or ''",
    )
    compilable = sorted(a.name for a in architectures.ARCHITECTURES.values() if a.compiles)
    _require(
        not tr.compile or arch.compiles,
        f"train.compile: supported for {', '.join(compilable)} only (the loops of {m.arch} do "
        "not compile in reasonable time); drop --train.compile",
    )
    try:
        parse_split(cfg.data.split)
    except ValueError as e:
        raise ConfigError(f"data.split: {e}") from None
    try:
        cfg.taper_plan  # noqa: B018 - computed once here so a bad taper fails at load time
    except TaperError as e:
        raise ConfigError(str(e)) from None
    names = [Path(x).name for x in cfg.eval.extra_paths]
    _require(
        len(set(names)) == len(names),
        f"eval.extra_paths: prefixes must have distinct file names (they name the logged "
        f"losses), got {', '.join(names)}; rename or link one of them",
    )
    if arch.validate is not None:
        arch.validate(cfg)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the resolved configuration (YAML, or JSON with --json) and its taper plan."""
    ap = argparse.ArgumentParser(prog="python -m tapered_megatron.config")
    ap.add_argument("--config", default="quickstart", help="preset name or YAML path")
    ap.add_argument("--print", action="store_true", help="print the resolved config (default)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    a, rest = ap.parse_known_args(argv)
    cfg = load_config_or_exit(a.config, rest)
    if a.json:
        print(json.dumps({**cfg.to_dict(), "taper_plan": cfg.taper_plan.to_dict()}))
    else:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
        print(cfg.taper_plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
