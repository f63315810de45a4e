"""Titans' memory scan compiled (``train.compile``) against eager, side by side in one process.

One measurement = forward + backward of :func:`tapered_megatron.models.titans.memory_scan` (the
read-out and the final state both feed the loss), at the model-library shape per layer: batch 8,
4 heads, sequence 256, head_dim 64, the default memory MLP (depth 2, expansion 2). Eager and
compiled run interleaved, round by round, on the same inputs, so machine noise hits both alike;
the median per mode is reported, in CPU seconds of the process (``--threads 1``: the time on one
free core). Also reports the largest relative gradient difference between the two modes. The
compiled chunk step is built once per chunk size (shapes fixed), before the timed rounds.

Usage::

    python scripts/bench_titans_scan.py [--chunks 16 32 64] [--rounds 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_common import emit, interleaved, stamp

from tapered_megatron.models.titans import memory_scan

BATCH, HEADS, SEQ, HEAD_DIM, HIDDEN = 8, 4, 256, 64, 128


def _inputs(gen: torch.Generator) -> list[torch.Tensor]:
    """q, k (unit norm), v, theta, eta, alpha and the two memory layers, all requiring grad."""
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    q, k = (F.normalize(torch.randn(shape, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(shape, generator=gen)
    gates = [torch.rand(shape[:3], generator=gen) * 0.5 + 0.01 for _ in range(3)]
    w1 = torch.randn(HEADS, HIDDEN, HEAD_DIM, generator=gen) / HEAD_DIM**0.5
    w2 = torch.randn(HEADS, HEAD_DIM, HIDDEN, generator=gen) / HIDDEN**0.5
    return [t.requires_grad_() for t in (q, k, v, *gates, w1, w2)]


def _step(x: list[torch.Tensor], chunk: int, compiled: bool) -> list[torch.Tensor]:
    """Forward + backward; returns the inputs' gradients (and clears them)."""
    y, state = memory_scan(*x[:6], x[6:], chunk, compiled=compiled)
    (y.square().sum() + sum(s.square().sum() for s in state.layers)).backward()
    grads = [t.grad for t in x]
    for t in x:
        t.grad = None
    return grads


def measure(chunk: int, rounds: int, x: list[torch.Tensor]) -> dict:
    """Median CPU seconds per mode at ``chunk`` and the modes' largest relative gradient gap."""
    eager, comp = _step(x, chunk, False), _step(x, chunk, True)  # the compile happens here
    gap = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(comp, eager))
    steps = {"eager": lambda: _step(x, chunk, False), "compiled": lambda: _step(x, chunk, True)}
    times = interleaved(steps, rounds, clocks={"cpu": time.process_time})["cpu"]
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {
        "chunk": chunk,
        "eager_cpu_s": round(e, 4),
        "compiled_cpu_s": round(c, 4),
        "compiled_over_eager": round(c / e, 3),
        "grad_rel_gap": float(f"{gap:.2e}"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    x = _inputs(torch.Generator().manual_seed(0))
    results = [measure(c, a.rounds, x) for c in a.chunks]
    emit(
        {
            "bench": "titans_scan_compiled",
            **stamp(),
            "torch": torch.__version__,
            "threads": a.threads,
            "shape": {"batch": BATCH, "heads": HEADS, "seq": SEQ, "head_dim": HEAD_DIM},
            "results": results,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
