"""The block protocol and the architecture registry: a new token mixer or MLP slot is one file.

A layer of every architecture is (tlm-spec.md section 1, pre-norm)::

    z = h + mixer(mixer_norm(h))        # token mixer M_l
    h = z + mlp(mlp_norm(z))            # MLP slot F_l, the tapered site (width d_ff(l))

The block (``tapered_megatron.models.language_model``) owns the two RMSNorms and the residual
adds; an architecture only supplies two classes, registered in :data:`ARCHITECTURES`:

* a :class:`TokenMixer` subclass and
* an :class:`MLPSlot` subclass.

Protocol for both (what the block, the pipeline specs and the counters rely on):

``__init__(self, cfg: Config, layer: int)``
    Build the module for global layer ``layer`` (0-based) of ``cfg``. Read widths from the ONE
    plan: ``cfg.taper_plan.widths[layer]`` is ``d_ff(l)``. No ``device`` argument: meta builds use
    ``with torch.device("meta"):``. Under tensor parallelism use the layers of
    :mod:`tapered_megatron.parallel` (heads and ``d_ff(l)`` split over TP ranks; input and output
    of ``forward`` are the full, replicated ``[b, s, d_model]``).

``forward(self, x: Tensor[b, s, d_model]) -> Tensor[b, s, d_model]``
    ``x`` is the normalised block input; return the branch output (the block adds the residual).
    Strictly causal along ``s``. One tensor in, one tensor out (pipeline units pass only the
    residual stream).

``counts(cls, cfg, layer, dtype_bytes=2) -> Counts``  (classmethod)
    The FULL-model (all TP ranks together) parameter count of this module, its forward FLOPs per
    token (2 x multiply-adds of every matmul, plus attention score/value products over the mean
    causal context; elementwise ops ignored) and the activation bytes per token it keeps for
    backward when ``dtype_bytes`` is the activation element size. Norms are counted by the block.
    ``tapered_megatron.models.counters.count_model`` reads only these, and a test checks that the
    parameter count equals the module built on the meta device.

Initialisation: every parameter that should be random declares ``param.init_std = std`` (normal)
or ``param.init_fn = fn(full_shape, generator) -> tensor`` (and ``param.tp_layout`` when split, as
the parallel layers do). The unit that owns the module calls
:func:`tapered_megatron.parallel.init_parameters` with the canonical prefix (``"layers.3."``), so
the init is the same at any TP size and in the pipeline form. Parameters without those
attributes keep their constructor value (constants such as norm gains or gate biases).

Registry values are ``"module:Class"`` strings imported on first use, so an architecture whose
file is missing fails only when it is built, with a message naming the file.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from tapered_megatron.config import Config


@dataclass(frozen=True)
class Counts:
    """Cost of one module, full model (summed over TP ranks), per token.

    Attributes:
        params: parameter count.
        flops: forward FLOPs per token (backward is counted as 2x forward by the aggregator).
        act_bytes: bytes per token kept for backward (no activation checkpointing).
    """

    params: int
    flops: float
    act_bytes: float

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.params + other.params,
            self.flops + other.flops,
            self.act_bytes + other.act_bytes,
        )


class BlockPart(nn.Module):
    """Common base of the two halves of a block (see the protocol in the module docstring)."""

    def __init__(self, cfg: Config, layer: int) -> None:
        super().__init__()
        self.layer = layer

    @classmethod
    def counts(cls, cfg: Config, layer: int, dtype_bytes: int = 2) -> Counts:
        """Parameters, forward FLOPs per token and activation bytes per token (full model)."""
        raise NotImplementedError(f"{cls.__name__}.counts")


class TokenMixer(BlockPart):
    """Base of token mixers ``M_l``: ``[b, s, d] -> [b, s, d]``, causal."""


class MLPSlot(BlockPart):
    """Base of MLP-slot modules ``F_l`` (the tapered site): ``[b, s, d] -> [b, s, d]``."""


ARCHITECTURES: dict[str, tuple[str, str]] = {
    "transformer": (
        "tapered_megatron.models.attention:Attention",
        "tapered_megatron.models.mlp:SwiGLU",
    ),
    "gated_attention": (
        "tapered_megatron.models.attention:GatedAttention",
        "tapered_megatron.models.mlp:SwiGLU",
    ),
    "titans": (
        "tapered_megatron.models.titans:TitansMixer",
        "tapered_megatron.models.mlp:SwiGLU",
    ),
    "hope_attention": (
        "tapered_megatron.models.attention:Attention",
        "tapered_megatron.models.hope:ContinuumMemory",
    ),
}


class ArchitectureError(RuntimeError):
    """An architecture that cannot be built (unknown name or missing module)."""


def register_architecture(name: str, mixer: str, mlp: str) -> None:
    """Add or replace an architecture: ``mixer`` and ``mlp`` are ``"module:Class"`` strings."""
    ARCHITECTURES[name] = (mixer, mlp)


def _load(path: str, arch: str) -> type:
    module, _, cls = path.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ArchitectureError(
            f"model.arch={arch!r} needs {module.replace('.', '/')}.py (class {cls}), "
            "which is not available in this installation"
        ) from None
    try:
        return getattr(mod, cls)
    except AttributeError:
        raise ArchitectureError(f"model.arch={arch!r}: {module} defines no class {cls}") from None


def resolve_architecture(arch: str) -> tuple[type[TokenMixer], type[MLPSlot]]:
    """The (token mixer class, MLP-slot class) of an architecture name."""
    if arch not in ARCHITECTURES:
        raise ArchitectureError(
            f"model.arch: unknown architecture {arch!r}; registered: {sorted(ARCHITECTURES)}"
        )
    mixer, mlp = ARCHITECTURES[arch]
    return _load(mixer, arch), _load(mlp, arch)
