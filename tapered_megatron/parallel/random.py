"""Random-number helpers: layout-invariant parameter seeds and per-rank RNG streams.

* :func:`param_generator` gives the CPU generator that initialises ONE parameter. Its seed is a
  hash of the run seed and the parameter's canonical name (``layers.3.mlp.w13.weight``), so the
  full weight is the same whatever the TP/PP/DP layout and whichever module form (``build_model``
  or the pipeline LayerSpecs) creates it.
* :func:`model_parallel_seed` seeds the default generators for everything else, the CPU's and
  the accelerator's alike (the TP ranks of a stage see the same stream, so replicated regions
  such as the dropout on each block's output draw the same mask on every TP rank; TP ranks get a
  separate named stream for TP-local randomness such as dropout inside a split region, Megatron's
  habit: the block's dropout under sequence parallelism).
* :class:`RNGStatesTracker` keeps named streams (a CPU and an accelerator generator state each);
  ``with get_rng_tracker().fork():`` runs a block under the TP-local stream on both generators
  and restores the default ones afterwards.
* :func:`recompute` recomputes a function's activations in backward (activation
  recomputation); the recomputation draws the same random numbers as the forward, from the
  default streams and the tracker's alike.

The accelerator is DeepSpeed's (``get_accelerator()``); on its CPU accelerator the accelerator
generator is the CPU one, kept once.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.checkpoint
from deepspeed.accelerator import get_accelerator

from tapered_megatron.parallel.topology import (
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
)

TP_RNG_NAME = "tensor-model-parallel-rng"


def param_seed(seed: int, key: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's canonical name."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def param_generator(seed: int, key: str) -> torch.Generator:
    """A fresh CPU generator for the parameter named ``key``."""
    return torch.Generator(device="cpu").manual_seed(param_seed(seed, key))


def _accelerator() -> Any | None:
    """DeepSpeed's accelerator where its generator is not the CPU's (on the CPU accelerator,
    ``get_rng_state``/``manual_seed`` are the CPU generator's: ``None``)."""
    acc = get_accelerator()
    return None if acc.device_name() == "cpu" else acc


def _capture() -> dict[str, torch.Tensor]:
    """The CPU generator's state and, where separate, the accelerator's (current device)."""
    state = {"cpu": torch.get_rng_state()}
    acc = _accelerator()
    if acc is not None:
        state["accelerator"] = acc.get_rng_state()
    return state


def _restore(state: dict[str, torch.Tensor]) -> None:
    """Install a state from :func:`_capture` (an entry it lacks leaves that generator as is)."""
    torch.set_rng_state(state["cpu"])
    acc = _accelerator()
    if acc is not None and "accelerator" in state:
        acc.set_rng_state(state["accelerator"])


def _seed(seed: int) -> None:
    """Seed the CPU generator and, where separate, the accelerator's (current device)."""
    torch.default_generator.manual_seed(seed)
    acc = _accelerator()
    if acc is not None:
        acc.manual_seed(seed)


class RNGStatesTracker:
    """Named streams, each a CPU and (where separate) an accelerator generator state, swapped in
    with :meth:`fork`."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, seed: int) -> None:
        """Register a stream ``name`` seeded with ``seed`` (default streams left untouched)."""
        saved = _capture()
        _seed(seed)
        self.states[name] = _capture()
        _restore(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG_NAME) -> Iterator[None]:
        """Run the block under stream ``name`` on the CPU and the accelerator; its advanced
        state is kept for next time and the default streams are restored afterwards."""
        saved = _capture()
        _restore(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _capture()
            _restore(saved)

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copy of all streams (for checkpoints)."""
        return {k: {g: t.clone() for g, t in v.items()} for k, v in self.states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor] | torch.Tensor]) -> None:
        """Restore streams saved by :meth:`get_states`. A stream saved as a bare CPU state, or
        without an accelerator entry, keeps the accelerator state it was seeded with."""
        for k, v in states.items():
            saved = {"cpu": v} if isinstance(v, torch.Tensor) else v
            self.states[k] = {**self.states.get(k, {}), **{g: t.clone() for g, t in saved.items()}}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker."""
    return _TRACKER


def recompute(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` whose saved activations are dropped after the forward and recomputed in
    backward (torch's non-reentrant checkpoint). The recomputation replays the random numbers
    of the forward: the default CPU and accelerator streams (torch's own stash) and the
    tracker's named streams (Megatron's ``CheckpointFunction`` habit), so dropout inside ``fn``,
    under :meth:`RNGStatesTracker.fork` or not, draws the same masks twice."""
    before = _TRACKER.get_states()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        after = _TRACKER.get_states()
        _TRACKER.set_states(before)
        try:
            yield
        finally:
            _TRACKER.set_states(after)

    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), replay())
    )


def model_parallel_seed(seed: int) -> None:
    """Seed python, numpy and torch for this rank and register the TP-local stream.

    The default stream differs per pipeline stage (stages hold different layers) and is shared
    by the TP ranks of a stage; the TP stream differs per TP rank.
    """
    default = seed + 100 * get_pipeline_model_parallel_rank()
    random.seed(default)
    np.random.seed(default % (1 << 32))
    torch.manual_seed(default)  # the CPU and every device generator torch itself knows
    _seed(default)  # the accelerator's, also where torch.manual_seed does not reach it
    _TRACKER.states.clear()
    _TRACKER.add(TP_RNG_NAME, default + 2718 + get_tensor_model_parallel_rank())


def get_rng_state() -> dict[str, Any]:
    """Every RNG state of this process for a checkpoint: python, numpy, torch (CPU), the
    accelerator's where it has its own generator, and the tracker's streams; tensors and plain
    types only (numpy's key as a list of ints), so it loads with ``weights_only=True``."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "tracker": _TRACKER.get_states(),
    }
    acc = _accelerator()
    if acc is not None:
        state["accelerator"] = acc.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state returned by :func:`get_rng_state`. One saved without an accelerator
    entry (on a CPU, or by an older version) leaves the accelerator's streams as seeded."""
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    default = {"cpu": state["torch"]}
    if "accelerator" in state:
        default["accelerator"] = state["accelerator"]
    _restore(default)
    _TRACKER.set_states(state["tracker"])
