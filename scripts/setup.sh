#!/usr/bin/env bash
# Install tapered-megatron and its dependencies into the current Python environment.
# On CPU-only machines a CPU torch build is installed first when one is available locally, so the
# torch range in setup.py is met without pulling a CUDA build; GPU clusters keep their own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  pip install "torch==2.13.0" || pip install torch
fi
pip install -e ".[dev]"
ruff check .
