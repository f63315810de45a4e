"""Architectures as records (:class:`Architecture`): the registry and the built-in records.

Importing this package registers the built-in architectures (``transformer``,
``gated_attention``, ``titans``, ``hope_attention``); it imports no model code and no torch, so
the configuration can read and check any architecture's settings. Each record names the
modules that build it (in :mod:`tapered_megatron.models`), imported only when a model is built.
"""

# the registration order is the paper's (the experiments' tables follow it)
# isort: off
from tapered_megatron.architectures import attention, titans, hope  # noqa: F401 - they register

# isort: on
from tapered_megatron.architectures.record import (
    ARCHITECTURES,
    Architecture,
    ArchitectureError,
    load_name,
    load_plugins,
    register_architecture,
    resolve_architecture,
)

#: The built-in architectures, in the registry's order (the paper's).
BUILT_IN: tuple[str, ...] = tuple(ARCHITECTURES)

__all__ = [
    "ARCHITECTURES",
    "BUILT_IN",
    "Architecture",
    "ArchitectureError",
    "load_name",
    "load_plugins",
    "register_architecture",
    "resolve_architecture",
]
