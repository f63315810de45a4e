"""Training-step throughput of our models against Hugging Face's LlamaForCausalLM, side by side.

    python scripts/bench_model.py [--rounds 10] [--threads 2] [--compile]

Shapes (issue 3): d_model 256, 8 layers, 4 heads, SwiGLU width 688, vocab 8192, sequence 256,
batch 8; fp32, one process, ``--threads`` threads; a step is forward + backward + AdamW (torch's
fused kernel for every variant). Variants run interleaved, one step each per round in a shuffled
order (no variant always follows the same one), so load from other processes on a shared
machine hits them all alike. Throughput is ``tokens x threads / median CPU-seconds per step``
(CPU time of this process: what the threads deliver while they run, far less disturbed by other
processes than wall time, which is reported too; ``best`` uses the least disturbed step). MFU
uses the model FLOPs of ``count_model`` (attention over the mean causal context) against the
best fp32 matmul rate measured the same way on the same machine in the same run. glibc is told
to keep freed memory (see :func:`keep_freed_memory`) for every variant unless
``--default-malloc``. Needs ``transformers`` (benchmark-only extra). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, count_model

SHAPE = [
    "--model.d_model", "256", "--model.layers", "8", "--model.heads", "4", "--model.d_ff", "688",
    "--model.vocab_size", "8192", "--model.seq_len", "256", "--taper.multiple", "16",
]  # fmt: skip
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


def matmul_peak(threads: int, seconds: float = 1.0) -> tuple[float, float]:
    """Best fp32 matmul FLOP/s over square and model-shaped products: (wall-clock, CPU-time).

    The CPU-time rate is FLOPs per CPU-second of this process times ``threads``: what the
    threads deliver while they actually run, which other processes' load disturbs far less.
    """
    best_wall = best_cpu = 0.0
    for m, k, n in ((2048, 2048, 2048), (1024, 1024, 1024), (BATCH * SEQ, 256, 1376)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        reps, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds / 3:
            torch.mm(a, b)
            reps += 1
        flop = 2 * m * k * n * reps
        best_wall = max(best_wall, flop / (time.perf_counter() - t0))
        best_cpu = max(best_cpu, flop * threads / (time.process_time() - c0))
    return best_wall, best_cpu


def ours(overrides: list[str], compile_: bool):
    cfg = load_config("quickstart", SHAPE + overrides)
    model = build_model(cfg)
    fwd = torch.compile(model) if compile_ else model
    return cfg, model, lambda x, y: fwd(x, y)


def hf_llama():
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

    return model, loss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd ours")
    ap.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's allocator settings alone"
    )
    a = ap.parse_args(argv)
    malloc_tuned = not a.default_malloc and keep_freed_memory()
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

    params = {k: sum(p.numel() for p in m.parameters()) for k, (m, _) in variants.items()}
    assert params["ours_uniform"] == params["hf_llama"], params
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, (m, _) in variants.items()
    }
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]

    def step(name: str) -> None:
        _, fn = variants[name]
        opt = opts[name]
        opt.zero_grad(set_to_none=True)
        fn(x, y).backward()
        opt.step()

    for name in variants:  # warm-up (and compilation)
        for _ in range(2):
            step(name)
    peaks = [matmul_peak(a.threads)]
    load_before = os.getloadavg()[0]
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    order_rng = random.Random(0)
    for _ in range(a.rounds):  # one step of each variant per round, in a fresh random order
        for name in order_rng.sample(list(variants), len(variants)):
            t0, c0 = time.perf_counter(), time.process_time()
            step(name)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    peaks.append(matmul_peak(a.threads))
    peak_wall, peak_cpu = max(p[0] for p in peaks), max(p[1] for p in peaks)

    tokens = BATCH * SEQ
    tps_wall = {k: tokens / statistics.median(v) for k, v in wall.items()}
    tps_cpu = {k: tokens * a.threads / statistics.median(v) for k, v in cpu.items()}
    tps_best = {k: tokens * a.threads / min(v) for k, v in cpu.items()}
    flops = {
        "ours_uniform": count_model(cfg_u).train_flops_per_token,
        "ours_tapered": count_model(cfg_t).train_flops_per_token,
        "ours_gated_uniform": count_model(
            load_config("quickstart", [*SHAPE, "--model.arch", "gated_attention"])
        ).train_flops_per_token,
    }
    flops["hf_llama"] = flops["ours_uniform"]
    flops["ours_uniform_compiled"] = flops["ours_uniform"]
    result = {
        "bench": "model_train_step",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {a.threads} threads",
        "torch": torch.__version__,
        "shape": {
            "d_model": 256,
            "layers": 8,
            "heads": 4,
            "d_ff": 688,
            "vocab": VOCAB,
            "seq": SEQ,
            "batch": BATCH,
        },
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
        result["ratio_ours_compiled_vs_hf"] = round(
            tps_cpu["ours_uniform_compiled"] / tps_cpu["hf_llama"], 3
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
