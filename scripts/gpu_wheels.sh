#!/usr/bin/env bash
# Wheels that the GPU check machine (Python 3.12, x86-64, torch/transformers/mpi4py preinstalled,
# no network) lacks for this repo: DeepSpeed (built here as a pure-Python wheel, ops compiled
# just in time there), its pydantic/hjson needs, and tensorboardX. Writes them to .whl/, which
# .git/info/exclude keeps out of git; scripts/gpu_check.sh installs them from there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps deepspeed==0.19.8 -w .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    hjson pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    'typing-extensions>=4.16' tensorboardX
ls .whl
