"""Full, unsharded fp32 weights from a training checkpoint of any parallel layout.

A checkpoint directory (``train.save_dir``) holds ``global_stepN/`` tags written by
:mod:`tapered_megatron.checkpoint.save`: DeepSpeed's files, our ``config.yaml`` and
``taper_plan.json``, and a ``complete`` marker; ``latest`` names the newest complete tag.
When the tag holds the layout-free ``universal/`` copy (``train.universal_checkpoint``, on by
default) its fp32 master weights are exported: full tensors keyed by single-process name, and
the master copy in every precision (a bf16 run's module files hold bf16-rounded weights).
Otherwise DeepSpeed's files are read, per layout, without any process group:

* data parallel, ZeRO 0: ``mp_rank_XX_model_states.pt`` (``module``: the weights of TP rank XX);
* ZeRO 1-3 (no pipeline): the fp32 master weights of TP rank XX, gathered from the optimizer
  partitions ``zero_pp_rank_D_mp_rank_XX_optim_states.pt`` of every data-parallel rank D by
  DeepSpeed's ``zero_to_fp32`` (under ZeRO-3 the module files hold no weights at all);
* pipeline: ``layer_II-model_XX-model_states.pt``, the weights of pipeline unit II (embedding,
  blocks or mixer/MLP sub-units per ``parallel.pipeline_unit``, head) on TP rank XX.

TP shards are put back together along each parameter's split dimension by
:func:`tapered_megatron.parallel.layers.unshard`, using the ``tp_layout`` the parallel layers
attach to their weights. The result is keyed by the single-process parameter names
(``embedding.embed.weight``, ``layers.N.{mixer_norm,mixer,mlp_norm,mlp}.*``, ``head.norm.weight``,
``head.proj.weight``) and checked name by name and shape by shape against the model of the
checkpoint's own configuration.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapered_megatron.checkpoint import received, safe_load
from tapered_megatron.checkpoint.errors import ExportError
from tapered_megatron.checkpoint.layout import (
    COMPLETE,
    CONFIG,
    LATEST,
    TAPER_PLAN,
    UNIVERSAL,
    complete_tags,
    has_universal,
    is_tag,
    iteration_of,
    latest_tag,
)
from tapered_megatron.checkpoint.manifest import entries_problem, manifest_problem
from tapered_megatron.config import Config, ConfigError, load_saved_config
from tapered_megatron.models import build_model, unit_prefixes
from tapered_megatron.parallel.layers import unshard

_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclass(frozen=True)
class CheckpointRef:
    """One complete checkpoint tag and the run configuration saved with it."""

    tag_dir: Path
    cfg: Config
    iteration: int
    consumed_samples: int

    @property
    def save_dir(self) -> Path:
        """The run's ``train.save_dir`` (parent of the tag)."""
        return self.tag_dir.parent

    @property
    def tokens(self) -> int:
        """Training tokens seen up to this checkpoint."""
        return self.consumed_samples * self.cfg.model.seq_len


