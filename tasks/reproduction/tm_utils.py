"""The loader of the local tasks (``tasks/tm_utils.py``, one folder up) for the task definitions
in this folder: the harness resolves ``!function`` beside the YAML, so this re-exports it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tm_utils_local_tasks", Path(__file__).resolve().parents[1] / "tm_utils.py"
)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
load_local = _module.load_local
