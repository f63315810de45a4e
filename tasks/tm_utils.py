"""Loader for the local tasks: reads ``data/<file>`` beside this file (no download, any cwd)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def load_local(file: str, **_: Any):
    """A ``DatasetDict`` with one ``test`` split read from ``data/<file>`` (JSON lines)."""
    import datasets

    rows = [json.loads(line) for line in (DATA / file).read_text(encoding="utf-8").splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
