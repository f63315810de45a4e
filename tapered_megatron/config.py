"""Typed configuration: dataclasses loaded from YAML presets, overridable with dotted flags.

Presets live in ``pretrain/configs/<name>.yaml``; a preset may start from another with
``base: <name>`` and then list only what differs. Command-line overrides use the dotted key path::

    --model.arch titans --taper.schedule uniform --train.iters 20 --taper.ratio 1.5 0.5

Unknown keys, wrong types and impossible combinations raise :class:`ConfigError` whose message
names the key, before any process group exists.

Public entry (stable, used by outside scripts)::

    from tapered_megatron.config import load_config
    cfg = load_config("quickstart", ["--model.arch", "gated_attention"])

CLI: ``python -m tapered_megatron.config --config X [overrides] --print``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tapered_megatron.taper import (
    DEFAULT_STEP_MULTIPLIERS,
    SCHEDULES,
    TaperError,
    TaperPlan,
    make_plan,
)

ARCHS = ("transformer", "gated_attention", "titans", "hope_attention")
PRESET_DIR = Path(
    os.environ.get("TM_CONFIG_DIR", Path(__file__).resolve().parents[1] / "pretrain" / "configs")
)


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key and how to fix it."""


@dataclass(frozen=True)
class TitansConfig:
    """Titans neural long-term memory (tlm-spec.md section 5.3)."""

    variant: str = "mag"  # mag | mal | mac | lmm
    memory_depth: int = 2  # layers of the per-head memory MLP (>= 2)
    memory_expansion: int = 2  # hidden width of the memory MLP, as a multiple of head_dim
    chunk_size: int = 16  # tokens per chunk of the chunk-parallel update
    conv_size: int = 4  # short causal depthwise convolution on q, k, v
    window: int = 64  # sliding-window size of the attention branch (MAG / MAL); MAC: segment
    persistent_tokens: int = 0  # learned key/value pairs prepended to every attention (not lmm)


@dataclass(frozen=True)
class HopeConfig:
    """Hope-attention's Continuum Memory System (tlm-spec.md section 5.4)."""

    levels: int = 3  # K MLP levels in the chain
    periods: tuple[int, ...] = (
        0,
        64,
        16,
    )  # update period per level in tokens; 0 = never (plain MLP)
    lr: float = 1.0  # inner-loop rate scale (effective step on a repeated input); 0: no updates
    rate: str = "learned"  # learned (sigmoid of a linear map of the level input) | constant
    rate_init: float = 0.5  # learned rate: initial sigmoid value (gate bias logit(rate_init))
    update: str = "association"  # association (next position) | teach (outer-loss signal)


@dataclass(frozen=True)
class ModelConfig:
    """Model shape. ``d_ff`` is the uniform baseline width the taper redistributes."""

    arch: str = "transformer"
    d_model: int = 256
    layers: int = 8
    heads: int = 4
    d_ff: int = 688
    vocab_size: int = 8192
    seq_len: int = 256
    make_vocab_size_divisible_by: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    gate: str = "elementwise"  # gated_attention: elementwise | headwise
    titans: TitansConfig = field(default_factory=TitansConfig)
    hope: HopeConfig = field(default_factory=HopeConfig)

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.d_model // self.heads