def resolve_checkpoint(
    path: str | Path, tag: str | None = None, plugins: tuple[str, ...] = ()
) -> CheckpointRef:
    """The checkpoint at ``path`` (a save dir, or one ``global_stepN`` dir) and ``tag`` (default:
    ``latest``). Fails with one line for a missing directory or tag, a partial checkpoint and a
    file that does not load as plain data. ``plugins`` (``--plugins``) are imported, the saved
    ``model.plugins`` never are."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"--checkpoint {p}: no such directory")
    if is_tag(p.name):
        if tag is not None and tag != p.name:
            raise ExportError(f"--tag {tag} contradicts --checkpoint {p}; give the save directory")
        tag_dir = p
    else:
        done = [t for _, t in complete_tags(p)]
        if tag is None:
            if (p / LATEST).is_file():
                tag = latest_tag(p)
                if not is_tag(tag):
                    raise ExportError(
                        f"{p / LATEST} names {tag!r}, not a global_stepN of this directory; "
                        "pass --tag"
                    )
            elif done:
                tag = done[-1]
            else:
                raise ExportError(
                    f"--checkpoint {p}: no checkpoint here (no '{LATEST}' file and no complete "
                    "global_stepN/ directory); point it at a run's train.save_dir"
                )
        tag_dir = p / tag
        if not tag_dir.is_dir():
            raise ExportError(
                f"--tag {tag}: no such checkpoint under {p}; complete tags: "
                f"{', '.join(done) or 'none'}"
            )
    if not (tag_dir / COMPLETE).is_file():
        others = [t for _, t in complete_tags(tag_dir.parent) if t != tag_dir.name]
        raise ExportError(
            f"{tag_dir} is a partial checkpoint (no '{COMPLETE}' marker: the run stopped while "
            f"saving it); export a complete one with --tag ({', '.join(others) or 'none found'})"
        )
    why = entries_problem(tag_dir)  # before any file is read: all inside the tag
    if why is not None:
        raise ExportError(f"{why}; export another --tag")
    try:
        cfg = load_saved_config(tag_dir / CONFIG, plugins, "pass --plugins {}")
    except (ConfigError, FileNotFoundError) as e:
        raise ExportError(f"{tag_dir / CONFIG}: {e}") from None
    plan_file = tag_dir / TAPER_PLAN
    if plan_file.is_file():
        try:
            plan = received.load_json(plan_file)
        except received.ReceivedFileError as e:
            raise ExportError(f"{e}; export another --tag") from None
        saved = plan.get("widths") if isinstance(plan, dict) else plan
        if saved != list(cfg.taper_plan.widths):
            raise ExportError(
                f"{plan_file}: widths {saved} differ from the plan of config.yaml here "
                f"({list(cfg.taper_plan.widths)}); use the tapered_megatron version that trained it"
            )
    try:  # DeepSpeed's zero_to_fp32 loads its files with its own torch.load: verified here
        safe_load.verify_tag(tag_dir)
    except safe_load.UnsafeFileError as e:
        raise ExportError(f"{e}; export another --tag") from None
    why = manifest_problem(tag_dir)  # every file against the sha256 ``complete`` records
    if why is not None:
        raise ExportError(f"{why}; export another --tag")
    marker = json.loads((tag_dir / COMPLETE).read_text() or "{}")
    iteration = int(marker.get("iteration", iteration_of(tag_dir.name)))
    return CheckpointRef(tag_dir, cfg, iteration, int(marker.get("consumed_samples", 0)))


def _load(path: Path) -> dict[str, Any]:
    """A checkpoint file as plain data (:mod:`tapered_megatron.checkpoint.safe_load`), memory-mapped
    (optimizer tensors in it are never read)."""
    try:
        return safe_load.load(path, mmap=True)
    except safe_load.UnsafeFileError as e:
        raise ExportError(str(e)) from None


def _zero_fp32(tag_dir: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    """fp32 weights of one TP rank from the ZeRO optimizer partitions of all DP ranks."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    mine = f"mp_rank_{tp_rank:02d}_"
    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp) / tag_dir.name  # this rank's files only, named as rank 0's
        view.mkdir()
        for f in tag_dir.glob(f"*{mine}*states.pt"):
            (view / f.name.replace(mine, "mp_rank_00_")).symlink_to(f.resolve())
        return dict(get_fp32_state_dict_from_zero_checkpoint(tmp, tag=tag_dir.name))


def _pipeline_shards(tag_dir: Path, cfg: Config, tp: int) -> list[dict[str, torch.Tensor]]:
    prefixes = unit_prefixes(cfg)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for f in sorted(tag_dir.iterdir()):
        m = _LAYER_FILE.match(f.name)
        if not m:
            continue
        unit, rank = int(m.group(1)), int(m.group(2))
        if unit >= len(prefixes) or rank >= tp:
            raise ExportError(f"{f}: unit {unit} / TP rank {rank} does not fit config.yaml")
        for name, t in _load(f).items():
            shards[rank][prefixes[unit] + name] = t
    return shards


