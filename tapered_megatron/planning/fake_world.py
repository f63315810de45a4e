"""A simulated world for memory checks: one process acts as rank ``r`` of ``N`` without allocating.

SIMULATION ONLY: training never imports this module. :func:`fake_world` starts torch's fake
process group (``FakeStore``: every collective returns at once, nothing is sent), enters
``FakeTensorMode`` (tensors carry shape, dtype and device but no data) and counts the bytes of
every tensor storage alive (:class:`LiveBytes`), so the project's own model building and
DeepSpeed's real engine run unchanged for a rank of a world of any size.

Running DeepSpeed on data-free tensors needs a few harness patches, applied only inside
:func:`fake_world` and undone on exit:

* a tensor's value read as a Python scalar (``.item()``, ``bool()``) answers a value that lets
  every step run: 1.0 for a float (gradient norms, Adam's step count, whose bias correction
  divides by ``1 - beta ** step``), 0 for an integer and ``False`` for a boolean (DeepSpeed's
  overflow flags and invalid-norm checks); the trainer's own non-finite step guard, which
  reads "all finite" and a float flag, is not installed;
* ``nn.Module._apply`` (``.to``, ``.bfloat16()``) on fake parameters assigns ``.data`` in place
  (torch swaps fake parameters, which fails on the weak references the fake mode keeps);
* ZeRO-3's checks that every rank holds the same parameters (an all-gathered value compared
  with this rank's) are skipped: a fake all-gather returns no values;
* the pipeline engine's receive of the first activation's metadata (shape and dtype sent by the
  previous stage) is answered locally with the shape the caller gives; under TP without
  sequence parallelism (DeepSpeed's ``pipe_partitioned``: a stage sends its TP rank's part of
  the activation and a metadata tensor of the whole one's shape and partition), the buffers of
  that pair, and the metadata read back (``PartitionedTensor.from_meta``, which a fake tensor
  answers with zeros) is the caller's shape split as DeepSpeed splits it;
* :func:`tapered_megatron.parallel.pipeline.agree_on_parts` (an object broadcast, which the
  fake group cannot carry) keeps this rank's own boundaries, which are rank 0's: every rank
  computes them from the same analytic costs;
* the cost model's device ``auto`` (what the trainer's pipeline balancer asks for: the device
  it runs on) is the simulated device, not this machine's CPU, whose peak would be measured
  on fake tensors;
* torch's Adam/AdamW takes the simulated device's path: its multi-tensor (foreach) one where
  :attr:`~tapered_megatron.planning.cost.Device.adam_temporaries` is 1 (the default on a GPU),
  not the single-tensor one torch picks for fake CPU tensors, whose temporaries differ;
* DeepSpeed's process-group registry (``deepspeed.utils.groups``: the ``mpu`` and groups an
  engine leaves there) is put back as it was, so that one process can simulate several worlds.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import PartitionedTensor, partition_uniform
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

from tapered_megatron import parallel

if TYPE_CHECKING:
    from tapered_megatron.planning.cost import Device


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, and their peak since :meth:`reset_peak`.

    Every storage an operation returns is counted once (keyed on the storage object, never on
    ``data_ptr()``, which a fake tensor lacks) until it is freed; storages on the ``meta`` device
    hold nothing and are not counted (enter it before anything to be counted is made). While
    :attr:`log` is a list, each new storage is also appended to it (as a weak reference with its
    size: :meth:`alive` sums those not freed). A tensor's value read as a Python scalar answers
    :func:`_scalar`'s value.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.log: list[tuple[weakref.ref, int]] | None = None
        self._seen: weakref.WeakKeyDictionary[torch.UntypedStorage, int] = (
            weakref.WeakKeyDictionary()
        )

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak = self.current

    def _add(self, t: torch.Tensor) -> None:
        if t.is_meta:
            return
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = st.nbytes()
        self._seen[st] = n
        weakref.finalize(st, self._free, n)
        if self.log is not None:
            self.log.append((weakref.ref(st), n))
        self.current += n
        self.peak = max(self.peak, self.current)

    @staticmethod
    def alive(log: list[tuple[weakref.ref, int]]) -> int:
        """Bytes of the storages in ``log`` not freed yet."""
        return sum(n for ref, n in log if ref() is not None)

    def _free(self, n: int) -> None:
        self.current -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return _scalar(args[0].dtype)
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add, out)
        return out


def _scalar(dtype: torch.dtype) -> float | int | bool:
    """The value a fake tensor of ``dtype`` answers when read as a Python scalar."""
    if dtype == torch.bool:
        return False
    return 1.0 if dtype.is_floating_point else 0


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = inspect.getattr_static(obj, name)  # a class's classmethod itself, not bound
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _registry_restored(module: Any) -> Iterator[None]:
    """``module``'s process-group registry (its ``mpu`` and its ``_UPPER_CASE`` globals, as
    ``deepspeed.utils.groups`` keeps them) as it was on entry: an engine built in the fake world
    leaves its groups there, and the next world must not find them."""
    names = ["mpu"] + [k for k in vars(module) if k.startswith("_") and k[1:2].isupper()]
    saved = {k: copy.copy(getattr(module, k)) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _apply_in_place(original: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module._apply`` that converts fake parameters and their gradients in place."""

    def _apply(self: nn.Module, fn: Callable[..., Any], recurse: bool = True) -> nn.Module:
        if not any(isinstance(p, FakeTensor) for p in self.parameters()):
            return original(self, fn, recurse)
        for m in self.modules() if recurse else (self,):
            with torch.no_grad():
                for p in m._parameters.values():
                    if p is not None:
                        p.data = fn(p)
                        if p.grad is not None:
                            p.grad.data = fn(p.grad)
                for key, b in m._buffers.items():
                    if b is not None:
                        m._buffers[key] = fn(b)
        return self

    return _apply


