"""Tensor-parallel layers (Megatron style) and layout-invariant parameter initialisation.

Every tensor-parallel parameter carries a :class:`TPLayout` (``param.tp_layout``): the shape of
the FULL tensor, the view in which it is split, and the split dimension. :func:`shard` cuts a
full tensor into this rank's piece, :func:`unshard` puts the pieces of all ranks back together.

Initialisation (:func:`init_parameters`) is layout-invariant: for each parameter with an
``init_std`` (or ``init_fn``) attribute, the FULL tensor is drawn on the CPU from a generator
seeded by ``(seed, canonical name)`` and this rank keeps its shard. The same seed therefore gives
the same full weights at any TP size, on any pipeline stage and in either module form.
Parameters without those attributes (norm gains) keep their constructor value. Under
``deepspeed.zero.Init`` (ZeRO-3 built partitioned) each rank writes only its own ZeRO partition
of the full tensor, so no rank ever holds the whole model.

Layers: :class:`ColumnParallelLinear` (output features split, or replicated where a split axis
of key/value heads is smaller than the TP size; input replicated),
:class:`RowParallelLinear` (input features split; partial outputs summed), and
:class:`VocabParallelEmbedding` (vocabulary rows split). No biases (as in the paper, arXiv
2606.23670). With ``sequence_parallel`` (Megatron's sequence parallelism) their input or output
outside the TP region is this rank's part of the sequence: a column-parallel layer all-gathers
its input (reduce-scatter of the gradient), a row-parallel layer and the embedding
reduce-scatter their output (all-gather of the gradient).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tapered_megatron.parallel.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from tapered_megatron.parallel.random import param_generator
from tapered_megatron.parallel.topology import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


@dataclass(frozen=True)
class TPLayout:
    """How a full tensor is split over TP ranks.

    The full tensor (``full_shape``) is viewed as ``view_shape`` and chunked along ``view_dim``;
    each piece is reshaped to ``full_shape`` with axis ``full_dim`` divided by the TP size.
    With ``replicate`` a split axis smaller than the TP size (a divisor of it, e.g. the key/value
    heads of grouped-query attention) is not split: every rank holds the whole tensor.
    """

    full_shape: tuple[int, ...]
    view_shape: tuple[int, ...]
    view_dim: int
    full_dim: int
    replicate: bool = False

    def replicated(self, tp: int) -> bool:
        """Whether every rank of a TP group of ``tp`` holds the whole tensor."""
        n = self.view_shape[self.view_dim]
        return self.replicate and n < tp and tp % n == 0

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one rank's shard."""
        if self.replicated(tp):
            return self.full_shape
        if self.view_shape[self.view_dim] % tp:
            raise ValueError(
                f"axis {self.view_dim} of {self.view_shape} is not divisible by the TP size {tp}"
            )
        shape = list(self.full_shape)
        shape[self.full_dim] //= tp
        return tuple(shape)


def row_layout(
    full_shape: Sequence[int],
    blocks: Sequence[int] | None = None,
    dim: int = 0,
    replicate: bool = False,
) -> TPLayout:
    """Split the first (output) dimension; ``blocks`` factorises it (e.g. ``(2, d_ff)``) and
    ``dim`` picks the factor to split, so fused weights split per block; ``replicate``: see
    :class:`TPLayout`."""
    full = tuple(full_shape)
    blocks = tuple(blocks) if blocks else (full[0],)
    if math.prod(blocks) != full[0]:
        raise ValueError(f"blocks {blocks} do not factorise dimension {full[0]}")
    return TPLayout(full, (*blocks, *full[1:]), dim, 0, replicate)


def col_layout(full_shape: Sequence[int]) -> TPLayout:
    """Split the last (input) dimension contiguously."""
    full = tuple(full_shape)
    return TPLayout(full, full, len(full) - 1, len(full) - 1)


def shard(full: torch.Tensor, layout: TPLayout, rank: int, tp: int) -> torch.Tensor:
    """This rank's piece of a full tensor (the whole tensor where the layout replicates)."""
    if layout.replicated(tp):
        return full.reshape(layout.full_shape).contiguous()
    piece = full.reshape(layout.view_shape).chunk(tp, dim=layout.view_dim)[rank]
    return piece.reshape(layout.local_shape(tp)).contiguous()


