"""Training throughput of the memory architectures (titans MAG / MAC, hope_attention) next to
our transformer in the same run, and against the peer packages at matched shapes.

One measurement = forward + backward of the next-token loss + an AdamW step (fp32, ``--threads``
threads), all models measured round-robin in one process so machine noise hits them alike; the
median of the rounds is reported as tokens/s (``--clock cpu``: tokens per CPU second of the
process, which with ``--threads 1`` is the speed on one free core whatever else runs on the
machine). Prints one JSON line. For our models it also gives the training FLOPs per token the
planner counts (:func:`count_model`: forward + backward, and the first pass of Hope's teach
signal) and the FLOP rate over the transformer's (``tokens/s x FLOPs/token``, relative): the
speed ratio is this rate over the ratio of FLOPs per token, which separates "does more work"
from "does its work more slowly".

Shapes (``--shapes``):

* ``lib``: the model-library shape, d_model 256, 8 layers, 4 heads, SwiGLU 688, vocab 8192,
  seq 256, batch 8, cosine taper; titans chunk 16, window (MAC: segment) 64; hope periods
  0/64/16 (the quickstart settings). Also titans MAG at chunk 64 (the chunk-size trade-off).
* ``1024``: d_model 1024, 16 heads, d_ff 3584, vocab 32000 (the 440M preset's widths and memory
  settings: titans chunk 64, window 1024; hope periods 0/1024/64), seq 1024, batch 1, but only
  ``--layers-1024`` layers (default 2) so that a CPU round takes seconds, not minutes.

Peers (``lib`` shape only; benchmark-only extras, never runtime dependencies; install without
touching torch)::

    pip install --no-deps titans-pytorch assoc-scan axial-positional-embedding einx \\
        hyper-connections rotary-embedding-torch x-transformers tensordict pyvers frozendict \\
        loguru torch_einops_utils nested-learning

* ``titans-pytorch`` ``MemoryAsContextTransformer`` vs our MAC (``--model.titans.variant mac``,
  4 persistent tokens): same width, depth, heads, head_dim, segment 64, memory chunk 16, memory
  MLP depth 2 / expansion 2 in every layer, 4 persistent tokens, one residual stream, GEGLU
  feed-forward of int(4 * 2/3 * 256) = 682 (ours: SwiGLU 688 tapered). Not like for like: its
  MAC uses 16 learned long-term memory slots per segment (ours: one retrieved memory token per
  segment token), takes all surprise gradients of a call at the call's start weights and reads
  out per chunk (ours: per chunk start, per token), adds axial positions, and ties nothing; the
  parameter counts are reported.
* ``nested-learning`` ``HOPEModel(block_variant="hope_attention")`` vs our hope_attention with
  ``hope.update teach``: its CMS levels rebuilt at our widths (per layer, level ``i`` of hidden
  ``1.5 w_i``, so its two-matrix GELU MLP has our SwiGLU level's ``3 d w_i`` parameters), update
  periods 64/16 and a never-updating first level (period 2^20), its reference training step:
  forward with grad, teach signal (its ``compute_teach_signal`` formula, written out here because
  its ``training`` module needs omegaconf), backward, then the second forward
  with the teach signal (its in-context CMS updates, in place, under no_grad), AdamW. Ours:
  first pass without grad, teach signal, second pass with per-sequence differentiable updates,
  backward, AdamW. Both: two forward passes, one backward, CMS updates at the same periods; not
  like for like: its updates are not differentiated and change the shared weights (one update per
  batch, not per sequence), its head is tied to the embedding (fewer parameters), its levels are
  LayerNorm + GELU MLPs with a residual each, its attention has no RoPE.

``--compile``: every one of our models built with ``train.compile`` and run under
``torch.compile`` (the trainer's ``engine.compile()``; Titans' chunk step compiled on its own,
Hope's period loops eager), the transformer too, so the ratios compare compiled with compiled;
the compile happens in the untimed warm-up step; no peers.

Usage::

    python scripts/bench_memory_archs.py [--shapes lib 1024] [--rounds 3] [--threads 2]
        [--no-peers] [--clock wall|cpu] [--compile]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_common import LIBRARY_SHAPE, emit, interleaved, model_shape, stamp

from tapered_megatron.config import Config, load_config
from tapered_megatron.models import allow_layer_recompiles, build_model
from tapered_megatron.models.counters import count_model

LIB = [
    *LIBRARY_SHAPE, "--model.titans.chunk_size", "16", "--model.titans.window", "64",
    "--model.hope.periods", "0", "64", "16",
]  # fmt: skip
SHAPE_1024 = [
    "--model.d_model", "1024", "--model.heads", "16", "--model.d_ff", "3584",
    "--model.vocab_size", "32000", "--model.seq_len", "1024", "--model.titans.chunk_size", "64",
    "--model.titans.window", "1024", "--model.hope.periods", "0", "1024", "64",
    "--taper.multiple", "128",
]  # fmt: skip
MAC = ["--model.titans.variant", "mac", "--model.titans.persistent_tokens", "4"]


SECTIONS = {"titans": "--model.titans.", "hope_attention": "--model.hope."}


def _config(base: list[str], *extra: str) -> Config:
    """The quickstart config with ``base`` and ``extra``, keeping of the architecture sections
    only the chosen ``--model.arch``'s (a config carries only its own arch's settings)."""
    args = [*base, *extra]
    arch = (
        args[len(args) - 1 - args[::-1].index("--model.arch") + 1] if "--model.arch" in args else ""
    )
    drop = tuple(v for k, v in SECTIONS.items() if k != arch)
    kept: list[str] = []
    skipping = False
    for x in args:
        if x.startswith("--"):
            skipping = x.startswith(drop)
        if not skipping:
            kept.append(x)
    return load_config("quickstart", kept)


def _ours(base: list[str], *extra: str) -> tuple[torch.nn.Module, Callable, float]:
    """One of our models, its training step and its training FLOPs per token (the planner's
    count, :func:`count_model`)."""
    cfg = _config(base, *extra)
    model = build_model(cfg)
    fwd = model
    if cfg.train.compile:  # as the trainer does
        allow_layer_recompiles(cfg)
        fwd = torch.compile(model)

    def step(ids: torch.Tensor) -> None:
        fwd(ids[:, :-1], ids[:, 1:]).backward()  # loss with the LM head fused in

    return model, step, count_model(cfg, 4).train_flops_per_token


def _peer_titans_mac(base: list[str]) -> tuple[torch.nn.Module, Callable, None]:
    from titans_pytorch import MemoryAsContextTransformer

    m = _config(base, "--model.arch", "titans").model
    model = MemoryAsContextTransformer(
        num_tokens=m.vocab_size,
        dim=m.d_model,
        depth=m.layers,
        segment_len=m.titans.window,
        num_longterm_mem_tokens=16,
        num_persist_mem_tokens=4,
        heads=m.heads,
        dim_head=m.head_dim,
        ff_mult=4,
        num_residual_streams=1,
        neural_memory_layers=tuple(range(1, m.layers + 1)),
        neural_memory_segment_len=m.titans.chunk_size,
        neural_memory_kwargs={
            "dim_head": m.head_dim,
            "heads": m.heads,
            "default_model_kwargs": {"depth": 2, "expansion_factor": 2.0},
        },
    )

    for p in model.parameters():  # some of its parameters are broadcast views (stride 0),
        if 0 in p.stride():  # which an in-place optimizer step cannot write
            p.data = p.data.clone()

    def step(ids: torch.Tensor) -> None:
        model(ids, return_loss=True).backward()

    return model, step, None


def _peer_hope_teach(base: list[str]) -> tuple[torch.nn.Module, Callable, None]:
    from nested_learning.levels import LevelSpec
    from nested_learning.model import HOPEModel, ModelConfig

    cfg = _config(base, "--model.arch", "hope_attention")
    m = cfg.model
    never = 1 << 20  # its periods must be positive: longer than any sequence
    periods = [p if p > 0 else never for p in m.hope.periods]
    levels = [LevelSpec(f"cms_{i}", p) for i, p in enumerate(periods)]
    mc = ModelConfig(
        vocab_size=m.vocab_size,
        dim=m.d_model,
        num_layers=m.layers,
        heads=m.heads,
        titan_level=LevelSpec("titan", min(periods)),
        cms_levels=levels,
        block_variant="hope_attention",
    )
    model = HOPEModel(mc)
    from tapered_megatron.models.hope import level_widths

    for layer, block in enumerate(model.blocks):  # our CMS widths, parameter-matched
        widths = level_widths(cfg.taper_plan.widths[layer], m.hope.levels, cfg.taper_plan.unit)
        for spec, w in zip(levels, widths):
            net = block.cms.blocks[spec.name].net
            hidden = 3 * w // 2
            net[1], net[3] = torch.nn.Linear(m.d_model, hidden), torch.nn.Linear(hidden, m.d_model)

    def step(ids: torch.Tensor) -> None:
        x, y = ids[:, :-1], ids[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        with torch.no_grad():  # its compute_teach_signal (training.py needs omegaconf)
            resid = torch.softmax(logits, -1)
            resid[:, :-1].scatter_add_(-1, x[:, 1:, None], -torch.ones_like(resid[:, :-1, :1]))
            resid[:, -1] = 0
            teach = resid / (x.shape[0] * (x.shape[1] - 1)) @ model.lm_head.weight
        loss.backward()
        with torch.no_grad():
            model(x, teach_signal=teach)

    return model, step, None


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _update(step: Callable, opt: torch.optim.Optimizer, ids) -> None:
    step(ids)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure(
    entries: dict, ids: torch.Tensor, rounds: int, status: dict, clock: Callable[[], float]
) -> dict[str, float]:
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, *_) in entries.items()}
    for k, (_, step, _) in list(entries.items()):  # warm-up; a peer failing here is reported
        try:
            _update(step, opts[k], ids)
        except Exception as e:
            status[k] = f"could not run: {type(e).__name__}: {e}"[:300]
            del entries[k]
    updates = {
        k: functools.partial(_update, step, opts[k], ids) for k, (_, step, _) in entries.items()
    }
    times = interleaved(updates, rounds, clocks={"clock": clock})["clock"]
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    return {k: round(tokens / statistics.median(v), 1) for k, v in times.items()}


def _shape(name: str, a: argparse.Namespace, status: dict) -> dict:
    base = LIB if name == "lib" else [*SHAPE_1024, "--model.layers", str(a.layers_1024)]
    base = [*base, "--train.compile", "true"] if a.compile else base
    batch = a.batch if name == "lib" else 1
    builds: dict[str, Callable] = {
        "transformer": lambda: _ours(base, "--model.arch", "transformer"),
        "titans MAG": lambda: _ours(base, "--model.arch", "titans"),
        "titans MAC (4 persistent tokens)": lambda: _ours(base, "--model.arch", "titans", *MAC),
        "hope_attention": lambda: _ours(base, "--model.arch", "hope_attention"),
    }
    if name == "lib":
        chunk64 = [
            "64" if flag == "--model.titans.chunk_size" else x for flag, x in zip(["", *base], base)
        ]  # the base's chunk size replaced (a flag may be given once)
        builds["titans MAG, chunk 64"] = lambda: _ours(chunk64, "--model.arch", "titans")
        builds["hope_attention, teach signal"] = lambda: _ours(
            base, "--model.arch", "hope_attention", "--model.hope.update", "teach"
        )
        builds["hope_attention, step_norm input"] = lambda: _ours(
            base, "--model.arch", "hope_attention", "--model.hope.step_norm", "input"
        )  # the rule before step_norm split: what the default's second gate costs
        if not (a.no_peers or a.compile):
            builds["peer: titans-pytorch MAC"] = lambda: _peer_titans_mac(base)
            builds["peer: nested-learning hope_attention, teach signal"] = lambda: _peer_hope_teach(
                base
            )
    if a.only:  # a subset (e.g. to fit the 1024 shape's models in memory a few at a time)
        builds = {k: v for k, v in builds.items() if k in ("transformer", *a.only)}
    entries, params = {}, {}
    for key, build in builds.items():
        try:
            entries[key] = build()
            params[key] = sum(p.numel() for p in entries[key][0].parameters())
        except Exception as e:  # a peer that cannot be built here is reported, not fatal
            status[key] = f"could not build: {type(e).__name__}: {e}"[:300]
    cfg = _config(base)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=g)
    tok_s = _measure(entries, ids, a.rounds, status, CLOCKS[a.clock])
    ref = tok_s.get("transformer")
    flops = {k: e[2] for k, e in entries.items() if e[2] is not None}
    # FLOP rate over the transformer's: how fast a model does its own work, not how much
    ref_rate = ref * flops["transformer"] if ref else 0.0
    rate = {k: round(tok_s[k] * f / ref_rate, 3) for k, f in flops.items() if k in tok_s and ref}
    return {
        "shape": model_shape(cfg, batch),
        "tokens_per_s": tok_s,
        "over_transformer": {k: round(v / ref, 3) for k, v in tok_s.items()} if ref else {},
        "train_flops_per_token": {k: round(v) for k, v in flops.items()},
        "flop_rate_over_transformer": rate,
        "params": params,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["lib", "1024"], choices=["lib", "1024"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="batch of the lib shape")
    ap.add_argument("--layers-1024", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="our models with train.compile, each under torch.compile (compiled during the "
        "untimed warm-up); no peers",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=(),
        help="measure only these models (names as in the output) and the transformer",
    )
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: the process's CPU time (with --threads 1: the time on one "
        "free core, unaffected by other jobs on a loaded machine)",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    status: dict[str, str] = {}
    results = {}
    for name in a.shapes:  # each shape's figures as soon as they exist
        results[name] = _shape(name, a, status)
        emit({"shape": name, **results[name]})
    emit(
        {
            "bench": "memory_archs",
            **stamp(),
            "torch": torch.__version__,
            "threads": a.threads,
            "measure": "forward + backward + AdamW step, fp32, median of round-robin rounds",
            "clock": a.clock,
            "rounds": a.rounds,
            "compile": a.compile,
            "results": results,
            "failures": status,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
