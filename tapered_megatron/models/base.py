"""The block protocol: what a token mixer and an MLP slot are.

A layer of every architecture is (pre-norm, as in the paper, arXiv 2606.23670)::

    z = h + mixer(mixer_norm(h))        # token mixer M_l
    h = z + mlp(mlp_norm(z))            # MLP slot F_l, the tapered site (width d_ff(l))

The block (:class:`tapered_megatron.models.language_model.Block`) owns the two RMSNorms and the
residual adds. An architecture is one record (:class:`tapered_megatron.architectures.Architecture`,
torch-free: its options, checks, costs and the names of its modules) plus the modules: a
:class:`TokenMixer` subclass and an :class:`MLPSlot` subclass, imported when a model is built
(:func:`tapered_megatron.models.registry.blocks`).

A module whose weights learn inside the sequence (Titans' memory, Hope's CMS) carries a boolean
``in_context`` (True); :func:`in_context_memory` switches those updates off for a probe. A
module may report training diagnostics through ``diagnostics() -> {name: (sum, count)}``
(Titans: the share of tokens its memory's gradient clip acts on), which the trainer logs
(:func:`take_diagnostics`).

Protocol of the two module classes (what the block, the unit table and the counters rely on):

``__init__(self, cfg: Config, layer: int)``
    Build the module for global layer ``layer`` (0-based) of ``cfg``. Read widths from the ONE
    plan: ``cfg.taper_plan.widths[layer]`` is ``d_ff(l)``; the architecture's options are
    ``cfg.model.<section>``. No ``device`` argument: meta builds use
    ``with torch.device("meta"):``. Under tensor parallelism use the layers of
    :mod:`tapered_megatron.parallel` (heads and ``d_ff(l)`` split over TP ranks; input and output
    of ``forward`` are the full, replicated ``[b, s, d_model]``).

``takes_sequence_shards`` (class attribute, default ``False``)
    Under sequence parallelism (:func:`sequence_parallel`) a module that sets it takes and returns
    this rank's part of the sequence ``[b, s/tp, d_model]``: its first column-parallel layer
    all-gathers the input and its last row-parallel layer reduce-scatters the output (built with
    ``sequence_parallel=True``). Any other module gets the whole sequence from the block, as
    without sequence parallelism (the memory architectures' scans need it).

``backward_peaks(cls, cfg, layer, dtype_bytes, batch, tp, saved) -> list[(bytes, grads)]``
    The moments of the module's backward that may hold the most at once (the cost model's
    transient of the module's backward): each the bytes it holds then beyond what its forward
    saved, on one of ``tp`` TP ranks for a micro-batch of ``batch`` sequences, and the share of
    its parameters whose gradients it has made by then. The default is one moment at the end:
    ``backward_share`` (class attribute, default ``1.0``) of ``saved``, the bytes its forward
    saved on that rank, with every gradient made. Matmul backwards make gradients about as
    large as their saved inputs (1); a hand-written backward that walks its saved tensors
    piece by piece holds less (measured with the simulator's tracker,
    :mod:`tapered_megatron.planning.simulate`); a module whose working set follows its shapes
    counts it from them.

``recomputed_core(cls, cfg, layer, dtype_bytes, tp) -> float``
    Under ``train.recompute = selective``, the bytes per token of the core that its backward
    re-creates and holds at once. The default is the whole core (one :meth:`recomputed` call
    per forward); a module that recomputes its core piece by piece returns its largest piece.

``forward(self, x: Tensor[b, s, d_model]) -> Tensor[b, s, d_model]``
    ``x`` is the normalised block input; return the branch output (the block adds the residual).
    Strictly causal along ``s``. One tensor in, one tensor out (pipeline units pass only the
    residual stream).

``counts(cls, cfg, layer, dtype_bytes=2) -> Counts``  (classmethod)
    The FULL-model (all TP ranks together) parameter count of this module, its forward FLOPs per
    token (2 x multiply-adds of every matmul, plus attention score/value products over the mean
    causal context; elementwise ops ignored) and the activation bytes per token it keeps for
    backward when ``dtype_bytes`` is the activation element size. Norms are counted by the block.
    A module with a selectively recomputed core (:class:`Recomputed`) also gives the bytes the
    recompute frees and the core's FLOPs (``core_bytes``, ``core_flops``). The counters and the
    pipeline cost model read only these, and a test checks that the parameter count equals the
    module built on the meta device.

Initialisation: every parameter that should be random declares ``param.init_std = std`` (normal)
or ``param.init_fn = fn(full_shape, generator) -> tensor`` (and ``param.tp_layout`` when split, as
the parallel layers do). The unit that owns the module calls
:func:`tapered_megatron.parallel.init_parameters` with the canonical prefix (``"layers.3."``), so
the init is the same at any TP size and in the pipeline form. Parameters without those
attributes keep their constructor value (constants such as norm gains or gate biases).

Architectures outside the package are files, folders or modules named in ``model.plugins``
(imported by :func:`~tapered_megatron.architectures.load_plugins` before ``model.arch`` is
resolved); see ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tapered_megatron.parallel.random import recompute

if TYPE_CHECKING:
    from tapered_megatron.config import Config


@dataclass(frozen=True)
class Counts:
    """Cost of one module, full model (summed over TP ranks), per token.

    Attributes:
        params: parameter count.
        flops: forward FLOPs per token (backward is counted as 2x forward by the aggregator).
        act_bytes: bytes per token kept for backward (no activation recomputation).
        kv_params: the part of ``params`` split over the key/value heads (every TP rank holds
            all of them when the TP size exceeds ``model.kv_heads``).
        core_bytes: the part of ``act_bytes`` that selective recompute frees (the core's
            saved activations beyond its inputs and output, :class:`Recomputed`).
        core_flops: forward FLOPs per token of that core (run again in backward).
        core_replicated: the part of ``core_bytes`` every TP rank holds whole.
        act_replicated: the part of ``act_bytes`` every TP rank keeps whole beyond the half's
            input (tensors over ``d_model`` or over tokens only inside the TP region).
    """

    params: int
    flops: float
    act_bytes: float
    kv_params: int = 0
    core_bytes: float = 0.0
    core_flops: float = 0.0
    core_replicated: float = 0.0
    act_replicated: float = 0.0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.params + other.params,
            self.flops + other.flops,
            self.act_bytes + other.act_bytes,
            self.kv_params + other.kv_params,
            self.core_bytes + other.core_bytes,
            self.core_flops + other.core_flops,
            self.core_replicated + other.core_replicated,
            self.act_replicated + other.act_replicated,
        )

    def local_core(self, tp: int) -> float:
        """``core_bytes`` on one of ``tp`` TP ranks: the replicated part whole, the rest split."""
        return self.core_replicated + (self.core_bytes - self.core_replicated) / tp


def sequence_parallel(cfg: Config) -> bool:
    """Whether modules built now split the sequence outside the TP regions:
    ``parallel.sequence_parallel`` with a TP group of several ranks (a tool that builds the
    model in one process gets the plain model)."""
    from tapered_megatron.parallel import get_tensor_model_parallel_world_size

    return cfg.parallel.sequence_parallel and get_tensor_model_parallel_world_size() > 1


class Recomputed:
    """Mixin of modules with a core that ``train.recompute = selective`` recomputes in backward
    (an attention core, a memory scan or update): they run it as ``self.recomputed(fn, *args)``.
    The linear layers around the core keep their outputs; :func:`set_recompute` switches it."""

    selective_recompute: bool = False
    training: bool

    @property
    def recomputing(self) -> bool:
        """Whether :meth:`recomputed` drops what its function saves (and keeps its inputs
        instead): selective recompute, in training with gradients."""
        return self.selective_recompute and self.training and torch.is_grad_enabled()

    def recomputed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; under selective recompute, in training with gradients, its saved
        activations are dropped and recomputed in backward (the same random numbers)."""
        if self.recomputing:
            return recompute(fn, *args)
        return fn(*args)


