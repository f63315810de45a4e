"""Shared pytest setup: tests import helpers from this folder and run single-threaded ranks;
fixtures more than one test module uses.

The suite is pinned to DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, inherited by every
rank and subprocess the tests launch), so it runs the same gloo/fp32 paths on a GPU machine.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["DS_ACCELERATOR"] = "cpu"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small learnable token corpus (arithmetic runs) as a Megatron .bin/.idx pair."""
    from tapered_megatron.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = []
    for _ in range(300):
        start, step, n = rng.integers(0, 255), rng.integers(1, 4), rng.integers(12, 48)
        docs.append([*((start + step * np.arange(n)) % 255).tolist(), 255])
    prefix = str(tmp_path_factory.mktemp("corpus") / "tiny_text_document")
    write_indexed_dataset(prefix, docs)
    return prefix
