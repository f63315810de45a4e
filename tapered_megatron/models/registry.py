"""Looking architectures up: the registry with the built-in architectures in it.

This module imports the built-in architecture files, each of which adds its records to
:data:`~tapered_megatron.models.base.ARCHITECTURES` with
:func:`~tapered_megatron.models.base.register_architecture`, so a lookup here always sees them,
whoever imports it first. Architectures from other files come in through :func:`load_plugins`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tapered_megatron.models import attention, hope, titans  # noqa: F401 - they register themselves
from tapered_megatron.models.base import ARCHITECTURES, Architecture


class ArchitectureError(RuntimeError):
    """An architecture that cannot be found (unknown name or a plugin that does not load)."""


def resolve_architecture(name: str) -> Architecture:
    """The registered record of ``name``."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ArchitectureError(
            f"model.arch: unknown architecture {name!r}; registered: {known} (architectures "
            "from other files are added with model.plugins)"
        ) from None


def load_plugins(plugins: tuple[str, ...] | list[str]) -> None:
    """Import each plugin: a module path (``my_pkg.my_arch``) or a ``.py`` file path.

    Importing a plugin registers its architectures. A file is imported as a top-level module
    named after the file, its folder put on ``sys.path`` (so spawned worker processes, which
    inherit ``sys.path``, can import it again to unpickle configs).
    """
    for plugin in plugins:
        path = Path(plugin)
        if path.suffix == ".py":
            if not path.is_file():
                raise ArchitectureError(
                    f"model.plugins: file {plugin} does not exist; give a .py path or a module"
                )
            folder, name = str(path.resolve().parent), path.stem
            known = sys.modules.get(name)
            if known is not None:
                if Path(getattr(known, "__file__", "") or "").resolve() != path.resolve():
                    raise ArchitectureError(
                        f"model.plugins: {plugin} would import as module {name!r}, which is "
                        f"already {known.__file__}; rename the file"
                    )
                continue
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module = name
        else:
            module = plugin
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ArchitectureError(
                f"model.plugins: no module named {module!r}; give an importable module or a "
                ".py file path"
            ) from None
