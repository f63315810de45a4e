"""Process topology and groups: DeepSpeed's ``PipeModelDataParallelTopology`` (pipe, data, model).

Ranks are laid out row-major over the axes ``pipe, data, model``, so the ranks of one
tensor-parallel group are adjacent (one node's GPUs) and pipeline stages are furthest apart.
:func:`init_model_parallel` creates one ``torch.distributed`` group per axis list and stores the
ones this rank belongs to; the getters answer for this rank.

Without ``torch.distributed`` (or before :func:`init_model_parallel`) everything answers as a
single process: TP = PP = 1, rank 0, group ``None``, and data-parallel size = the world size.
The module also satisfies DeepSpeed's ``mpu`` protocol (``get_model_parallel_*``,
``get_data_parallel_*``), so ``deepspeed.initialize(..., mpu=tapered_megatron.parallel.topology)``
works for TP without pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:  # deepspeed is imported only when a topology is built (it is slow to import)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


def _topology(pp: int, tp: int, dp: int) -> PipeModelDataParallelTopology:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


@dataclass
class _State:
    topology: PipeModelDataParallelTopology | None = None
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    tp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)


_STATE = _State()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_model_parallel(tp: int = 1, pp: int = 1) -> PipeModelDataParallelTopology:
    """Build the topology and this rank's TP / PP / DP groups; DP = world // (tp * pp).

    Must be called by every rank (group creation is collective). Single process: only tp = pp = 1.
    Calling again replaces the previous groups.
    """
    rank, world = _world()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(
            f"parallel.tp * parallel.pp = {tp}*{pp} must divide the world size ({world})"
        )
    topo = _topology(pp, tp, world // (tp * pp))
    state = _State(topology=topo)
    for axis, attr in (("model", "tp"), ("pipe", "pp"), ("data", "dp")):
        for ranks in topo.get_axis_comm_lists(axis):
            group = dist.new_group(ranks) if world > 1 else None
            if rank in ranks:
                setattr(state, f"{attr}_group", group)
                setattr(state, f"{attr}_ranks", tuple(ranks))
    _STATE.__dict__.update(state.__dict__)
    return topo


def destroy_model_parallel() -> None:
    """Forget the groups (the process group itself is the caller's to destroy)."""
    _STATE.__dict__.update(_State().__dict__)


def model_parallel_is_initialized() -> bool:
    """Whether :func:`init_model_parallel` has run in this process."""
    return _STATE.topology is not None


def get_topology() -> PipeModelDataParallelTopology:
    """The topology (a 1x1xworld one if :func:`init_model_parallel` was never called)."""
    if _STATE.topology is None:
        return _topology(1, 1, _world()[1])
    return _STATE.topology


def _coord(axis: str) -> int:
    if _STATE.topology is None:
        return _world()[0] if axis == "data" else 0
    return getattr(_STATE.topology.get_coord(_world()[0]), axis)


def get_tensor_model_parallel_group() -> Any:
    """This rank's tensor-parallel group (``None`` when TP is 1 in a single process)."""
    return _STATE.tp_group


def get_tensor_model_parallel_world_size() -> int:
    """Number of tensor-parallel ranks."""
    return len(_STATE.tp_ranks)


def get_tensor_model_parallel_rank() -> int:
    """This rank's index inside its tensor-parallel group."""
    return _coord("model")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 of this rank's group (for broadcasting data inside the group)."""
    return _STATE.tp_ranks[0] if _STATE.topology is not None else _world()[0]


def get_pipeline_model_parallel_group() -> Any:
    """This rank's pipeline group."""
    return _STATE.pp_group


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return len(_STATE.pp_ranks)


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    return _coord("pipe")


def get_data_parallel_group() -> Any:
    """This rank's data-parallel group (``None`` before init: use the default group)."""
    return _STATE.dp_group


def get_data_parallel_world_size() -> int:
    """Number of data-parallel replicas."""
    return len(_STATE.dp_ranks) if _STATE.topology is not None else _world()[1]


def get_data_parallel_rank() -> int:
    """This rank's data-parallel index."""
    return _coord("data")


# DeepSpeed's mpu protocol calls the tensor-parallel group the "model parallel" group.
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
