"""DeepSpeed ``PipelineModule`` whose stages are given explicitly (our balancer's partition).

DeepSpeed's ``PipelineModule`` chooses stage boundaries itself (``partition_method`` = uniform,
parameters or type:regex). :class:`BalancedPipelineModule` takes the boundaries instead, in
DeepSpeed's own ``parts`` format, checks them, prints the per-stage table on global rank 0 and
otherwise behaves exactly like DeepSpeed's class (same layer building, tied layers, activation
checkpointing, checkpoint layer files).

Typical use (``pretrain/main.py``)::

    module = BalancedPipelineModule.from_config(cfg, topology=topo, micro_batches=gas)

or, with specs and boundaries computed elsewhere::

    module = BalancedPipelineModule(specs, parts, topology=topo, loss_fn=loss_fn)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from deepspeed.pipe import PipelineModule

if TYPE_CHECKING:
    from tapered_megatron.config import Config


class BalancedPipelineModule(PipelineModule):
    """A ``PipelineModule`` with explicit stage boundaries.

    Args:
        layers: the layer specs (``LayerSpec``/modules/callables), in order.
        parts: stage boundaries, length ``num_stages + 1``: ``parts[0] == 0``, ``parts[-1] ==
            len(layers)``, strictly increasing (every stage non-empty).
        table: text printed on global rank 0 at start-up (the balancer's per-stage table);
            default: a plain list of the layers of every stage.
        **kwargs: everything else of ``deepspeed.pipe.PipelineModule`` (``num_stages`` or
            ``topology``, ``loss_fn``, ``activation_checkpoint_interval``, ...);
            ``partition_method`` is not accepted.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        parts: Sequence[int],
        *,
        table: str | None = None,
        **kwargs: Any,
    ) -> None:
        if "partition_method" in kwargs:
            raise TypeError("BalancedPipelineModule takes explicit parts, not partition_method")
        # Set before PipelineModule.__init__, which calls _partition_layers during construction.
        object.__setattr__(self, "_explicit_parts", [int(x) for x in parts])
        object.__setattr__(self, "_stage_table", table)
        super().__init__(layers, partition_method="explicit", **kwargs)

    def _partition_layers(self, method: str = "explicit") -> None:
        parts = self._explicit_parts
        n, p = len(self._layer_specs), self.num_stages
        if len(parts) != p + 1 or parts[0] != 0 or parts[-1] != n:
            raise ValueError(
                f"parts {parts} must have {p + 1} entries from 0 to {n} (the number of specs)"
            )
        if any(b <= a for a, b in itertools.pairwise(parts)):
            raise ValueError(f"parts {parts}: every pipeline stage needs at least one layer spec")
        self.parts = list(parts)
        if self.global_rank == 0:
            print(self._stage_table or self._default_table(), flush=True)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _default_table(self) -> str:
        lines = [f"pipeline partition (explicit) parts={self.parts}"]
        for j in range(self.num_stages):
            names = [_spec_name(s) for s in self._layer_specs[self.parts[j] : self.parts[j + 1]]]
            lines.append(f"  stage {j}: specs {self.parts[j]}:{self.parts[j + 1]} {names}")
        return "\n".join(lines)

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        micro_batches: int | None = None,
        method: str | None = None,
        unit: str | None = None,
        partition_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BalancedPipelineModule:
        """Specs and boundaries from one unit table: ``pipeline_layer_specs(cfg, unit)`` and
        our balancer over the same units.

        ``method`` defaults to ``cfg.parallel.partition``, ``unit`` to
        ``cfg.parallel.pipeline_unit``; the number of stages comes from ``topology`` (or
        ``num_stages``, else ``cfg.parallel.pp``). ``partition_kwargs`` go to
        :func:`tapered_megatron.planning.balance.analyse` (``device``, ``gpu_mem``, ``dp``, ...).
        Other keyword arguments go to ``PipelineModule`` (``loss_fn`` defaults to
        :func:`tapered_megatron.models.lm_loss`, the fused LM-head loss of the single model).
        """
        from tapered_megatron.models import lm_loss, pipeline_layer_specs
        from tapered_megatron.planning.balance import ALIASES, analyse

        u = unit or cfg.parallel.pipeline_unit
        specs = pipeline_layer_specs(cfg, unit=u)
        topo = kwargs.get("topology")
        pp = topo.get_dim("pipe") if topo is not None else kwargs.get("num_stages", cfg.parallel.pp)
        if topo is None:
            kwargs.setdefault("num_stages", pp)
        m = ALIASES.get(method or cfg.parallel.partition, method or cfg.parallel.partition)
        res = analyse(cfg, pp, micro_batches, unit=u, methods=(m,), **(partition_kwargs or {}))
        kwargs.setdefault("loss_fn", lm_loss)
        parts, table = agree_on_parts(list(res.methods[m].parts), res.table(m))
        return cls(specs, parts, table=table, **kwargs)


def agree_on_parts(parts: list[int], table: str) -> tuple[list[int], str]:
    """Global rank 0's stage boundaries (and table), handed to every rank.

    Each rank balances from its own unit costs, and measured (``profiled``) costs differ from
    machine to machine, so ranks could choose different boundaries and deadlock in the first
    pipeline exchange. Collective when a process group of several ranks exists: every rank gets
    rank 0's choice; a rank whose own choice differed says so. Without a process group the
    inputs are returned unchanged.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return parts, table
    box: list[Any] = [parts, table]
    dist.broadcast_object_list(box, src=0)
    if box[0] != parts:
        print(
            f"rank {dist.get_rank()}: own pipeline split {parts} differs from rank 0's "
            f"{box[0]} (different unit costs); every rank uses rank 0's",
            flush=True,
        )
    return list(box[0]), str(box[1])


def _spec_name(spec: Any) -> str:
    typename = getattr(spec, "typename", None)
    if typename is not None:
        return typename.__name__
    return getattr(spec, "__name__", type(spec).__name__)
