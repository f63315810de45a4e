"""Training throughput of the memory architectures (titans, hope_attention) next to the
transformer, tapered vs uniform, and against the peer packages where they run.

One forward + backward of the next-token loss per measurement (no optimizer step), all models
measured round-robin in one process so machine noise hits them alike; the median of the rounds
is reported. Prints one JSON line.

Peers (benchmark-only extras, never runtime dependencies; install without touching torch)::

    pip install --no-deps titans-pytorch assoc-scan axial-positional-embedding einx \\
        hyper-connections rotary-embedding-torch x-transformers tensordict pyvers frozendict \\
        loguru torch_einops_utils nested-learning

* ``titans-pytorch``: its LM is Memory-as-Context (no MAG LM exists there), built at our shape
  (segments of ``window`` tokens, neural memory in every layer, memory chunk = our chunk size,
  one residual stream); and its ``NeuralMemory`` alone against our memory branch (``lmm`` mixer)
  at the same heads / head_dim / depth / expansion / chunk.
* ``nested-learning``: its ``HOPEModel(block_variant="hope_attention")`` at our shape; its CMS
  levels are fixed at 4 x dim hidden each (not budget-matched; params are reported), and its
  in-context CMS updates need an outer-loss teach signal (a second pass), so its plain forward +
  backward is timed.

Usage::

    python scripts/bench_memory_archs.py [--rounds 3] [--batch 8] [--threads 2] [--no-peers]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, lm_loss

SHAPE = [
    "--model.d_model", "256", "--model.layers", "8", "--model.heads", "4", "--model.d_ff", "688",
    "--model.vocab_size", "8192", "--model.seq_len", "256", "--model.titans.chunk_size", "16",
    "--model.titans.window", "64", "--model.hope.periods", "0", "64", "16",
]  # fmt: skip


def _ours(arch: str, schedule: str, *extra: str):
    cfg = load_config(
        "quickstart", [*SHAPE, "--model.arch", arch, "--taper.schedule", schedule, *extra]
    )
    model = build_model(cfg)
    return model, lambda ids: lm_loss(model(ids[:, :-1]), ids[:, 1:])


def _peer_titans_mac(cfg):
    from titans_pytorch import MemoryAsContextTransformer

    m = cfg.model
    model = MemoryAsContextTransformer(
        num_tokens=m.vocab_size,
        dim=m.d_model,
        depth=m.layers,
        segment_len=m.titans.window,
        heads=m.heads,
        dim_head=m.head_dim,
        ff_mult=4,  # SwiGLU-like GEGLU of int(4 * 2/3 * d) = 682 ~ our 688
        num_residual_streams=1,
        neural_memory_layers=tuple(range(1, m.layers + 1)),
        neural_memory_segment_len=m.titans.chunk_size,
        neural_memory_kwargs={
            "dim_head": m.head_dim,
            "heads": m.heads,
            "default_model_kwargs": {"depth": 2, "expansion_factor": 2.0},
        },
    )
    return model, lambda ids: model(ids, return_loss=True)


def _peer_hope(cfg):
    from nested_learning.levels import LevelSpec
    from nested_learning.model import HOPEModel, ModelConfig

    m = cfg.model
    levels = [LevelSpec(f"cms_{p}", p) for p in (1024, 64, 16)]  # 1024 > seq: never in-sequence
    mc = ModelConfig(
        vocab_size=m.vocab_size,
        dim=m.d_model,
        num_layers=m.layers,
        heads=m.heads,
        titan_level=LevelSpec("titan", 16),
        cms_levels=levels,
        block_variant="hope_attention",
    )
    model = HOPEModel(mc)

    def loss(ids):
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    return model, loss


def _memory_modules(cfg, batch: int):
    """Our memory branch (lmm mixer) vs titans-pytorch's NeuralMemory on x [b, s, d]."""
    from titans_pytorch import NeuralMemory

    from tapered_megatron.models.titans import TitansMixer
    from tapered_megatron.parallel import init_parameters

    m = cfg.model
    lmm = cfg.with_overrides(["--model.titans.variant", "lmm"])
    ours = TitansMixer(lmm, 0)
    init_parameters(ours, 0)
    peer = NeuralMemory(
        dim=m.d_model,
        chunk_size=m.titans.chunk_size,
        dim_head=m.head_dim,
        heads=m.heads,
        default_model_kwargs={"depth": 2, "expansion_factor": 2.0},
    )
    x = torch.randn(batch, m.seq_len, m.d_model, generator=torch.Generator().manual_seed(0))

    def run_peer(_ids):
        out = peer(x)
        out = out[0] if isinstance(out, tuple) else out
        return out.pow(2).mean()

    return (ours, lambda _ids: ours(x).pow(2).mean()), (peer, run_peer)