def consolidate(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """Full fp32 weights (single-process names and shapes) of a checkpoint of any layout, all
    in memory (:func:`weights` reads them one at a time)."""
    return dict(weights(ref))


def weights(ref: CheckpointRef) -> Mapping[str, torch.Tensor]:
    """The full fp32 weights of a checkpoint as a mapping in the model's parameter order.

    From the universal copy (the default) each tensor is read from its own file when asked for
    and nothing is kept, so a writer that takes them one by one holds one tensor at a time;
    otherwise DeepSpeed's files are consolidated in memory first. DeepSpeed's messages (printed
    on stdout while its files load) go to stderr, so tools can keep stdout for their results."""
    if has_universal(ref.tag_dir):
        return UniversalWeights(ref.tag_dir, ref.cfg)
    with contextlib.redirect_stdout(sys.stderr):
        return _consolidate(ref)


class UniversalWeights(Mapping[str, torch.Tensor]):
    """The fp32 master weights of a checkpoint's layout-free ``universal/`` copy, read on
    access: full tensors keyed by single-process name, plain tensors (never pickled objects),
    memory-mapped so only the master copy is read."""

    def __init__(self, tag_dir: Path, cfg: Config) -> None:
        self.tag_dir = tag_dir
        model = build_model(cfg, device="meta")
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        f = self.tag_dir / UNIVERSAL / f"{name}.pt"
        if not f.is_file():
            raise ExportError(f"{f}: missing; is the checkpoint complete and from this version?")
        w = _load(f)["fp32"]
        if tuple(w.shape) != self.shapes[name]:
            raise ExportError(f"{f}: shape {tuple(w.shape)}, config.yaml gives {self.shapes[name]}")
        return w.float().contiguous()

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _consolidate(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """The full weights from DeepSpeed's own files (a checkpoint without the universal copy;
    with one, :class:`UniversalWeights` reads its fp32 masters, the only fp32 source of a
    bf16/fp16 ZeRO-0 or pipeline run)."""
    tag_dir, cfg = ref.tag_dir, ref.cfg
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise ExportError(f"{tag_dir}: no DeepSpeed model files (*model_states.pt)")
    meta = _load(files[0])
    dims = meta.get("checkpoint_parallel_dimensions") or {}
    tp = int(dims.get("tp_degree", cfg.parallel.tp))
    pp = int(dims.get("pp_degree", cfg.parallel.pp))
    stage = int((meta.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    if pp > 1:
        shards = _pipeline_shards(tag_dir, cfg, tp)
    elif stage >= 1:
        shards = [_zero_fp32(tag_dir, r) for r in range(tp)]
    else:
        shards = []
        for r in range(tp):
            f = tag_dir / f"mp_rank_{r:02d}_model_states.pt"
            if not f.is_file():
                raise ExportError(f"{f}: missing (the checkpoint was saved with TP={tp})")
            shards.append(dict(_load(f)["module"]))
    return merge_tp(shards, cfg, str(tag_dir))


def merge_tp(
    shards: list[dict[str, torch.Tensor]], cfg: Config, where: str
) -> dict[str, torch.Tensor]:
    """Put TP shards (one dict per TP rank) together into the full model's fp32 weights."""
    reference = build_model(cfg, device="meta")
    expected = dict(reference.named_parameters())
    names = set().union(*(s.keys() for s in shards))
    if names != set(expected):
        missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
        raise ExportError(
            f"{where}: weights do not match config.yaml (missing {missing[:4]}, unexpected "
            f"{extra[:4]}); is the checkpoint complete and from this version?"
        )
    out = {}
    for name, p in expected.items():
        pieces = [s[name].float() for s in shards]
        layout = getattr(p, "tp_layout", None)
        full = unshard(pieces, layout) if layout is not None else pieces[0]
        if tuple(full.shape) != tuple(p.shape):
            raise ExportError(
                f"{where}: {name} has shape {tuple(full.shape)}, config.yaml gives {tuple(p.shape)}"
            )
        out[name] = full.contiguous()
    return out
