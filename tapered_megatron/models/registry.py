"""The modules of an architecture: :func:`blocks` imports what its record names.

A record (:class:`tapered_megatron.architectures.Architecture`) names its token mixer, MLP slot
and first pass as ``"module:Name"``; the model, the counters and the cost model ask
:func:`blocks` for the classes, imported once per record and checked against the protocol of
:mod:`tapered_megatron.models.base`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tapered_megatron.architectures import Architecture, load_name, resolve_architecture
from tapered_megatron.models.base import MLPSlot, TokenMixer


@dataclass(frozen=True)
class Blocks:
    """The imported modules of one architecture."""

    mixer: type[TokenMixer]
    mlp: type[MLPSlot]
    first_pass: Callable[[nn.Module, torch.Tensor], None] | None


def blocks(arch: Architecture | str) -> Blocks:
    """The modules of ``arch`` (a record or a ``model.arch`` name), imported on first use."""
    return _blocks(resolve_architecture(arch) if isinstance(arch, str) else arch)


@functools.cache
def _blocks(arch: Architecture) -> Blocks:
    mixer, mlp = load_name(arch.mixer), load_name(arch.mlp)
    if not (isinstance(mixer, type) and issubclass(mixer, TokenMixer)):
        raise TypeError(f"architecture {arch.name!r}: mixer {arch.mixer} is not a TokenMixer")
    if not (isinstance(mlp, type) and issubclass(mlp, MLPSlot)):
        raise TypeError(f"architecture {arch.name!r}: mlp {arch.mlp} is not an MLPSlot")
    first = load_name(arch.first_pass) if arch.first_pass else None
    return Blocks(mixer, mlp, first)
