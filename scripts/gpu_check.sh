#!/usr/bin/env bash
# Issue 3's GPU checks in one short run on one H100/H200-class GPU (bounded at about 8 minutes):
#   1. ours vs Hugging Face LlamaForCausalLM at the issue's shape in bf16 autocast, eager and
#      torch.compile: scripts/bench_model.py --device accelerator --dtype bf16 --compile;
#   2. training-step MFU of the tapered 440M and 760M presets (bf16 autocast, micro-batch
#      8 x 4096 tokens), eager, then compiled: scripts/bench_preset_mfu.py.
# Each stage has its own time limit and writes as it goes, so a cut-short run still returns what
# finished. JSON lines go to stdout and to $OUT (default ./gpu_check_out). The device machine has
# no network: run scripts/gpu_wheels.sh here first and carry .whl, e.g.
#   device run: command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 540
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

stage() {  # stage NAME SECONDS COMMAND...: log to $out/NAME.log, JSON lines to $out/NAME.json
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.log" | grep '^{' >> "$out/$name.json"
}
stage bench_model 200 python3 scripts/bench_model.py --device accelerator --dtype bf16 \
    --compile --rounds 10
stage bench_preset_mfu 100 python3 scripts/bench_preset_mfu.py --dtype bf16 --micro-batch 8
stage bench_preset_mfu 180 python3 scripts/bench_preset_mfu.py --dtype bf16 --micro-batch 8 \
    --compile
cat "$out"/*.json
