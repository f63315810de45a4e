"""Bounded parsing of the configuration files read from received directories (a checkpoint's
``config.yaml``, ``layout.json``, ``taper_plan.json``; an export's ``config.json`` and weight
index), so a file someone sent cannot exhaust memory or the interpreter's stack: a size limit,
a nesting-depth limit and, for YAML, a limit on the nodes after alias expansion (a "billion
laughs" file). YAML is read with the safe loader only. No torch, no process group.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 4 << 20  # a configuration file larger than this is refused unread
MAX_DEPTH = 32  # nested mappings and lists (ours nest 4 deep)
MAX_NODES = 200_000  # scalars, mappings and lists once every YAML alias is expanded
MAX_FLOW_BRACKETS = 256  # unmatched [ and { (strings included) checked before parsing
_BRACKETS = re.compile(r"[\[\]{}]")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: the same rules


class ReceivedFileError(ValueError):
    """A received configuration file that is too large, too deep or not parseable; the
    message names the file and the limit in one line."""


def read_text(path: Path) -> str:
    """The text of ``path``, refused beyond :data:`MAX_BYTES` or when not UTF-8."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ReceivedFileError(f"{path}: {size:,} bytes, over {MAX_BYTES:,} for a config file")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ReceivedFileError(f"{path}: not UTF-8 text") from None


def _bracket_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in ``text`` (quotes not considered: an upper
    bound on YAML's flow nesting)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        depth = depth + 1 if m.group() in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _measure(node: yaml.Node, depth: int, seen: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """``(nodes, height)`` of a composed YAML node with its aliases expanded (each distinct node
    measured once); raises at :data:`MAX_DEPTH` (a recursive alias reaches it too)."""
    if id(node) in seen:
        nodes, height = seen[id(node)]
        if depth + height > MAX_DEPTH:
            raise ReceivedFileError(f"nested deeper than {MAX_DEPTH} levels")
        return nodes, height
    if depth > MAX_DEPTH:
        raise ReceivedFileError(f"nested deeper than {MAX_DEPTH} levels")
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    nodes, height = 1, 0
    for child in children:
        n, h = _measure(child, depth + 1, seen)
        nodes, height = nodes + n, max(height, h + 1)
        if nodes > MAX_NODES:
            raise ReceivedFileError(f"more than {MAX_NODES:,} values once aliases are expanded")
    seen[id(node)] = (nodes, height)
    return nodes, height


def load_yaml(path: Path) -> Any:
    """``yaml.safe_load`` of ``path`` within :data:`MAX_BYTES`, :data:`MAX_DEPTH` and
    :data:`MAX_NODES`; :class:`ReceivedFileError` (one line naming the file) otherwise."""
    text = read_text(path)
    if _bracket_depth(text) > MAX_FLOW_BRACKETS:  # PyYAML's scanner is quadratic in this
        raise ReceivedFileError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    try:
        node = yaml.compose(text, Loader=_LOADER)
        if node is None:
            return None
        _measure(node, 0, {})
        return yaml.SafeLoader("").construct_document(node)
    except RecursionError:
        raise ReceivedFileError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    except ReceivedFileError as e:
        raise ReceivedFileError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReceivedFileError(f"{path}: not valid YAML ({why})") from None


def _depth(value: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ReceivedFileError(f"nested deeper than {MAX_DEPTH} levels")
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        _depth(item, depth + 1)


def load_json(path: Path) -> Any:
    """``json.loads`` of ``path`` within :data:`MAX_BYTES` and :data:`MAX_DEPTH`;
    :class:`ReceivedFileError` (one line naming the file) otherwise."""
    text = read_text(path)
    try:
        value = json.loads(text)
        _depth(value)
    except RecursionError:
        raise ReceivedFileError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    except ReceivedFileError as e:
        raise ReceivedFileError(f"{path}: {e}") from None
    except ValueError as e:
        raise ReceivedFileError(f"{path}: not valid JSON ({e})") from None
    return value
