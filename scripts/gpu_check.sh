#!/usr/bin/env bash
# The GPU check: one bounded run (stage limits sum to 480 s) on one H100/H200-class GPU.
#   quickstart           the README's quickstart through `deepspeed pretrain/main.py` in bf16:
#                        train with saves, `--resume auto`, export, generate
#   arch_<name>          20 bf16 steps of each architecture at the 440M preset's widths (2
#                        layers), ZeRO-1 (ds_configs/zero1.json)
#   sdpa_kernels         the SDPA kernel the transformer and Titans' window attention run
#                        (flash / efficient, not math): scripts/gpu_sdpa_kernels.py
#   mfu_<preset>_<mode>  training-step MFU of the tapered 440M and 760M presets, eager and
#                        torch.compile, bf16 autocast: scripts/bench_preset_mfu.py
#   vs_llama             ours vs Hugging Face LlamaForCausalLM at equal shape, bf16 autocast:
#                        scripts/bench_model.py
#   memory_vs_plan       peak GPU memory of the 440M preset under ZeRO-1 beside the planner's
#                        prediction for that layout: scripts/gpu_memory_vs_plan.py
#   rng_streams          the RNG streams on the accelerator's generators:
#                        scripts/check_rng_streams.py
# Goals on the GPU: the 440M preset's bf16 MFU >= 45 % (Megatron-LM reports 41-47 % at
# comparable sizes on H100); ours >= 1.0x LlamaForCausalLM's tokens per second.
#
# Each stage runs under its own `timeout` and writes as it goes: its JSON lines to
# $OUT/<stage>.json (the last one {"stage": ..., "rc": ..., "seconds": ...}, rc 124 when the
# limit cut it), logs beside them, one summary line per stage to $OUT/stages.jsonl and stdout.
# $OUT defaults to ./gpu_check_out; checkpoints and exports go to $GPU_CHECK_WORK (default: a
# new /tmp/gpu_check.XXXXXX), outside $OUT. The compiled MFU stages run last. The device machine has no network: run
# scripts/gpu_wheels.sh here first and carry .whl, e.g.
#   device run: command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 560
# `--dry-run` (or GPU_CHECK_DRY=1) runs every stage on this machine's CPU (DeepSpeed's CPU
# accelerator) with tiny shapes and explicit bf16 ds_configs, each within its dry-run limit, so
# the first GPU run does not fail on a typo; nvidia-smi and the wheels are skipped there.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/.."
dry="${GPU_CHECK_DRY:-0}"
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-gpu_check_out}"
work="${GPU_CHECK_WORK:-}"
ds0="$work/default.json" ds1="$work/zero1.json" # bf16 copies of the shipped ds_configs

if [ "$dry" = 1 ]; then # tiny shapes, a few steps
    tiny=(--model.d_model 64 --model.heads 2 --model.d_ff 128 --model.seq_len 64
        --taper.multiple 16 --model.vocab_size 8192)
    qs_train=(--train.iters 4 --train.save_interval 2 --eval.interval 2 --eval.iters 1
        --logging.interval 2)
    qs_resume=(--train.iters 6 --eval.interval 2 --eval.iters 1 --logging.interval 2)
    arch_steps=2
    titans=(--model.titans.window 16 --model.titans.chunk_size 8)
    mfu=(--micro-batch 1 --steps 1 --peak-n 256 "${tiny[@]}" --model.layers 2)
    llama=(--rounds 1 --threads 1 --no-floor)
    memory=(--steps 1 "${tiny[@]}" --model.layers 2)
    sdpa=(--window 16 "${tiny[@]}")
else
    tiny=()
    qs_train=(--train.save_interval 50)
    qs_resume=(--train.iters 110)
    arch_steps=20
    titans=()
    mfu=(--micro-batch 8 --steps 5)
    llama=(--device accelerator --rounds 10)
    memory=(--steps 3)
    sdpa=()
fi

run_step() { # run_step STAGE STEP COMMAND...: the command's output to a log, one JSON line out
    local stage=$1 step=$2 rc start=$SECONDS
    shift 2
    local log="$out/$stage.$step.log"
    "$@" > "$log" 2>&1
    rc=$?
    python3 - "$stage" "$step" "$rc" "$((SECONDS - start))" "$log" << 'EOF'
import json, sys
stage, step, rc, seconds, log = sys.argv[1:]
lines = [x.strip() for x in open(log, errors="replace") if x.strip()]
iters = [x for x in lines if x.startswith("iter ")]
line = {"stage": stage, "step": step, "rc": int(rc), "seconds": int(seconds)}
line["last_iter"] = iters[-1] if iters else None
line["resumed"] = next((x for x in lines if x.startswith("resumed from")), None)
line["tail"] = lines[-1][-300:] if lines else ""
print(json.dumps(line))
EOF
    return "$rc"
}