def unshard(pieces: Sequence[torch.Tensor], layout: TPLayout) -> torch.Tensor:
    """The full tensor from every rank's piece (rank order)."""
    tp = len(pieces)
    if layout.replicated(tp):
        return pieces[0].reshape(layout.full_shape)
    view = list(layout.view_shape)
    view[layout.view_dim] //= tp
    parts = [p.reshape(view) for p in pieces]
    return torch.cat(parts, dim=layout.view_dim).reshape(layout.full_shape)


def mark_split(param: nn.Parameter, layout: TPLayout) -> nn.Parameter:
    """Attach the split layout; ``tensor_model_parallel`` / ``partition_dim`` are the Megatron
    attribute names DeepSpeed and :func:`~tapered_megatron.parallel.norms.grad_norm` read (so
    grad norms count every shard and each replica once: a replicated tensor is not
    model-parallel). Every parameter split over TP goes through here."""
    param.tp_layout = layout
    param.tensor_model_parallel = not layout.replicated(get_tensor_model_parallel_world_size())
    param.partition_dim = layout.full_dim
    return param


def _mark(param: nn.Parameter, layout: TPLayout, std: float) -> nn.Parameter:
    """:func:`mark_split` plus the init std."""
    param.init_std = std
    return mark_split(param, layout)


def init_parameters(module: nn.Module, seed: int, prefix: str = "") -> None:
    """Layout-invariant init of every parameter of ``module`` that declares how to init.

    ``prefix`` + the parameter's name inside ``module`` is its canonical key (e.g. the block of
    global layer 3 passes ``"layers.3."``). A parameter declares ``init_std`` (normal(0, std)) or
    ``init_fn(full_shape, generator) -> tensor``; ``tp_layout`` says how it is split.
    Meta-device parameters are skipped.
    """
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    for name, p in module.named_parameters():
        fn: Callable | None = getattr(p, "init_fn", None)
        std = getattr(p, "init_std", None)
        if p.is_meta or (fn is None and std is None):
            continue
        layout: TPLayout | None = getattr(p, "tp_layout", None)
        zero3 = hasattr(p, "ds_id")  # built under deepspeed.zero.Init: p holds no data
        shape = layout.full_shape if layout is not None else tuple(param_shape(p))
        with _outside_zero_init(zero3):  # drawn in fp32 on the CPU whatever zero.Init patches
            gen = param_generator(seed, prefix + name)
            if fn is not None:
                full = fn(shape, gen)
            else:
                full = torch.empty(shape, dtype=torch.float32, device="cpu")
                full.normal_(0.0, std, generator=gen)
        local = shard(full, layout, rank, tp) if layout is not None else full
        with torch.no_grad():
            if zero3:
                _write_zero3_partition(p, local)
            else:
                p.copy_(local.to(p.dtype))


def param_shape(p: nn.Parameter) -> torch.Size:
    """``p``'s shape on this TP rank, also when ``deepspeed.zero.Init`` partitioned it (then
    ``p`` itself is an empty stub and DeepSpeed keeps the shape as ``ds_shape``)."""
    return getattr(p, "ds_shape", p.shape)


@contextlib.contextmanager
def _outside_zero_init(active: bool) -> Iterator[None]:
    """Lift ``deepspeed.zero.Init``'s tensor-constructor patches (which would cast to the
    training dtype and move to the accelerator) for the block, when ``active``."""
    if not active:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import (
        restore_init_context,
        shutdown_init_context,
    )

    shutdown_init_context()
    try:
        yield
    finally:
        restore_init_context()


def _write_zero3_partition(p: nn.Parameter, local: torch.Tensor) -> None:
    """Put this data-parallel rank's ZeRO-3 partition of ``local`` (the TP-local full tensor)
    into ``p.ds_tensor``: the flat slice DeepSpeed's own partitioning keeps, so the whole tensor
    is never gathered. Falls back to gathering the one parameter where the partition lives
    elsewhere (NVMe offload, a secondary hpZ copy)."""
    part = p.ds_tensor
    if getattr(part, "final_location", None) is not None or p.ds_secondary_tensor is not None:
        from deepspeed.zero import GatheredParameters

        with GatheredParameters([p], modifier_rank=0):
            p.copy_(local.to(p.dtype))
        return
    n = part.numel()
    flat = local.reshape(-1)
    start = min(n * p.ds_zero_partition_rank, flat.numel())
    piece = flat[start : start + n]
    part.narrow(0, 0, piece.numel()).copy_(piece.to(part.dtype))


