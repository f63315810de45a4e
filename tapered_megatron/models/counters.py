"""Parameter, FLOP and activation counts of a configuration, read from the modules themselves.

Each unit of the unit table (:func:`tapered_megatron.models.units`) reports its own
:class:`~tapered_megatron.models.base.Counts` from its module classes (token mixer, MLP slot,
norms, embedding, head); :func:`count_model` arranges them per layer and in total. The pipeline
cost model reads the same unit counts.

Conventions: FLOPs are per token, forward = 2 x multiply-adds of every matmul plus attention
score/value products over the mean causal context; backward = 2 x forward; a first pass (Hope's
teach signal, the architecture record's ``first_pass_config``) adds its forward to the training
FLOPs; elementwise ops are ignored. Counts are for the full model (all TP ranks together).
Activation bytes are what one token keeps for backward with ``dtype_bytes``-sized activations
(2: bf16/fp16, 4: fp32), without activation checkpointing; with it, a checkpointed unit keeps only
its input (``ckpt_act_bytes``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tapered_megatron.architectures import resolve_architecture
from tapered_megatron.models.base import Counts
from tapered_megatron.models.language_model import units

if TYPE_CHECKING:
    from tapered_megatron.config import Config


@dataclass(frozen=True)
class LayerCounts:
    """One layer: its mixer sub-unit (norm + mixer) and MLP sub-unit (norm + MLP slot)."""

    layer: int
    d_ff: int
    mixer: Counts
    mlp: Counts

    @property
    def total(self) -> Counts:
        """Mixer + MLP."""
        return self.mixer + self.mlp


@dataclass(frozen=True)
class ModelCounts:
    """Counts of a whole model (see module docstring for conventions)."""

    arch: str
    layers: tuple[LayerCounts, ...]
    embedding: Counts
    head: Counts  # final norm + LM head + loss
    dtype_bytes: int
    ckpt_act_bytes: float  # per token per checkpointed unit (its input)
    first_pass_flops: float = 0.0  # per token: the forward a first pass adds (Hope's teach)

    @property
    def params_total(self) -> int:
        """All parameters."""
        return self.embedding.params + self.head.params + sum(l.total.params for l in self.layers)

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per token."""
        return self.embedding.flops + self.head.flops + sum(l.total.flops for l in self.layers)

    @property
    def train_flops_per_token(self) -> float:
        """Training FLOPs per token: forward + backward (3 x forward) and the forward of a
        first pass (Hope's teach signal; without backward)."""
        return 3.0 * self.flops_per_token + self.first_pass_flops

    @property
    def act_bytes_per_token(self) -> float:
        """Activation bytes per token kept for backward, whole model."""
        return (
            self.embedding.act_bytes
            + self.head.act_bytes
            + sum(l.total.act_bytes for l in self.layers)
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (keys used by ``models.summary --json``)."""
        return {
            "arch": self.arch,
            "params_total": self.params_total,
            "params_embedding": self.embedding.params,
            "params_head": self.head.params,
            "params_per_layer": [l.total.params for l in self.layers],
            "flops_per_token": self.flops_per_token,
            "train_flops_per_token": self.train_flops_per_token,
            "flops_per_token_per_layer": [l.total.flops for l in self.layers],
            "train_flops_per_token_per_layer": [3.0 * l.total.flops for l in self.layers],
            "first_pass_flops_per_token": self.first_pass_flops,
            "act_bytes_per_token_per_layer": [l.total.act_bytes for l in self.layers],
            "act_bytes_per_token": self.act_bytes_per_token,
            "ckpt_act_bytes_per_token_per_unit": self.ckpt_act_bytes,
            "dtype_bytes": self.dtype_bytes,
            "d_ff": [l.d_ff for l in self.layers],
            "embedding": asdict(self.embedding),
            "head": asdict(self.head),
            "layers": [
                {"layer": l.layer, "d_ff": l.d_ff, "mixer": asdict(l.mixer), "mlp": asdict(l.mlp)}
                for l in self.layers
            ],
        }


def count_model(cfg: Config, dtype_bytes: int = 2) -> ModelCounts:
    """Counts of ``cfg``'s model: the sub-layer units of the unit table, each counted by its
    own module classes."""
    emb, *halves, head = (u.counts(dtype_bytes) for u in units(cfg, "sublayer"))
    layers = tuple(
        LayerCounts(i, cfg.taper_plan.widths[i], mixer, mlp)
        for i, (mixer, mlp) in enumerate(zip(halves[::2], halves[1::2]))
    )
    d = cfg.model.d_model
    first = resolve_architecture(cfg.model.arch).first_pass_config(cfg)
    first_flops = 0.0 if first is None else count_model(first, dtype_bytes).flops_per_token
    return ModelCounts(
        cfg.model.arch, layers, emb, head, dtype_bytes, float(d * dtype_bytes), first_flops
    )