def _time(fn: Callable, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fn(ids).backward()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peers", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    entries: dict[str, tuple] = {}
    params: dict[str, int] = {}
    for arch in ("transformer", "titans", "hope_attention"):
        for schedule in ("cosine", "uniform"):
            model, fn = _ours(arch, schedule)
            key = f"{arch}/{'tapered' if schedule == 'cosine' else 'uniform'}"
            entries[key], params[key] = (model, fn), sum(p.numel() for p in model.parameters())
    # The nested-learning peer's timed forward makes no in-context CMS update; this is ours
    # doing the same work (update rate 0: attention + the static CMS chain).
    key = "hope_attention/uniform, static CMS (hope.lr 0)"
    model, fn = _ours("hope_attention", "uniform", "--model.hope.lr", "0")
    entries[key], params[key] = (model, fn), sum(p.numel() for p in model.parameters())
    base = load_config("quickstart", SHAPE)
    peers_status: dict[str, str] = {}
    if not a.no_peers:
        for name, build in (
            ("peer:titans-pytorch MAC", lambda: _peer_titans_mac(base)),
            ("peer:nested-learning hope_attention", lambda: _peer_hope(base)),
        ):
            try:
                entries[name] = build()
                params[name] = sum(p.numel() for p in entries[name][0].parameters())
                peers_status[name] = "ran"
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                peers_status[name] = f"could not run: {type(e).__name__}: {e}"[:300]
        try:
            (om, of), (pm, pf) = _memory_modules(base, a.batch)
            entries["module:ours memory (lmm mixer)"] = (om, of)
            entries["module:titans-pytorch NeuralMemory"] = (pm, pf)
            for k, mod in (
                ("module:ours memory (lmm mixer)", om),
                ("module:titans-pytorch NeuralMemory", pm),
            ):
                params[k] = sum(p.numel() for p in mod.parameters())
            peers_status["module:titans-pytorch NeuralMemory"] = "ran"
        except Exception as e:
            peers_status["module:titans-pytorch NeuralMemory"] = f"could not run: {e}"[:300]

    seq = base.model.seq_len
    ids = torch.randint(0, base.model.vocab_size, (a.batch, seq + 1))
    times: dict[str, list[float]] = {k: [] for k in entries}
    for k, (_, fn) in list(entries.items()):  # warm-up (and drop peers that fail at run time)
        try:
            _time(fn, ids)
        except Exception as e:
            peers_status[k] = f"could not run: {type(e).__name__}: {e}"[:300]
            del entries[k], times[k]
    for _ in range(a.rounds):
        for k, (model, fn) in entries.items():
            model.zero_grad(set_to_none=True)
            times[k].append(_time(fn, ids))
    tokens = a.batch * seq
    tok_s = {k: round(tokens / statistics.median(v), 1) for k, v in times.items()}
    ratio = {
        arch: round(tok_s[f"{arch}/tapered"] / tok_s[f"{arch}/uniform"], 3)
        for arch in ("transformer", "titans", "hope_attention")
    }
    print(
        json.dumps(
            {
                "bench": "memory_archs",
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "torch": torch.__version__,
                "threads": a.threads,
                "shape": {"d_model": 256, "layers": 8, "heads": 4, "d_ff": 688, "vocab": 8192,
                          "seq": seq, "batch": a.batch, "dtype": "fp32"},
                "measure": "forward+backward of the loss, median of rounds",
                "rounds": a.rounds,
                "tokens_per_s": tok_s,
                "tapered_over_uniform": ratio,
                "params": params,
                "peers": peers_status,
            }
        )
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
