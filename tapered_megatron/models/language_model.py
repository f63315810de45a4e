"""The language model and its pipeline units, listed once in the unit table.

:func:`units` lists the pipeline units of a configuration: the :class:`Embedding`, one
:class:`Block` per layer (granularity ``"layer"``) or, per layer, a block holding only the token
mixer and one holding only the MLP slot (``"sublayer"``), and the :class:`Head`. Everything that
needs the units maps over this one table:

* :func:`build_model` -> :class:`LanguageModel` (one ``nn.Module``): ``forward(input_ids)`` gives
  logits ``[b, s, padded_vocab]`` (this rank's vocabulary slice under TP),
  ``forward(input_ids, labels)`` the mean loss;
* :func:`pipeline_layer_specs` -> DeepSpeed ``LayerSpec`` list for ``PipelineModule``, with
  :func:`lm_loss` as ``loss_fn``; units pass one tensor, the residual stream;
* the counters (:func:`tapered_megatron.models.count_model`), the pipeline cost model, balancer
  and profiler (:mod:`tapered_megatron.planning`).

One loss path: the head returns a :class:`HeadOutput` (final-normed hidden states and the head
weight) and :func:`lm_loss` fuses the vocabulary projection into the cross-entropy, chunk by
chunk, in the single model and on the pipeline's last stage alike, so no logits-sized tensor is
kept in either.

Each unit initialises its own parameters from ``(cfg.train.seed, canonical name)`` where the
canonical name is the parameter's name in :class:`LanguageModel` (``layers.3.mlp.w13.weight``),
so both forms and every TP/PP layout start from the same full weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.architectures import resolve_architecture
from tapered_megatron.models.base import Counts, Recomputed, sequence_parallel
from tapered_megatron.models.layers import RMSNorm
from tapered_megatron.models.registry import blocks
from tapered_megatron.parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence_parallel_region,
    get_rng_tracker,
    init_parameters,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy_mean,
)
from tapered_megatron.parallel.random import recompute

if TYPE_CHECKING:
    from deepspeed.pipe import LayerSpec

    from tapered_megatron.config import Config, PipelineUnit, Recompute

#: The two halves of a block, in order.
HALVES = ("mixer", "mlp")


class Embedding(nn.Module):
    """Token ids ``[b, s]`` -> residual stream ``[b, s, d]`` (vocab-parallel embedding; under
    sequence parallelism this rank's part of the sequence, ``[b, s/tp, d]``)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        sp = sequence_parallel(cfg)
        self.embed = VocabParallelEmbedding(
            cfg.padded_vocab_size, m.d_model, std=m.init_std, sequence_parallel=sp
        )
        init_parameters(self, cfg.train.seed, "embedding.")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    @classmethod
    def counts(cls, cfg: Config, dtype_bytes: int = 2) -> Counts:
        """The embedding table; a gather (no FLOPs, nothing kept but the ids)."""
        return Counts(cfg.padded_vocab_size * cfg.model.d_model, 0.0, 0.0)


class Block(nn.Module):
    """Layer ``layer``, or the halves of it one pipeline unit holds::

        z = h + mixer(mixer_norm(h))        # half "mixer"
        h = z + mlp(mlp_norm(z))            # half "mlp"

    In training mode each branch output goes through dropout with probability
    ``cfg.model.dropout`` (0, the default, draws no random numbers), drawn from the default torch
    generator: the same on the TP ranks of a stage, restored from checkpoints on resume.
    Parameter names are the same whichever halves are built (``mixer_norm``, ``mixer``,
    ``mlp_norm``, ``mlp``), so a sub-layer unit's weights are the whole block's. Activation
    recomputation starts from ``cfg.train.recompute`` (:func:`set_recompute` changes it):
    ``full`` recomputes the whole unit in backward, ``selective`` the cores of its modules.

    Under sequence parallelism ``h`` is this rank's part of the sequence: the norms, residual
    adds and dropout (from the TP-local stream of the RNG tracker, so each rank draws its own
    mask) work on it; a half whose module ``takes_sequence_shards`` gets the normed shard, any
    other the whole sequence (gathered before it, this rank's part kept after it).
    """

    def __init__(self, cfg: Config, layer: int, halves: tuple[str, ...] = HALVES) -> None:
        super().__init__()
        arch = blocks(cfg.model.arch)
        m = cfg.model
        self.layer, self.halves = layer, tuple(halves)
        self.dropout = m.dropout
        self.recompute_full = cfg.train.recompute == "full"
        self.sequence_parallel = sp = sequence_parallel(cfg)
        if "mixer" in halves:
            self.mixer_norm = RMSNorm(m.d_model, m.norm_eps, sequence_parallel=sp)
            self.mixer = arch.mixer(cfg, layer)
        if "mlp" in halves:
            self.mlp_norm = RMSNorm(m.d_model, m.norm_eps, sequence_parallel=sp)
            self.mlp = arch.mlp(cfg, layer)
        init_parameters(self, cfg.train.seed, f"layers.{layer}.")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.recompute_full and self.training and torch.is_grad_enabled():
            return recompute(self._forward, h)
        return self._forward(h)

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        if "mixer" in self.halves:
            h = h + self._drop(self._branch(self.mixer, self.mixer_norm(h)))
        if "mlp" in self.halves:
            h = h + self._drop(self._branch(self.mlp, self.mlp_norm(h)))
        return h

    def _branch(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel or module.takes_sequence_shards:
            return module(x)
        whole = gather_from_sequence_parallel_region(x, grad_partial=False)
        return scatter_to_sequence_parallel_region(module(whole))

    def _drop(self, branch: torch.Tensor) -> torch.Tensor:
        if not (self.dropout > 0 and self.training):
            return branch
        if self.sequence_parallel:
            with get_rng_tracker().fork():
                return F.dropout(branch, self.dropout, training=True)
        return F.dropout(branch, self.dropout, training=True)

    @classmethod
    def counts(
        cls, cfg: Config, layer: int, halves: tuple[str, ...] = HALVES, dtype_bytes: int = 2
    ) -> Counts:
        """Each half's module counts plus its norm (a gain; keeps its normalised input and the
        fp32 reciprocal RMS for backward) and, with ``model.dropout``, its dropout mask (one
        byte per element)."""
        arch = blocks(cfg.model.arch)
        d = cfg.model.d_model
        mask = d if cfg.model.dropout > 0 else 0
        norm = Counts(d, 0.0, float(d * dtype_bytes + 4 + mask))
        modules = {"mixer": arch.mixer, "mlp": arch.mlp}
        total = Counts(0, 0.0, 0.0)
        for half in halves:
            total = total + norm + modules[half].counts(cfg, layer, dtype_bytes)
        return total


class HeadOutput(NamedTuple):
    """What the head hands to the loss: the vocabulary projection not yet applied.

    ``hidden`` are the final-normed hidden states ``[..., d]`` inside the TP region, ``weight``
    this rank's rows of the untied LM head ``[vocab/tp, d]``. :func:`lm_loss` fuses the two into
    the cross-entropy; :meth:`logits` materialises ``[..., vocab/tp]`` when logits are wanted.
    """

    hidden: torch.Tensor
    weight: torch.Tensor

    def logits(self) -> torch.Tensor:
        """This rank's logits ``hidden @ weight^T``."""
        return F.linear(self.hidden, self.weight)


class Head(nn.Module):
    """Final RMSNorm and the untied LM head (column-parallel over the padded vocabulary). Under
    sequence parallelism the norm works on this rank's part of the sequence and its output is
    all-gathered into the TP region."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        sp = sequence_parallel(cfg)
        self.norm = RMSNorm(m.d_model, m.norm_eps, sequence_parallel=sp)
        self.proj = ColumnParallelLinear(
            m.d_model, cfg.padded_vocab_size, std=m.init_std, sequence_parallel=sp
        )
        init_parameters(self, cfg.train.seed, "head.")

    def forward(self, h: torch.Tensor) -> HeadOutput:
        return HeadOutput(self.proj.enter(self.norm(h)), self.proj.weight)

    @classmethod
    def counts(cls, cfg: Config, dtype_bytes: int = 2) -> Counts:
        """Final norm and projection. The fused loss keeps the gradient of its input (``d`` per
        token); its fp32 weight gradient and one chunk of logits are per micro-batch, not per
        token (the pipeline cost model adds them)."""
        d, vocab = cfg.model.d_model, cfg.padded_vocab_size
        norm = Counts(d, 0.0, float(d * dtype_bytes + 4))
        return norm + Counts(vocab * d, 2.0 * vocab * d, float(d * dtype_bytes))


def lm_loss(output: HeadOutput | torch.Tensor, labels: torch.Tensor | tuple) -> torch.Tensor:
    """Mean next-token cross-entropy: the loss of the single model and of the pipeline's last
    stage (its ``loss_fn``).

    ``output`` is the head's :class:`HeadOutput`: the projection is fused into the vocab-parallel
    cross-entropy and taken in chunks (``vocab_parallel_linear_cross_entropy_mean``), so no
    logits-sized tensor exists. Logits ``[..., vocab/tp]`` are accepted as well (e.g.
    ``lm_loss(model(ids), labels)``). ``labels`` is ``[b, s]`` token ids, or ``(labels,
    loss_mask)`` with a 0/1 mask ``[b, s]``.
    """
    target, mask = labels if isinstance(labels, (tuple, list)) else (labels, None)
    if isinstance(output, HeadOutput):
        return vocab_parallel_linear_cross_entropy_mean(output.hidden, output.weight, target, mask)
    loss = vocab_parallel_cross_entropy(output, target)
    if mask is None:
        return loss.mean()
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass(frozen=True)
class Unit:
    """One entry of the unit table: a pipeline unit of ``cfg``.

    Attributes:
        name: ``embedding``, ``layer3`` (a whole block), ``layer3.mixer``, ``layer3.mlp`` or
            ``head``.
        kind: ``embedding``, ``layer``, ``mixer``, ``mlp`` or ``head``.
        layer: the global layer index of a block unit (``None`` for the embedding and head).
        module: the class built for it (:class:`Embedding`, :class:`Block` or :class:`Head`).
        args: its constructor arguments after ``cfg``.
    """

    cfg: Config = field(repr=False, compare=False)
    name: str
    kind: str
    layer: int | None
    module: type[nn.Module]
    args: tuple[Any, ...] = ()

    def build(self) -> nn.Module:
        """The unit's module, initialised (layout-invariant)."""
        return self.module(self.cfg, *self.args)

    def spec(self) -> LayerSpec:
        """The unit as a DeepSpeed ``LayerSpec`` (built on the stage that owns it)."""
        from deepspeed.pipe import LayerSpec

        return LayerSpec(self.module, self.cfg, *self.args)

    def counts(self, dtype_bytes: int = 2) -> Counts:
        """Parameters, forward FLOPs per token and activation bytes per token (full model)."""
        return self.module.counts(self.cfg, *self.args, dtype_bytes=dtype_bytes)

    def input_bytes(self, dtype_bytes: int = 2) -> float:
        """Bytes per token of the unit's input (what a checkpointed unit keeps)."""
        return 0.0 if self.kind == "embedding" else float(self.cfg.model.d_model * dtype_bytes)


def units(cfg: Config, granularity: PipelineUnit | None = None) -> list[Unit]:
    """The pipeline units of ``cfg`` in order: embedding, blocks (``"layer"``) or block halves
    (``"sublayer"``), head. ``granularity`` defaults to ``cfg.parallel.pipeline_unit``."""
    g = granularity or cfg.parallel.pipeline_unit
    if g not in ("layer", "sublayer"):
        raise ValueError(f"pipeline unit must be 'layer' or 'sublayer', got {g!r}")
    resolve_architecture(cfg.model.arch)  # fail here, before any stage builds
    out = [Unit(cfg, "embedding", "embedding", None, Embedding)]
    for i in range(cfg.model.layers):
        if g == "layer":
            out.append(Unit(cfg, f"layer{i}", "layer", i, Block, (i, HALVES)))
        else:
            out += [Unit(cfg, f"layer{i}.{h}", h, i, Block, (i, (h,))) for h in HALVES]
    out.append(Unit(cfg, "head", "head", None, Head))
    return out


def unit_prefixes(cfg: Config, granularity: PipelineUnit | None = None) -> list[str]:
    """Canonical name prefix (``embedding.``, ``layers.3.``, ``head.``) of each unit of
    :func:`units`, in order: a pipeline stage registers unit ``i`` as submodule ``"i"``."""
    return [
        f"layers.{u.layer}." if u.layer is not None else f"{u.kind}."
        for u in units(cfg, granularity)
    ]


def canonical_parameters(module: nn.Module, cfg: Config) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters under their names in the single :class:`LanguageModel`
    (``layers.3.mlp.w13.weight``): its own names for that model, and for a pipeline stage of
    ``cfg`` (``<unit index>.<name in the unit>``) the unit's prefix from :func:`unit_prefixes`."""
    named = list(module.named_parameters())
    if isinstance(module, LanguageModel):
        return named
    prefixes = unit_prefixes(cfg)
    out = []
    for name, p in named:
        unit, rest = name.split(".", 1)
        out.append((prefixes[int(unit)] + rest, p))
    return out


class LanguageModel(nn.Module):
    """Embedding, ``cfg.model.layers`` blocks, final norm and LM head (the units of
    :func:`units` at granularity ``"layer"``).

    ``forward(input_ids)`` returns logits ``[b, s, cfg.padded_vocab_size]`` (under TP: this
    rank's contiguous vocabulary slice); ``forward(input_ids, labels)`` returns the mean loss.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        embedding, *layers, head = (u.build() for u in units(cfg, "layer"))
        self.embedding = embedding
        self.layers = nn.ModuleList(layers)
        self.head = head
        self._first_pass = blocks(cfg.model.arch).first_pass

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | tuple | None = None
    ) -> torch.Tensor:
        if self._first_pass is not None:
            self._first_pass(self, input_ids)
        h = self.embedding(input_ids)
        for block in self.layers:
            h = block(h)
        out = self.head(h)
        return out.logits() if labels is None else lm_loss(out, labels)


def set_recompute(model: nn.Module, mode: Recompute) -> nn.Module:
    """Activation recomputation of ``model``'s blocks (or pipeline units) in backward, as
    ``train.recompute`` sets it: ``none``, ``selective`` (the modules' cores) or ``full``."""
    for module in model.modules():
        if isinstance(module, Block):
            module.recompute_full = mode == "full"
        if isinstance(module, Recomputed):
            module.selective_recompute = mode == "selective"
    return model


def build_model(cfg: Config, device: torch.device | str | None = None) -> LanguageModel:
    """The model of ``cfg``, initialised from ``cfg.train.seed`` (layout-invariant).

    ``device="meta"`` builds shapes only (no memory, no init) for counting multi-billion presets.
    Under TP, call :func:`tapered_megatron.parallel.init_model_parallel` first.
    """
    if device is None:
        return LanguageModel(cfg)
    with torch.device(device):
        return LanguageModel(cfg)


def meta_param_count(cfg: Config) -> int:
    """Parameters of the model of ``cfg`` built on the meta device (one process: full, un-sharded
    modules with ``cfg``'s vocabulary padding; nothing allocated), the built model's own count
    that the planner and the summary print beside :func:`count_model`'s."""
    return sum(p.numel() for p in build_model(cfg, device="meta").parameters())


def allow_layer_recompiles(cfg: Config) -> None:
    """Raise ``torch._dynamo``'s per-function recompile limit so that ``torch.compile`` compiles
    every layer of ``cfg``'s model (call before compiling; ``train.compile``).

    Tapered layers differ in width. Where a block breaks the graph (the memory architectures'
    scans and period loops run eagerly), its functions are compiled once per distinct width, and
    past the limit (8 by default) that function runs eager for the remaining layers, with only a
    warning (a 12-layer tapered hope_attention or titans model hit it). A transformer's whole
    forward is one graph and is not affected.
    """
    import torch._dynamo

    dyn = torch._dynamo.config
    need = len(set(cfg.taper_plan.widths)) + 8  # one compile per width, and room for the rest
    dyn.recompile_limit = max(dyn.recompile_limit, need)
    dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 8 * need)


def pipeline_layer_specs(cfg: Config, unit: PipelineUnit | None = None) -> list[LayerSpec]:
    """DeepSpeed ``LayerSpec`` list of :func:`units` (``unit`` defaults to
    ``cfg.parallel.pipeline_unit``). Pair with ``loss_fn=lm_loss``."""
    return [u.spec() for u in units(cfg, unit)]
