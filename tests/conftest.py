"""Shared pytest setup: tests import helpers from this folder and run single-threaded ranks.

The suite is pinned to DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, inherited by every
rank and subprocess the tests launch), so it runs the same gloo/fp32 paths on a GPU machine.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["DS_ACCELERATOR"] = "cpu"