class BlockPart(Recomputed, nn.Module):
    """Common base of the two halves of a block (see the protocol in the module docstring)."""

    takes_sequence_shards: ClassVar[bool] = False
    backward_share: ClassVar[float] = 1.0

    def __init__(self, cfg: Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.selective_recompute = cfg.train.recompute == "selective"

    @classmethod
    def counts(cls, cfg: Config, layer: int, dtype_bytes: int = 2) -> Counts:
        """Parameters, forward FLOPs per token and activation bytes per token (full model)."""
        raise NotImplementedError(f"{cls.__name__}.counts")

    @classmethod
    def backward_peaks(
        cls, cfg: Config, layer: int, dtype_bytes: int, batch: int, tp: int, saved: float
    ) -> list[tuple[float, float]]:
        """The moments of the backward that may hold the most at once: (bytes beyond what the
        forward saved on one of ``tp`` TP ranks for ``batch`` sequences, share of the
        parameters whose gradients exist then); ``saved``: the bytes the forward saved on that
        rank. Default: ``backward_share`` of them at the end, every gradient made."""
        return [(cls.backward_share * saved, 1.0)]

    @classmethod
    def recomputed_core(cls, cfg: Config, layer: int, dtype_bytes: int, tp: int) -> float:
        """Bytes per token, on one of ``tp`` TP ranks, of the core (``Counts.core_bytes``) that
        selective recompute re-creates and holds at once in this half's backward. Default: all
        of it (one recompute)."""
        return cls.counts(cfg, layer, dtype_bytes).local_core(tp)


class TokenMixer(BlockPart):
    """Base of token mixers ``M_l``: ``[b, s, d] -> [b, s, d]``, causal."""


class MLPSlot(BlockPart):
    """Base of MLP-slot modules ``F_l`` (the tapered site): ``[b, s, d] -> [b, s, d]``."""


@contextmanager
def in_context_memory(model: nn.Module, on: bool) -> Iterator[int]:
    """Within the block, the in-context updates of every module of ``model`` that has them (an
    ``in_context`` attribute) are ``on`` or off: off, each such module keeps its learned weights
    for the whole sequence. Yields how many modules that is (0: no in-context memory); the
    previous settings are restored on exit."""
    mods = [m for m in model.modules() if isinstance(getattr(m, "in_context", None), bool)]
    before = [m.in_context for m in mods]
    for m in mods:
        m.in_context = on
    try:
        yield len(mods)
    finally:
        for m, b in zip(mods, before):
            m.in_context = b


def take_diagnostics(model: nn.Module) -> dict[str, float]:
    """The training diagnostics of ``model``'s modules (each ``diagnostics()``, which resets
    it): per name, the sum over modules of their ``(sum, count)`` pairs, as ``sum / count``."""
    totals: dict[str, torch.Tensor] = {}
    for m in model.modules():
        if callable(getattr(m, "diagnostics", None)):
            for name, pair in m.diagnostics().items():
                totals[name] = totals[name] + pair if name in totals else pair
    return {name: float(t[0] / t[1].clamp_min(1)) for name, t in totals.items()}