deepspeed_1() { # the deepspeed launcher on one device, at a free rendezvous port
    local port
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')"
    deepspeed --num_gpus 1 --master_port "$port" "$@"
}

quickstart() { # the README's command in bf16 with saves, then resume, export, generate
    local ckpt="$work/quickstart" launch=(deepspeed_1 pretrain/main.py)
    run_step quickstart train "${launch[@]}" --ds_config "$ds0" "${qs_train[@]}" \
        --train.save_dir "$ckpt" &&
        run_step quickstart resume "${launch[@]}" --ds_config "$ds0" "${qs_resume[@]}" \
            --train.save_dir "$ckpt" --resume auto &&
        run_step quickstart export python3 -m tapered_megatron.export --checkpoint "$ckpt" \
            --out "$work/quickstart_export" &&
        run_step quickstart generate python3 -m tapered_megatron.generate \
            --model "$work/quickstart_export" --prompt "To be" --max-new-tokens 16 --temperature 0
}

arch() { # arch NAME: bf16 steps at the 440M preset's widths, 2 layers, ZeRO-1
    local name=$1 extra=()
    [ "$name" = titans ] && extra=("${titans[@]}")
    run_step "arch_$name" train deepspeed_1 pretrain/main.py --ds_config "$ds1" \
        --config "${name}_440m" --model.layers 2 "${tiny[@]}" "${extra[@]}" \
        --train.iters "$arch_steps" --train.global_batch_size 2 --train.warmup_iters 2 \
        --eval.interval 0 --logging.interval "$((arch_steps / 2))" \
        --train.universal_checkpoint false --train.save_dir "$work/arch_$name"
}

if [ "${1:-}" = "--run" ]; then # one multi-step stage: its parent's `timeout` runs this again
    shift
    "$@"
    exit
fi

[ -n "$work" ] || work="$(mktemp -d /tmp/gpu_check.XXXXXX)"
ds0="$work/default.json" ds1="$work/zero1.json"
mkdir -p "$out" "$work"
out="$(cd "$out" && pwd)"
export OUT="$out" GPU_CHECK_WORK="$work" GPU_CHECK_DRY="$dry" PYTHONUNBUFFERED=1
if [ "$dry" != 1 ] && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
if [ "$dry" = 1 ]; then
    export DS_ACCELERATOR=cpu
elif command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
# explicit bf16 on a CPU ("auto" is fp32 there); as shipped on a GPU ("auto" is bf16 there)
for name in default zero1; do
    python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
if sys.argv[3] == "1":
    d.setdefault("bf16", {})["enabled"] = True
json.dump(d, open(sys.argv[2], "w"), indent=2)' "ds_configs/$name.json" "$work/$name.json" "$dry"
done

stage() { # stage NAME GPU_LIMIT DRY_LIMIT COMMAND...: under its limit, JSON lines as they come
    local name=$1 limit=$2 start=$SECONDS rc
    [ "$dry" = 1 ] && limit=$3
    shift 3
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$out/$name.log" | grep --line-buffered '^{' \
        >> "$out/$name.json"
    rc=${PIPESTATUS[0]}
    local line="{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), "
    line+="\"limit_s\": $limit, \"dry_run\": $([ "$dry" = 1 ] && echo true || echo false)}"
    echo "$line" | tee -a "$out/$name.json" >> "$out/stages.jsonl"
    echo "$line"
}

# the GPU limits sum to 480 s
stage quickstart 80 240 bash "$self" --run quickstart
stage arch_transformer 20 120 bash "$self" --run arch transformer
stage arch_gated_attention 20 120 bash "$self" --run arch gated_attention
stage arch_hope_attention 25 120 bash "$self" --run arch hope_attention
stage arch_titans 25 120 bash "$self" --run arch titans
stage sdpa_kernels 20 60 python3 scripts/gpu_sdpa_kernels.py "${sdpa[@]}"
stage mfu_440m_eager 25 60 python3 scripts/bench_preset_mfu.py --presets transformer_440m \
    "${mfu[@]}"
stage mfu_760m_eager 30 60 python3 scripts/bench_preset_mfu.py --presets transformer_760m \
    "${mfu[@]}"
stage vs_llama 30 120 python3 scripts/bench_model.py --dtype bf16 "${llama[@]}"
stage memory_vs_plan 25 60 python3 scripts/gpu_memory_vs_plan.py --ds_config "$ds1" \
    --config transformer_440m --train.global_batch_size 2 "${memory[@]}"
stage rng_streams 10 60 python3 scripts/check_rng_streams.py
stage mfu_440m_compiled 100 180 python3 scripts/bench_preset_mfu.py --presets transformer_440m \
    "${mfu[@]}" --compile
stage mfu_760m_compiled 70 180 python3 scripts/bench_preset_mfu.py --presets transformer_760m \
    "${mfu[@]}" --compile
