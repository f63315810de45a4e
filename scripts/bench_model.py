"""Training-step throughput of our models against Hugging Face's LlamaForCausalLM, side by side.

    python scripts/bench_model.py [--rounds 5] [--steps 3] [--threads 2] [--compile]

Shapes (issue 3): d_model 256, 8 layers, 4 heads, SwiGLU width 688, vocab 8192, sequence 256,
batch 8; fp32, one process, ``--threads`` threads; a step is forward + backward + AdamW. Variants
run interleaved, round by round, so load from other processes on a shared machine hits them all
alike; the median round counts. MFU uses the model FLOPs of ``count_model`` (attention over the
mean causal context) against the best fp32 matmul rate measured on the same machine in the same
run. Needs ``transformers`` (benchmark-only extra). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
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


def matmul_peak(seconds: float = 1.0) -> float:
    """Best fp32 matmul FLOP/s over a few square and model-shaped products."""
    best = 0.0
    for m, k, n in ((2048, 2048, 2048), (1024, 1024, 1024), (BATCH * SEQ, 256, 1376)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            torch.mm(a, b)
            reps += 1
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
    return best


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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd ours")
    a = ap.parse_args(argv)
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
    peak = matmul_peak()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for name in order:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(name)
            times[name].append((time.perf_counter() - t0) / a.steps)
    peak = max(peak, matmul_peak())

    tokens = BATCH * SEQ
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
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
        "shape": {"d_model": 256, "layers": 8, "heads": 4, "d_ff": 688, "vocab": VOCAB,
                  "seq": SEQ, "batch": BATCH},  # fmt: skip
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "mfu": {k: round(tps[k] * flops[k] / peak, 3) for k in tps},
        "ratio_ours_vs_hf": round(tps["ours_uniform"] / tps["hf_llama"], 3),
        "ratio_tapered_vs_uniform": round(tps["ours_tapered"] / tps["ours_uniform"], 3),
        "ratio_gated_vs_plain": round(tps["ours_gated_uniform"] / tps["ours_uniform"], 3),
        "rounds": a.rounds,
        "steps_per_round": a.steps,
    }
    if a.compile:
        result["ratio_ours_compiled_vs_hf"] = round(
            tps["ours_uniform_compiled"] / tps["hf_llama"], 3
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
