"""Run a script as if the ``wandb`` package were not installed (test helper).

Tests start ``python tests/without_wandb.py pretrain/main.py ARGS``: ``import wandb`` raises
``ImportError`` in that process, as it does where the optional extra is missing.
"""

import runpy
import sys

sys.modules["wandb"] = None  # type: ignore[assignment]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
