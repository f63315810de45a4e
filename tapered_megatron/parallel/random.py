"""Random-number helpers: layout-invariant parameter seeds and per-rank RNG streams.

* :func:`param_generator` gives the CPU generator that initialises ONE parameter. Its seed is a
  hash of the run seed and the parameter's canonical name (``layers.3.mlp.w13.weight``), so the
  full weight is the same whatever the TP/PP/DP layout and whichever module form (``build_model``
  or the pipeline LayerSpecs) creates it.
* :func:`model_parallel_seed` seeds the default generators for everything else (data-parallel
  replicas see the same stream; TP ranks get a separate named stream for TP-local randomness such
  as dropout inside a split region, Megatron's habit).
* :class:`RNGStatesTracker` keeps named generator states; ``with get_rng_tracker().fork():`` runs
  a block under the TP-local stream and restores the default one afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator

import numpy as np
import torch

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


class RNGStatesTracker:
    """Named torch RNG states that can be swapped in with :meth:`fork`."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Register a stream ``name`` seeded with ``seed`` (default stream left untouched)."""
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG_NAME) -> Iterator[None]:
        """Run the block under stream ``name``; its advanced state is kept for next time."""
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copy of all streams (for checkpoints)."""
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore streams saved by :meth:`get_states`."""
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker."""
    return _TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed python, numpy and torch for this rank and register the TP-local stream.

    The default stream differs per pipeline stage (stages hold different layers) and is shared
    by the TP ranks of a stage; the TP stream differs per TP rank.
    """
    default = seed + 100 * get_pipeline_model_parallel_rank()
    random.seed(default)
    np.random.seed(default % (1 << 32))
    torch.manual_seed(default)
    _TRACKER.states.clear()
    _TRACKER.add(TP_RNG_NAME, default + 2718 + get_tensor_model_parallel_rank())


def get_rng_state() -> dict:
    """Every RNG state of this process (python, numpy, torch, tracker) for a checkpoint."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": _TRACKER.get_states(),
    }


def set_rng_state(state: dict) -> None:
    """Restore a state returned by :func:`get_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    _TRACKER.set_states(state["tracker"])