def _patches(received: tuple[int, ...], device: Device) -> list[contextlib.AbstractContextManager]:
    """The harness patches of the module docstring; ``received``: the shape of the activation
    a pipeline stage receives; ``device``: the simulated device."""
    from deepspeed.runtime.pipe import engine as pipe_engine
    from deepspeed.runtime.zero import partition_parameters, partitioned_param_coordinator, stage3
    from deepspeed.utils import groups
    from torch.optim import adam

    from tapered_megatron.parallel import pipeline
    from tapered_megatron.planning import cost
    from tapered_megatron.training import optim

    def recv_tensor_meta(engine: Any, send_stage: int) -> Any:
        dtype = engine.communication_data_type
        if not engine.is_pipe_partitioned:
            return engine._allocate_or_extend_buffers(0, list(received), dtype)
        meta = _partition_meta(received, engine.grid.get_slice_parallel_group())
        parts, rank = meta[1 + len(received) : 3 + len(received)]
        bounds = meta[-parts - 1 :]
        local = bounds[rank + 1] - bounds[rank]
        return (
            engine._allocate_or_extend_buffers(0, [len(meta)], torch.long),
            engine._allocate_or_extend_buffers(1, [local], dtype),
        )

    from_meta = PartitionedTensor.from_meta

    def partition_from_meta(cls: type, meta: Any, local_part: Any, group: Any, **kw: Any) -> Any:
        with _disable_current_modes():  # a real tensor: from_meta reads its values
            real = torch.tensor(_partition_meta(received, group), dtype=torch.long)
        return from_meta(real, local_part, group, **kw)

    def fused_or_foreach(params: Any, differentiable: bool, use_fused: bool = False) -> Any:
        return False, not differentiable and device.adam_temporaries == 1

    zero3 = (partition_parameters, partitioned_param_coordinator, stage3)
    return [
        _patched(nn.Module, "_apply", _apply_in_place(nn.Module._apply)),
        *(_patched(m, "assert_ints_same_as_other_ranks", lambda ints: None) for m in zero3),
        _patched(optim, "skip_nonfinite_steps", lambda engine: None),
        _patched(pipeline, "agree_on_parts", lambda parts, table: (parts, table)),
        _patched(pipe_engine.PipelineEngine, "_recv_tensor_meta", recv_tensor_meta),
        _patched(PartitionedTensor, "from_meta", classmethod(partition_from_meta)),
        _patched(adam, "_default_to_fused_or_foreach", fused_or_foreach),
        _patched(cost, "resolve_device", _resolving_auto_as(device, cost.resolve_device)),
        _registry_restored(groups),
    ]


def _partition_meta(shape: tuple[int, ...], group: Any) -> list[int]:
    """What DeepSpeed's ``PartitionedTensor.to_meta`` encodes for a tensor of ``shape`` split
    over ``group``: its dimensions, the parts, this rank, the parts' bounds (flat)."""
    parts, rank = dist.get_world_size(group), dist.get_rank(group)
    return [len(shape), *shape, parts, rank, *partition_uniform(math.prod(shape), parts)]


def _resolving_auto_as(device: Device, resolve: Callable[[str], Device]) -> Callable[..., Device]:
    """``cost.resolve_device`` answering ``device`` for ``auto``."""
    return lambda name="auto": device if name == "auto" else resolve(name)


@contextlib.contextmanager
def fake_world(
    world: int, rank: int, device: Device, received: tuple[int, ...] = ()
) -> Iterator[LiveBytes]:
    """Act as ``rank`` of a ``world``-rank job on ``device``s: fake process group, fake tensors,
    the harness patches; yields the byte counter (entered). Undone on exit. ``received``: the
    shape of the activation a pipeline stage receives from the previous one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    streams = dict(parallel.get_rng_tracker().states)  # real tensors; the world's are fake
    os.environ.update(env)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    deepspeed.init_distributed("fake")  # DeepSpeed's communication on the fake group
    counter = LiveBytes()
    try:
        with contextlib.ExitStack() as stack:
            for p in _patches(received, device):
                stack.enter_context(p)
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(counter)
            yield counter
    finally:
        dist.destroy_process_group()
        parallel.destroy_model_parallel()  # the fake world's groups and RNG streams end with it
        parallel.get_rng_tracker().states = streams
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
