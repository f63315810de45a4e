"""Training-step MFU of full presets on one device (the GPU check's: 440M and 760M tapered).

    python scripts/bench_preset_mfu.py [--presets transformer_440m transformer_760m]
        [--micro-batch 8] [--steps 10] [--dtype bf16] [--compile] [overrides...]

One process, one device (DeepSpeed's accelerator: ``cuda:0`` on a GPU, the CPU otherwise). Each
preset is built as configured (tapered unless overridden), trained for ``--steps`` timed steps
after three warm-up steps on random tokens: forward + the fused LM-head loss, backward, fused
AdamW, with fp32 parameters and ``torch.autocast`` to ``--dtype`` (the usual mixed precision of a
single-device run). Step time is the median wall time between device synchronisations. MFU uses
the model FLOPs of ``count_model`` (no recomputation counted) against two peaks: the vendor's
dense peak for a known accelerator (``pipeline.cost.PEAK_TFLOPS``) and the best matmul rate of
``--dtype`` measured on the same device in the same run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_common import emit, interleaved, stamp
from deepspeed.accelerator import get_accelerator

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, count_model
from tapered_megatron.training.logger import device_product_name, peak_tflops, probe_tflops

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def time_preset(preset: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Median training-step time and throughput of ``preset`` on ``device``."""
    acc = get_accelerator()
    cfg = load_config(preset, args.overrides)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    step_fn = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    b, s = args.micro_batch, cfg.model.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (b, s + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32")

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = step_fn(x, y)
        loss.backward()
        opt.step()
        return loss.item()  # synchronises

    for _ in range(3):
        step()
    times = interleaved({"step": step}, args.steps, sync=acc.synchronize)["wall"]["step"]
    step_s = statistics.median(times)
    counts = count_model(cfg)
    return {
        "params": counts.params_total,
        "d_ff": list(cfg.taper_plan.widths),
        "tokens_per_step": b * s,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(b * s / step_s, 1),
        "model_tflops": round(counts.train_flops_per_token * b * s / step_s / 1e12, 2),
        "peak_memory_gb": round(acc.max_memory_allocated() / 2**30, 2)
        if device.type != "cpu"
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["transformer_440m", "transformer_760m"])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per preset")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model")
    ap.add_argument("--peak-n", type=int, default=8192, help="matmul size of the peak probe")
    args, args.overrides = ap.parse_known_args(argv)
    acc = get_accelerator()
    device = torch.device(acc.current_device_name())
    datasheet = peak_tflops(0.0) * 1e12 if device.type != "cpu" else 0.0
    measured = probe_tflops(args.peak_n, reps=10, dtype=DTYPES[args.dtype]) * 1e12
    results = {p: time_preset(p, args, device) for p in args.presets}
    for r in results.values():
        flops = r["model_tflops"] * 1e12
        r["mfu_measured_peak"] = round(flops / measured, 3)
        r["mfu_datasheet"] = round(flops / datasheet, 3) if datasheet else None
    emit(
        {
            "bench": "preset_train_step_mfu",
            **stamp(device_product_name() if device.type != "cpu" else ""),
            "device": device_product_name(),
            "torch": torch.__version__,
            "dtype": args.dtype,
            "compile": args.compile,
            "micro_batch": args.micro_batch,
            "overrides": args.overrides,
            "peak_tflops": {
                "datasheet": round(datasheet / 1e12, 1) if datasheet else None,
                "measured": round(measured / 1e12, 1),
            },
            "presets": results,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
