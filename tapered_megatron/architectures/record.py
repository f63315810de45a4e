"""The architecture record and the registry: everything about one architecture, as plain data.

A record is torch-free: the configuration reads it (the options' schema, their key, the checks
that need the whole config) without importing any model code. Its modules are named, not
imported (``"package.module:Name"``); :func:`tapered_megatron.models.registry.blocks` imports
them when a model is built. :data:`ARCHITECTURES` is the only list of architectures
(``model.arch`` accepts exactly its keys); the built-in records register themselves when
:mod:`tapered_megatron.architectures` is imported, others come in through :func:`load_plugins`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tapered_megatron.config import Config

SWIGLU = "tapered_megatron.models.mlp:SwiGLU"


def _no_first_pass(cfg: Config) -> Config | None:
    return None


def _arch_name(cfg: Config) -> str:
    return cfg.model.arch


@dataclass(frozen=True)
class Architecture:
    """Everything about one architecture.

    Attributes:
        name: the ``model.arch`` value.
        mixer: ``"module:Class"`` of the token mixer (a ``TokenMixer`` subclass).
        mlp: ``"module:Class"`` of the MLP slot (an ``MLPSlot`` subclass); default SwiGLU.
        options: frozen dataclass of the architecture's own settings, or ``None``.
        section: where those settings sit under ``model``: ``model.<section>.<field>``; ``""``
            puts the fields directly in ``model`` (``model.gate``); ``None`` means ``name``.
        validate: ``validate(cfg)`` for checks that need the whole config; raises
            :class:`tapered_megatron.config.ConfigError` naming the key and the fix.
        mixer_efficiency: the mixer's achieved fraction of attention's efficiency on the same
            device (the pipeline cost model scales its mixer time by it).
        compiles: whether ``train.compile`` (``torch.compile``) is supported.
        first_pass: ``"module:function"``, ``first_pass(model, input_ids)`` run by
            ``LanguageModel.forward`` before its pass (Hope's teach signal); ``None``: none.
        first_pass_config: ``first_pass_config(cfg)``, a config whose model's forward costs
            what ``first_pass`` adds to every training step under ``cfg`` (one forward
            without backward), or ``None`` where it adds nothing (the default: always
            ``None``); the FLOP counts and the pipeline cost model add that forward.
        kv_cache: whether generation keeps a key/value cache (the mixer is an ``Attention``
            and nothing else in the block depends on earlier positions); otherwise it
            recomputes the whole prefix at each step.
        in_context: whether weights learn inside the sequence (a memory architecture: the
            experiments' memory probe covers it).
        describe: ``describe(cfg)``, the architecture as an export's model card names it
            (``titans (variant mag)``); default: the name.
        presets: per scale (a file ``scales/<scale>.yaml`` of the presets), the config layer
            (``{"model": {...}, "train": {...}}``) over that scale that makes the preset
            ``<name>_<scale>``; a scale it does not list takes the scale as it is.
    """

    name: str
    mixer: str
    mlp: str = SWIGLU
    options: type | None = None
    section: str | None = None
    validate: Callable[[Config], None] | None = None
    mixer_efficiency: float = 1.0
    compiles: bool = False
    first_pass: str | None = None
    first_pass_config: Callable[[Config], Config | None] = _no_first_pass
    kv_cache: bool = False
    in_context: bool = False
    describe: Callable[[Config], str] = _arch_name
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)

    @property
    def options_key(self) -> str | None:
        """The ``model`` key of the options (``""``: flat in ``model``; ``None``: no options)."""
        if self.options is None:
            return None
        return self.name if self.section is None else self.section

    def option_names(self) -> tuple[str, ...]:
        """The keys this architecture owns inside ``model``: its section, or its flat fields."""
        key = self.options_key
        if key is None:
            return ()
        return tuple(f.name for f in fields(self.options)) if key == "" else (key,)


#: The registry: ``model.arch`` -> record.
ARCHITECTURES: dict[str, Architecture] = {}


class ArchitectureError(RuntimeError):
    """An architecture that cannot be found (unknown name or a plugin that does not load)."""


def register_architecture(arch: Architecture) -> Architecture:
    """Add (or replace) ``arch`` in the registry; returns it."""
    for what in ("mixer", "mlp", "first_pass"):
        name = getattr(arch, what)
        if name is not None and (not isinstance(name, str) or ":" not in name):
            raise TypeError(f"architecture {arch.name!r}: {what} must be 'module:Name'")
    if arch.options is not None and not is_dataclass(arch.options):
        raise TypeError(f"architecture {arch.name!r}: options must be a dataclass")
    ARCHITECTURES[arch.name] = arch
    return arch


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


def load_name(ref: str) -> Any:
    """The object a record names as ``"module:Name"`` (its module imported)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_plugins(plugins: tuple[str, ...] | list[str]) -> None:
    """Import each plugin: a module path (``my_pkg.my_arch``), a package folder or a ``.py``
    file path.

    Importing a plugin registers its architectures. A file or folder is imported as a top-level
    module named after it, its parent folder put on ``sys.path`` (so spawned worker processes,
    which inherit ``sys.path``, can import it again to unpickle configs).
    """
    for plugin in plugins:
        path = Path(plugin)
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").is_file()):
            module = _path_module(plugin, path)
            if module is None:
                continue
        else:
            module = plugin
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ArchitectureError(
                f"model.plugins: no module named {module!r}; give an importable module, a "
                "package folder or a .py file path"
            ) from None


def _path_module(plugin: str, path: Path) -> str | None:
    """The module name a plugin file or folder imports as (its parent folder put on
    ``sys.path``); ``None`` when it is imported already."""
    if not path.exists():
        raise ArchitectureError(
            f"model.plugins: file {plugin} does not exist; give a .py path, a package folder "
            "or a module"
        )
    folder, name = str(path.resolve().parent), path.stem
    known = sys.modules.get(name)
    if known is not None:
        where = Path(getattr(known, "__file__", "") or "").resolve()
        if path.resolve() not in (where, where.parent):
            raise ArchitectureError(
                f"model.plugins: {plugin} would import as module {name!r}, which is already "
                f"{known.__file__}; rename the file"
            )
        return None
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return name
