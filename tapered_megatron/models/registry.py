"""The architecture registry with the built-in architectures in it.

Look architectures up through this module (or :mod:`tapered_megatron.models`, which re-exports
it): it imports the built-in architecture files, each of which registers its records with
:func:`~tapered_megatron.models.base.register_architecture`, so the registry is complete
whoever imports it first. Architectures from other files come in through :func:`load_plugins`.
"""

from tapered_megatron.models import attention, hope, titans  # noqa: F401 - they register themselves
from tapered_megatron.models.base import (
    ARCHITECTURES,
    ArchitectureError,
    load_plugins,
    register_architecture,
    resolve_architecture,
)

__all__ = [
    "ARCHITECTURES",
    "ArchitectureError",
    "load_plugins",
    "register_architecture",
    "resolve_architecture",
]
