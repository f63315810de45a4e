"""Which SDPA kernel the transformer's attention and Titans' window attention actually run.

    python scripts/gpu_sdpa_kernels.py [--layers 2] [--micro-batch 1] [--dtype bf16]
        [--window N] [--section.key value ...]

For each of ``transformer_440m`` and ``titans_440m`` (their widths and sequence, ``--layers``
layers, the overrides applied to both; ``--window`` replaces Titans' attention window), one
forward + backward on DeepSpeed's accelerator (``torch.autocast`` to ``--dtype``, fp32
parameters) under ``torch.profiler``, counting the SDPA operators it dispatched to (flash,
memory-efficient, cuDNN, math; on a CPU flash-for-CPU); then the same step again with SDPA
restricted to the flash and memory-efficient kernels (``sdpa_kernel``), which raises if any call
needs the math fallback. Prints one JSON line; ``ok`` is true when no call used the math kernel
and the restricted step ran.
"""

from __future__ import annotations

import argparse

import torch
from bench_common import emit, stamp
from deepspeed.accelerator import get_accelerator
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from tapered_megatron.accelerator import product_name
from tapered_megatron.config import load_config
from tapered_megatron.models import build_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KERNELS = {  # aten operator -> kernel
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
}
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def check(preset: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Kernel counts of one training step of ``preset`` and whether it runs without math."""
    over = ["--model.layers", str(args.layers), *args.overrides]
    if args.window and preset.startswith("titans"):
        over += ["--model.titans.window", str(args.window)]
    cfg = load_config(preset, over)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    ids = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, cfg.model.seq_len + 1))
    x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32")

    def step() -> None:
        with autocast:
            loss = model(x, y)
        loss.backward()

    step()  # warm-up outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    counts: dict[str, int] = {}
    for ev in prof.events():
        kernel = KERNELS.get(ev.name)
        if kernel is not None:
            counts[kernel] = counts.get(kernel, 0) + 1
    try:
        with sdpa_kernel(FUSED):
            step()
        fused_only, error = True, None
    except RuntimeError as e:
        fused_only, error = False, str(e).splitlines()[0][:200]
    get_accelerator().synchronize()
    return {
        "window": cfg.model.titans.window if cfg.model.arch == "titans" else None,
        "seq_len": cfg.model.seq_len,
        "kernels": counts,
        "fused_only_ok": fused_only,
        "error": error,
        "ok": fused_only and bool(counts) and "math" not in counts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--window", type=int, default=0, help="Titans' window (0: the preset's)")
    args, args.overrides = ap.parse_known_args(argv)
    device = torch.device(get_accelerator().current_device_name())
    results = {p: check(p, args, device) for p in ("transformer_440m", "titans_440m")}
    line = {
        "bench": "sdpa_kernels",
        **stamp(product_name() if device.type != "cpu" else ""),
        "device": device.type,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "overrides": args.overrides,
        "ok": all(r["ok"] for r in results.values()),
        "presets": results,
    }
    emit(line)
    return 0 if line["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
