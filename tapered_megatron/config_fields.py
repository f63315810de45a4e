"""What config dataclasses are written with: :class:`ConfigError` and :func:`at_least`
(and :func:`first_line`, the cause quoted in a one-line error).

A leaf module (no package imports), so the architecture files, whose options dataclasses use
both, do not import the config loader that looks those architectures up. Both are re-exported
by :mod:`tapered_megatron.config`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key and how to fix it."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none), the cause
    quoted in a one-line error."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def at_least(low: float, default: Any, below: float | None = None) -> Any:
    """A dataclass field whose value (each element, for a tuple) must be ``>= low`` (and
    ``< below`` when given); checked when the config is parsed, with the key named in the
    error."""
    return field(default=default, metadata={"min": low, "below": below})
