"""Training-step throughput of our models against Hugging Face's LlamaForCausalLM, side by side.

    python scripts/bench_model.py [--rounds 10] [--threads 2] [--compile] [--no-floor]
    python scripts/bench_model.py --device accelerator --dtype bf16 --compile   # on a GPU

Shapes: d_model 256, 8 layers, 4 heads, SwiGLU width 688, vocab 8192, sequence 256,
batch 8; fp32, one process, ``--threads`` threads; a step is forward + backward + AdamW (torch's
fused kernel for every variant). Variants run interleaved, one step each per round in a shuffled
order (no variant always follows the same one), so load from other processes on a shared
machine hits them all alike. Throughput is ``tokens x threads / median CPU-seconds per step``
(CPU time of this process: what the threads deliver while they run, far less disturbed by other
processes than wall time, which is reported too; ``best`` uses the least disturbed step). MFU
uses the model FLOPs of ``count_model`` (attention over the mean causal context) against the
best fp32 matmul rate measured the same way on the same machine in the same run. glibc is told
to keep freed memory (see :func:`keep_freed_memory`) for every variant unless
``--default-malloc``. ``--compile`` adds ``torch.compile``'d ours and HF. The kernel floor
(:func:`kernel_floor`, CPU fp32 only) times the step's own matmuls, attention kernels and AdamW
in isolation: the time no implementation built on these kernels can beat, hence an upper bound
on MFU. ``--device accelerator`` runs on DeepSpeed's accelerator (``cuda:0``), timing wall
clock between synchronisations; ``--dtype bf16`` runs every variant under ``torch.autocast``
(fp32 parameters), with the peak measured in bf16.
Needs ``transformers`` (benchmark-only extra). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F
from bench_common import LIBRARY_SHAPE, emit, interleaved, model_shape, stamp
from deepspeed.accelerator import get_accelerator

from tapered_megatron.accelerator import matmul_peak
from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, count_model
from tapered_megatron.training.logger import device_product_name

SHAPE = [*LIBRARY_SHAPE, "--taper.multiple", "16"]
BATCH, SEQ, VOCAB = 8, 256, 8192


def keep_freed_memory() -> bool:
    """Stop glibc from returning freed tensors to the OS (no mmap'd chunks, no heap trimming).

    Otherwise every step's large activations are fresh pages, and first-touch page faults (very
    expensive in a VM) cost as much as the arithmetic at these sizes. Applies to every variant.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 1 << 30))


def peaks(threads: int, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """Best matmul FLOP/s of ``dtype`` over square and model-shaped products on ``device``:
    (wall-clock, CPU-time), each shape timed over a third of a second of back-to-back products.

    The CPU-time rate is FLOPs per CPU-second of this process times ``threads``: what the
    threads deliver while they actually run, which other processes' load disturbs far less
    (on an accelerator it is the wall-clock rate).
    """
    squares = (2048, 1024) if device.type == "cpu" else (8192, 4096)
    shapes = ((squares[0],) * 3, (squares[1],) * 3, (BATCH * SEQ, 256, 1376))
    clocks = (time.perf_counter, time.process_time)
    wall, cpu = matmul_peak(shapes, device=device, dtype=dtype, seconds=1.0 / 3, clocks=clocks)
    return wall, cpu * threads if device.type == "cpu" else wall


def _best_time(fn, seconds: float) -> float:
    """Smallest wall time of one call of ``fn`` (after a warm-up call), over ``seconds`` of calls.

    Wall time: a process's CPU clock credits its other threads only at scheduler ticks, so
    millisecond-long calls read low on it.
    """
    fn()
    best, t0 = float("inf"), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        c0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - c0)
    return best


def _causal_attention(q, k, v, grad: torch.Tensor) -> None:
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out, (q, k, v), grad)