def column_input(x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """``x`` entering the TP region of column-parallel layers: identity forward, the gradient
    all-reduced over TP backward; with ``sequence_parallel`` ``x`` is this rank's part of the
    sequence, all-gathered (the gradient reduce-scattered). Several layers on one input
    (``shared_input``) enter once."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x)
    return copy_to_tp_region(x)


def row_output(partial: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
    """Leave the TP region by summing each rank's partial result over the TP group: all-reduce
    forward, identity backward; with ``sequence_parallel`` reduce-scattered, each rank keeping
    its part of the sequence (the gradient all-gathered)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(partial)
    return reduce_from_tp_region(partial)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T``, W's output features split over TP ranks (input replicated).

    Args:
        in_features, out_features: full sizes.
        std: init standard deviation.
        out_blocks: factorisation of ``out_features`` whose axis ``split_dim`` is split, so a
            fused weight splits per block (``(2, d_ff)`` for gate+up, ``(heads, per_head)``).
        gather_output: all-gather the output (else each rank returns its slice).
        replicate: the split axis (heads) may be smaller than the TP size, a divisor of it
            (the key/value heads of grouped-query attention): every rank then holds the whole
            weight and computes only block ``rank // (tp / blocks)`` of it, the one the other
            heads of its rank need; the gradient is summed over TP, so the copies stay equal.
        shared_input: ``x`` has entered the TP region already (:func:`column_input`, once
            for several layers on the same input: one gradient all-reduce for all of them).
        sequence_parallel: the input is this rank's part of the sequence, all-gathered here.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        std: float,
        out_blocks: Sequence[int] | None = None,
        split_dim: int = 0,
        gather_output: bool = False,
        replicate: bool = False,
        shared_input: bool = False,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.sequence_parallel = sequence_parallel
        layout = row_layout((out_features, in_features), out_blocks, split_dim, replicate)
        self.in_features, self.out_features, self.gather_output = (
            in_features,
            out_features,
            gather_output,
        )
        self.shared_input = shared_input
        self.pick: int | None = None  # the block this rank computes of a replicated weight
        if layout.replicated(tp):
            blocks = layout.view_shape[layout.view_dim]
            self.pick = get_tensor_model_parallel_rank() // (tp // blocks)
        w = torch.empty(layout.local_shape(tp), device=device, dtype=dtype)
        self.weight = _mark(nn.Parameter(w), layout, std)

    def local_weight(self) -> torch.Tensor:
        """The rows this rank multiplies by: its shard, or its block of a replicated weight
        (whose gradient is then all-reduced over TP)."""
        if self.pick is None:
            return self.weight
        layout: TPLayout = self.weight.tp_layout
        w = copy_to_tp_region(self.weight).reshape(layout.view_shape)
        return w.narrow(layout.view_dim, self.pick, 1).reshape(-1, self.in_features)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this layer multiplies it: the whole sequence, replicated over TP ranks, whose
        gradient is summed over them (as is, when it entered the region already)."""
        return x if self.shared_input else column_input(x, self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.enter(x), self.local_weight())
        return gather_from_tp_region(y) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local={tuple(self.weight.shape)}"


class RowParallelLinear(nn.Module):
    """``y = x W^T``, W's input features split over TP ranks; partial outputs are all-reduced.

    ``input_is_parallel`` (default): ``x`` is already this rank's slice (the output of a
    :class:`ColumnParallelLinear`); otherwise it is scattered first. ``sequence_parallel``: the
    sum is reduce-scattered, each rank keeping its part of the sequence.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        std: float,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        layout = col_layout((out_features, in_features))
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        w = torch.empty(layout.local_shape(tp), device=device, dtype=dtype)
        self.weight = _mark(nn.Parameter(w), layout, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x)
        return self.leave(F.linear(x, self.weight))

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum this rank's partial output over the TP group (all-reduce, or reduce-scatter to
        sequence shards)."""
        return row_output(partial, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local={tuple(self.weight.shape)}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split over TP ranks.

    Each rank looks up the ids in its row range (others give zeros); the sum over ranks is the
    full embedding. ``num_embeddings`` must be divisible by the TP size (use the padded vocab).
    ``sequence_parallel``: the sum is reduce-scattered, each rank keeping its part of the sequence.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        std: float,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.sequence_parallel = sequence_parallel
        layout = row_layout((num_embeddings, embedding_dim))
        local = layout.local_shape(tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = rank * local[0]
        self.vocab_end = self.vocab_start + local[0]
        w = torch.empty(local, device=device, dtype=dtype)
        self.weight = _mark(nn.Parameter(w), layout, std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tensor_model_parallel_world_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return row_output(out, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"rows=[{self.vocab_start}, {self.vocab_end})"
        )
