"""The language model, in two forms built from the same units.

* :func:`build_model` -> :class:`LanguageModel` (one ``nn.Module``): ``forward(input_ids)`` gives
  logits ``[b, s, padded_vocab]`` (this rank's vocabulary slice under TP).
* :func:`pipeline_layer_specs` -> DeepSpeed ``LayerSpec`` list for ``PipelineModule``:
  ``Embedding``, then one :class:`Block` per layer (``unit="layer"``) or a :class:`MixerUnit` and
  an :class:`MLPUnit` per layer (``unit="sublayer"``), then :class:`Head` (final norm + LM head);
  :func:`lm_loss` is the ``loss_fn``. Units pass one tensor: the residual stream.

Each unit initialises its own parameters from ``(cfg.train.seed, canonical name)`` where the
canonical name is the parameter's name in :class:`LanguageModel` (``layers.3.mlp.w13.weight``),
so both forms and every TP/PP layout start from the same full weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tapered_megatron.models.base import resolve_architecture
from tapered_megatron.models.layers import RMSNorm
from tapered_megatron.parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    init_parameters,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy_mean,
)

if TYPE_CHECKING:
    from deepspeed.pipe import LayerSpec

    from tapered_megatron.config import Config


class _Unit(nn.Module):
    """A block or sub-block unit: optional activation checkpointing around ``_forward``.

    The flag starts from ``cfg.parallel.activation_checkpointing``; the training loop may flip it
    with :func:`set_activation_checkpointing`.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.activation_checkpointing = cfg.parallel.activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Embedding(nn.Module):
    """Token ids ``[b, s]`` -> residual stream ``[b, s, d]`` (vocab-parallel embedding)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        self.embed = VocabParallelEmbedding(cfg.padded_vocab_size, m.d_model, std=m.init_std)
        init_parameters(self, cfg.train.seed, "embedding.")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class MixerUnit(_Unit):
    """``z = h + mixer(mixer_norm(h))`` of global layer ``layer`` (pipeline sub-unit)."""

    def __init__(self, cfg: Config, layer: int) -> None:
        super().__init__(cfg)
        mixer_cls, _ = resolve_architecture(cfg.model.arch)
        self.layer = layer
        self.mixer_norm = RMSNorm(cfg.model.d_model, cfg.model.norm_eps)
        self.mixer = mixer_cls(cfg, layer)
        init_parameters(self, cfg.train.seed, f"layers.{layer}.")

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.mixer_norm(h))


class MLPUnit(_Unit):
    """``h = z + mlp(mlp_norm(z))`` of global layer ``layer`` (pipeline sub-unit)."""

    def __init__(self, cfg: Config, layer: int) -> None:
        super().__init__(cfg)
        _, mlp_cls = resolve_architecture(cfg.model.arch)
        self.layer = layer
        self.mlp_norm = RMSNorm(cfg.model.d_model, cfg.model.norm_eps)
        self.mlp = mlp_cls(cfg, layer)
        init_parameters(self, cfg.train.seed, f"layers.{layer}.")

    def _forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.mlp(self.mlp_norm(z))


class Block(_Unit):
    """One layer: ``z = h + mixer(mixer_norm(h)); h = z + mlp(mlp_norm(z))``."""

    def __init__(self, cfg: Config, layer: int) -> None:
        super().__init__(cfg)
        mixer_cls, mlp_cls = resolve_architecture(cfg.model.arch)
        m = cfg.model
        self.layer = layer
        self.mixer_norm = RMSNorm(m.d_model, m.norm_eps)
        self.mixer = mixer_cls(cfg, layer)
        self.mlp_norm = RMSNorm(m.d_model, m.norm_eps)
        self.mlp = mlp_cls(cfg, layer)
        init_parameters(self, cfg.train.seed, f"layers.{layer}.")

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        z = h + self.mixer(self.mixer_norm(h))
        return z + self.mlp(self.mlp_norm(z))


class Head(nn.Module):
    """Final RMSNorm and the untied LM head (column-parallel over the padded vocabulary)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        self.norm = RMSNorm(m.d_model, m.norm_eps)
        self.proj = ColumnParallelLinear(m.d_model, cfg.padded_vocab_size, std=m.init_std)
        init_parameters(self, cfg.train.seed, "head.")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(h))

    def loss(self, h: torch.Tensor, labels: torch.Tensor | tuple) -> torch.Tensor:
        """``lm_loss(self(h), labels)`` with the LM head fused into the cross-entropy and taken
        in chunks, so no logits-sized tensor exists (see
        ``vocab_parallel_linear_cross_entropy_mean``)."""
        target, mask = labels if isinstance(labels, (tuple, list)) else (labels, None)
        x = copy_to_tp_region(self.norm(h))
        return vocab_parallel_linear_cross_entropy_mean(x, self.proj.weight, target, mask)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor | tuple) -> torch.Tensor:
    """Mean next-token cross-entropy over (vocab-parallel) logits: the pipeline ``loss_fn``.

    ``labels`` is ``[b, s]`` token ids, or ``(labels, loss_mask)`` with a 0/1 mask ``[b, s]``.
    """
    target, mask = labels if isinstance(labels, (tuple, list)) else (labels, None)
    loss = vocab_parallel_cross_entropy(logits, target)
    if mask is None:
        return loss.mean()
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


class LanguageModel(nn.Module):
    """Embedding, ``cfg.model.layers`` blocks, final norm and LM head.

    ``forward(input_ids)`` returns logits ``[b, s, cfg.padded_vocab_size]`` (under TP: this
    rank's contiguous vocabulary slice); ``forward(input_ids, labels)`` returns the mean loss.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.model.layers))
        self.head = Head(cfg)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | tuple | None = None
    ) -> torch.Tensor:
        if self.cfg.model.arch == "hope_attention" and self.cfg.model.hope.update == "teach":
            from tapered_megatron.models.hope import teach_pass  # its first pass (hope.py doc)

            teach_pass(self, input_ids)
        h = self.embedding(input_ids)
        for block in self.layers:
            h = block(h)
        return self.head(h) if labels is None else self.head.loss(h, labels)


def set_activation_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Recompute each block's (or pipeline unit's) activations in backward when ``enabled``."""
    for module in model.modules():
        if isinstance(module, _Unit):
            module.activation_checkpointing = enabled
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


def pipeline_layer_specs(cfg: Config, unit: str | None = None) -> list[LayerSpec]:
    """DeepSpeed ``LayerSpec`` list: embedding, blocks or sub-units, final norm + head.

    ``unit`` defaults to ``cfg.parallel.pipeline_unit``. Pair with ``loss_fn=lm_loss``. Each
    unit's activation checkpointing follows ``cfg.parallel.activation_checkpointing``.
    """
    from deepspeed.pipe import LayerSpec

    unit = unit or cfg.parallel.pipeline_unit
    if unit not in ("layer", "sublayer"):
        raise ValueError(f"pipeline unit must be 'layer' or 'sublayer', got {unit!r}")
    resolve_architecture(cfg.model.arch)  # fail early, before any stage builds
    specs: list[LayerSpec] = [LayerSpec(Embedding, cfg)]
    for i in range(cfg.model.layers):
        if unit == "layer":
            specs.append(LayerSpec(Block, cfg, i))
        else:
            specs += [LayerSpec(MixerUnit, cfg, i), LayerSpec(MLPUnit, cfg, i)]
    specs.append(LayerSpec(Head, cfg))
    return specs