def kernel_floor(step, optimizer_step, seconds: float = 0.2) -> dict:
    """Seconds per step of ``step``'s matmuls, flash attention and optimizer run on their own.

    One profiled call of ``step`` lists every ``mm``/``addmm``/``bmm`` with its shapes and every
    CPU flash-attention forward; each product is re-timed alone on random inputs of those shapes
    with a preallocated output, in its fastest operand layout (any of the four transpositions),
    each attention as a causal forward + backward of random ``q, k, v`` of its shape, and
    ``optimizer_step`` (the fused AdamW update every variant needs) alone. The sum is what a
    step built on these kernels cannot beat (all else taken as free, caches hot), so
    ``flops / (floor * peak)`` bounds its MFU from above.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    gemms: dict[tuple, int] = {}
    attns: dict[tuple, int] = {}
    for ev in prof.events():
        shapes = ev.input_shapes
        if ev.name in ("aten::mm", "aten::bmm"):
            key = (tuple(shapes[0]), tuple(shapes[1]))
        elif ev.name in ("aten::addmm", "aten::addmm_", "aten::baddbmm"):
            key = (tuple(shapes[1]), tuple(shapes[2]))
        elif ev.name == "aten::_scaled_dot_product_flash_attention_for_cpu":
            attns[tuple(shapes[0])] = attns.get(tuple(shapes[0]), 0) + 1
            continue
        else:
            continue
        gemms[key] = gemms.get(key, 0) + 1
    gemm_s = attn_s = 0.0
    for (sa, sb), count in gemms.items():
        *batch, m, k = sa
        n = sb[-1]
        out = torch.empty(*batch, m, n)
        best = float("inf")
        for ta in (False, True):
            for tb in (False, True):
                a = torch.randn(*batch, k, m).transpose(-1, -2) if ta else torch.randn(sa)
                b = torch.randn(*batch, n, k).transpose(-1, -2) if tb else torch.randn(sb)
                op = torch.bmm if batch else torch.mm
                best = min(best, _best_time(functools.partial(op, a, b, out=out), seconds / 4))
        gemm_s += count * best
    for shape, count in attns.items():
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        attention = functools.partial(_causal_attention, q, k, v, torch.randn(shape))
        attn_s += count * _best_time(attention, seconds)
    return {
        "gemm_s": gemm_s,
        "attention_s": attn_s,
        "optimizer_s": _best_time(optimizer_step, seconds),
        "gemm_calls": sum(gemms.values()),
    }


def ours(overrides: list[str], compile_: bool):
    cfg = load_config("quickstart", SHAPE + overrides)
    model = build_model(cfg)
    fwd = torch.compile(model) if compile_ else model
    return cfg, model, lambda x, y: fwd(x, y)


def hf_llama(compile_: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    conf._attn_implementation = "sdpa"
    model = LlamaForCausalLM(conf)

    def loss(x, y):
        logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1))

    return model, (torch.compile(loss) if compile_ else loss)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd ours, HF")
    ap.add_argument("--no-floor", action="store_true", help="skip the kernel floor (MFU bound)")
    ap.add_argument(
        "--device", choices=["cpu", "accelerator"], default="cpu", help="accelerator: cuda:0 etc."
    )
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    ap.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's allocator settings alone"
    )
    a = ap.parse_args(argv)
    acc = get_accelerator()
    dev = torch.device(acc.current_device_name() if a.device == "accelerator" else "cpu")
    on_cpu = dev.type == "cpu"
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    malloc_tuned = on_cpu and not a.default_malloc and keep_freed_memory()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    variants = {}
    cfg_u, m, fn = ours(["--taper.schedule", "uniform"], False)
    variants["ours_uniform"] = (m, fn)
    cfg_t, m, fn = ours([], False)
    variants["ours_tapered"] = (m, fn)
    _, m, fn = ours(["--taper.schedule", "uniform", "--model.arch", "gated_attention"], False)
    variants["ours_gated_uniform"] = (m, fn)
    variants["hf_llama"] = hf_llama()
    if a.compile:
        _, m, fn = ours(["--taper.schedule", "uniform"], True)
        variants["ours_uniform_compiled"] = (m, fn)
        variants["hf_llama_compiled"] = hf_llama(compile_=True)

    for m, _ in variants.values():
        m.to(dev)
    params = {k: sum(p.numel() for p in m.parameters()) for k, (m, _) in variants.items()}
    assert params["ours_uniform"] == params["hf_llama"], params
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, (m, _) in variants.items()
    }
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].to(dev), ids[:, 1:].to(dev)

    def step(name: str) -> None:
        _, fn = variants[name]
        opt = opts[name]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype, enabled=a.dtype != "fp32"):
            loss = fn(x, y)
        loss.backward()
        opt.step()
        if not on_cpu:
            acc.synchronize()

    for name in variants:  # warm-up (and compilation)
        for _ in range(2):
            step(name)
    peak_runs = [peaks(a.threads, dev, dtype)]
    load_before = os.getloadavg()[0]
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    steps = {name: functools.partial(step, name) for name in variants}
    times = interleaved(steps, a.rounds, clocks=clocks, order="shuffle")
    wall, cpu = times["wall"], times["cpu"]
    peak_runs.append(peaks(a.threads, dev, dtype))
    floor = None
    if on_cpu and not a.no_floor and a.dtype == "fp32":  # times CPU fp32 kernels
        floor = kernel_floor(lambda: step("ours_uniform"), opts["ours_uniform"].step)
    peak_wall, peak_cpu = max(p[0] for p in peak_runs), max(p[1] for p in peak_runs)

    tokens = BATCH * SEQ
    tps_wall = {k: tokens / statistics.median(v) for k, v in wall.items()}
    # CPU: tokens x threads per CPU-second; an accelerator: tokens per wall second between
    # synchronisations (its CPU time says nothing about the device)
    per_step, scale = (cpu, a.threads) if on_cpu else (wall, 1)
    tps_cpu = {k: tokens * scale / statistics.median(v) for k, v in per_step.items()}
    tps_best = {k: tokens * scale / min(v) for k, v in per_step.items()}
    flops = {
        "ours_uniform": count_model(cfg_u).train_flops_per_token,
        "ours_tapered": count_model(cfg_t).train_flops_per_token,
        "ours_gated_uniform": count_model(
            load_config("quickstart", [*SHAPE, "--model.arch", "gated_attention"])
        ).train_flops_per_token,
    }
    flops["hf_llama"] = flops["ours_uniform"]
    flops["ours_uniform_compiled"] = flops["hf_llama_compiled"] = flops["ours_uniform"]
    result = {
        "bench": "model_train_step",
        **stamp("" if on_cpu else device_product_name()),
        "threads": a.threads,
        "torch": torch.__version__,
        "dtype": a.dtype,
        "shape": model_shape(cfg_u, BATCH),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "matmul_peak_gflops": {"wall": round(peak_wall / 1e9, 1), "cpu": round(peak_cpu / 1e9, 1)},
        "tokens_per_s": {k: round(v, 1) for k, v in tps_cpu.items()},
        "tokens_per_s_best": {k: round(v, 1) for k, v in tps_best.items()},
        "tokens_per_s_wall_median": {k: round(v, 1) for k, v in tps_wall.items()},
        "mfu": {k: round(tps_cpu[k] * flops[k] / peak_cpu, 3) for k in tps_cpu},
        "mfu_wall": {k: round(tps_wall[k] * flops[k] / peak_wall, 3) for k in tps_wall},
        "ratio_ours_vs_hf": round(tps_cpu["ours_uniform"] / tps_cpu["hf_llama"], 3),
        "ratio_ours_vs_hf_wall": round(tps_wall["ours_uniform"] / tps_wall["hf_llama"], 3),
        "ratio_tapered_vs_uniform": round(tps_cpu["ours_tapered"] / tps_cpu["ours_uniform"], 3),
        "ratio_gated_vs_plain": round(tps_cpu["ours_gated_uniform"] / tps_cpu["ours_uniform"], 3),
        "ratio_best": {
            "ours_vs_hf": round(tps_best["ours_uniform"] / tps_best["hf_llama"], 3),
            "tapered_vs_uniform": round(tps_best["ours_tapered"] / tps_best["ours_uniform"], 3),
            "gated_vs_plain": round(tps_best["ours_gated_uniform"] / tps_best["ours_uniform"], 3),
        },
        "steps_per_variant": a.rounds,
        "malloc_keeps_freed_memory": malloc_tuned,
    }
    if a.compile:
        compiled = tps_cpu["ours_uniform_compiled"]
        result["ratio_ours_compiled_vs_hf"] = round(compiled / tps_cpu["hf_llama"], 3)
        result["ratio_ours_compiled_vs_hf_compiled"] = round(
            compiled / tps_cpu["hf_llama_compiled"], 3
        )
    if floor is not None:
        floor_s = floor["gemm_s"] + floor["attention_s"] + floor["optimizer_s"]
        result["kernel_floor"] = {  # wall seconds, against the wall-clock matmul peak
            **{k: round(v, 4) for k, v in floor.items()},
            "ours_uniform_step_s": round(statistics.median(wall["ours_uniform"]), 4),
            "mfu_ceiling": round(tokens / floor_s * flops["ours_uniform"] / peak_wall, 3),
        }
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