@dataclass(frozen=True)
class TaperConfig:
    """MLP width schedule (see :mod:`tapered_megatron.taper`)."""

    schedule: str = "cosine"
    ratio: tuple[float, ...] = (1.5, 0.5)
    step_multipliers: tuple[float, ...] = DEFAULT_STEP_MULTIPLIERS
    reverse: bool = False
    multiple: int = 16
    sigmoid_k: float = 10.0


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout; data parallelism is whatever remains of the world size."""

    tp: int = 1
    pp: int = 1
    partition: str = "balanced"  # balanced | uniform | parameters | megatron
    pipeline_unit: str = "layer"  # layer | sublayer (mixer and MLP as separate pipeline units)
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from. An empty ``path`` means the sample corpus shipped in the repo."""

    path: str = ""  # "prefix" or Megatron blend "w1 prefix1 w2 prefix2"
    split: str = "969,30,1"
    tokenizer_model: str = ""  # empty: the sample corpus tokenizer (built on first use)
    cache_dir: str = ".cache/tapered_megatron"
    seed: int = 1234
    num_workers: int = 0


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and checkpointing."""

    iters: int = 200
    micro_batch_size: int = 8
    global_batch_size: int = 0  # 0: micro_batch_size * data-parallel size (no accumulation)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 20
    lr_decay_iters: int = 0  # 0: train.iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    save_interval: int = 0  # 0: only at the end
    save_dir: str = "checkpoints/quickstart"
    keep_last: int = 2
    resume: str = ""  # "" (fresh), "auto" (newest complete checkpoint in save_dir) or a path
    exit_interval: int = 0  # stop (after saving) once the iteration is a multiple of it; 0: never
    compile: bool = False  # torch.compile via DeepSpeed's engine.compile (memory loops: eager)


@dataclass(frozen=True)
class EvalConfig:
    """Validation during training."""

    interval: int = 100  # 0: never
    iters: int = 10


@dataclass(frozen=True)
class LoggingConfig:
    """Console and tensorboardX logging."""

    interval: int = 10
    tensorboard_dir: str = ""  # empty: <train.save_dir>/tensorboard
    peak_tflops: float = 0.0  # per-device peak for MFU; 0: known accelerator or measured probe
    metrics_file: str = ""  # JSON line per iteration (loss, lr, grad_norm, val_loss); "": none


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
            self.parallel.tp,
            t.reverse,
            t.sigmoid_k,
        )

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded (Megatron habit) to a multiple of the divisor times ``tp``."""
        unit = self.model.make_vocab_size_divisible_by * self.parallel.tp
        return -(-self.model.vocab_size // unit) * unit

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dictionary (YAML/JSON ready)."""
        return _plain(dataclasses.asdict(self))

    def with_overrides(self, overrides: list[str]) -> Config:
        """A new validated config with dotted command-line overrides applied."""
        return _build(_merge(self.to_dict(), parse_overrides(overrides)))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _resolve_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML or CLI value to the field's declared type."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _from_dict(tp, value, key + ".")
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
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _resolve_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(
                f"{prefix}{k}: unknown key; valid keys here: {', '.join(sorted(names))}"
            )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


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
        known = sorted(x.stem for x in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(
            f"--config: no preset named {name_or_path!r}; known presets: {', '.join(known)}"
        )
    return q


def _load_yaml(name_or_path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
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
        data = _merge(_load_yaml(base, (*seen, str(path))), data)
    return data


def _build(data: dict[str, Any]) -> Config:
    cfg = _from_dict(Config, data)
    validate(cfg)
    return cfg


def load_config(name_or_path: str = "quickstart", overrides: list[str] | None = None) -> Config:
    """Load a preset (name or YAML path), apply dotted overrides, validate, return the config."""
    data = _load_yaml(name_or_path)
    data.setdefault("name", Path(name_or_path).stem)
    return _build(_merge(data, parse_overrides(list(overrides or []))))


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


def validate(cfg: Config) -> None:
    """Reject impossible combinations with a message naming the key."""
    m, t, p, tr = cfg.model, cfg.taper, cfg.parallel, cfg.train
    _require(m.arch in ARCHS, f"model.arch: unknown architecture {m.arch!r}; use one of {ARCHS}")
    for key in ("d_model", "layers", "heads", "d_ff", "vocab_size", "seq_len"):
        _require(getattr(m, key) > 0, f"model.{key}: must be positive, got {getattr(m, key)}")
    _require(
        m.d_model % m.heads == 0,
        f"model.d_model ({m.d_model}) must be divisible by model.heads ({m.heads})",
    )
    _require(m.head_dim % 2 == 0, f"model.d_model/model.heads = {m.head_dim} must be even for RoPE")
    _require(
        m.gate in ("elementwise", "headwise"),
        f"model.gate: {m.gate!r} is not elementwise or headwise",
    )
    _require(
        m.titans.variant in ("mag", "mal", "mac", "lmm"),
        f"model.titans.variant: {m.titans.variant!r}; use mag, mal, mac or lmm",
    )
    _require(m.titans.persistent_tokens >= 0, "model.titans.persistent_tokens: must be >= 0")
    _require(
        m.titans.variant != "lmm" or m.titans.persistent_tokens == 0,
        "model.titans.persistent_tokens: variant lmm has no attention to prepend them to; "
        "use 0 or another variant",
    )
    _require(
        m.titans.variant != "mac" or m.titans.window % m.titans.chunk_size == 0,
        f"model.titans.window ({m.titans.window}) must be a multiple of model.titans.chunk_size "
        f"({m.titans.chunk_size}) for variant mac (segments start at chunk starts)",
    )
    _require(m.titans.memory_depth >= 2, "model.titans.memory_depth: must be >= 2")
    for key in ("chunk_size", "conv_size", "window", "memory_expansion"):
        _require(getattr(m.titans, key) >= 1, f"model.titans.{key}: must be >= 1")
    _require(m.hope.levels >= 1, "model.hope.levels: must be >= 1")
    _require(
        len(m.hope.periods) == m.hope.levels,
        f"model.hope.periods: give one period per level ({m.hope.levels}), "
        f"got {list(m.hope.periods)}",
    )
    _require(all(x >= 0 for x in m.hope.periods), "model.hope.periods: periods must be >= 0")
    _require(m.hope.lr >= 0, "model.hope.lr: must be >= 0")
    _require(
        m.hope.rate in ("learned", "constant"),
        f"model.hope.rate: {m.hope.rate!r}; use learned or constant",
    )
    _require(0 < m.hope.rate_init < 1, "model.hope.rate_init: must lie in (0, 1)")
    _require(
        m.hope.update in ("association", "teach"),
        f"model.hope.update: {m.hope.update!r}; use association or teach",
    )
    _require(
        m.hope.update != "teach" or p.pp == 1,
        "model.hope.update: teach needs a first pass of the whole model (parallel.pp = 1); "
        "use association under pipeline parallelism",
    )
    _require(
        t.schedule in SCHEDULES, f"taper.schedule: unknown {t.schedule!r}; use one of {SCHEDULES}"
    )
    _require(p.tp >= 1 and p.pp >= 1, "parallel.tp and parallel.pp must be >= 1")
    _require(
        m.heads % p.tp == 0, f"model.heads ({m.heads}) must be divisible by parallel.tp ({p.tp})"
    )
    units = m.layers * (2 if p.pipeline_unit == "sublayer" else 1)
    _require(
        p.pp <= units, f"parallel.pp ({p.pp}) exceeds the {units} pipeline units of model.layers"
    )
    _require(
        p.partition in ("balanced", "uniform", "parameters", "megatron"),
        f"parallel.partition: {p.partition!r}; use balanced, uniform, parameters or megatron",
    )
    _require(
        p.pipeline_unit in ("layer", "sublayer"),
        f"parallel.pipeline_unit: {p.pipeline_unit!r}; use layer or sublayer",
    )
    _require(tr.iters >= 1, "train.iters: must be >= 1")
    _require(tr.micro_batch_size >= 1, "train.micro_batch_size: must be >= 1")
    _require(tr.global_batch_size >= 0, "train.global_batch_size: must be >= 0")
    _require(
        0 <= tr.min_lr <= tr.lr, f"train.min_lr ({tr.min_lr}) must lie in [0, train.lr={tr.lr}]"
    )
    _require(tr.warmup_iters >= 0, "train.warmup_iters: must be >= 0")
    _require(tr.keep_last >= 1, "train.keep_last: must be >= 1")
    _require(tr.save_interval >= 0, "train.save_interval: must be >= 0")
    _require(tr.exit_interval >= 0, "train.exit_interval: must be >= 0")
    _require(cfg.logging.interval >= 1, "logging.interval: must be >= 1")
    _require(cfg.logging.peak_tflops >= 0, "logging.peak_tflops: must be >= 0")
    parts = cfg.data.split.replace("/", ",").split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        raise ConfigError(f"data.split: {cfg.data.split!r} is not like '969,30,1'") from None
    _require(
        len(weights) <= 3 and sum(weights) > 0 and min(weights) >= 0,
        f"data.split: {cfg.data.split!r} needs up to three non-negative weights",
    )
    try:
        plan = cfg.taper_plan
    except TaperError as e:
        raise ConfigError(str(e)) from None
    if m.arch == "hope_attention":
        narrowest = min(plan.widths)
        _require(
            narrowest >= m.hope.levels * plan.unit,
            f"model.hope.levels: the narrowest layer (d_ff={narrowest}) cannot be split into "
            f"{m.hope.levels} CMS levels of at least one rounding unit ({plan.unit}); use fewer "
            "levels, a wider model.d_ff or a smaller taper.multiple",
        )


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
