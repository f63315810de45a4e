"""Associative recall beyond the attention window: can the in-context memory carry what the
window cannot see? Trains small models of each memory architecture and a transformer with the
same sliding window and the same training budget on CPU, then reports recall accuracy.

Task (fresh random sequences every step): ``pairs`` key/value pairs ``k_1 v_1 ... k_n v_n``
(keys and values drawn at random without repetition from their own vocabularies), a ``gap`` of
random filler tokens, then every key again in a random order, each followed by its value. The
loss and the accuracy are on the queried values only. The gap is at least ``layers x window``
tokens (checked), so even the stacked windows of all layers together cannot reach a stored
pair from its query: attention alone scores at chance (1 / values; slightly above at most, by
excluding the values already queried inside its window), and anything above that is recall by
the in-context memory.

Models (one shape: d_model 64, 2 layers, 2 heads, d_ff 176, cosine taper; the block's attention
restricted to a sliding window of ``window`` tokens in every model):

* transformer: our transformer with its attention replaced by sliding-window attention;
* titans MAG (window attention + memory), titans MAC (segments of ``window`` tokens), defaults
  otherwise (chunk 8, no persistent tokens); ``mac-p4``: MAC with 4 persistent tokens (the
  paper's MAC prepends persistent tokens; without them our MAC does not learn this task);
* hope_attention (``hope``): its attention replaced by the same sliding-window attention, CMS
  periods 0 / 16 / 8, otherwise its defaults (learned rates, association update,
  ``hope.step_norm split``: ``W_2``'s step normalised by its own input with a gate of its own);
  ``hope-input``: the same with ``hope.step_norm input`` (the default before); ``hope-own``:
  ``hope.step_norm own``, ``hope.lr 1``, ``hope.rate_init 0.5`` (per-matrix normalised steps,
  large from the start); ``hope-spread``: ``hope.w2_gate_spread 4.8`` (``W_2``'s gate logit
  starts with 3x the spread over tokens that init_std gives at d 64, so the gate can open on
  some tokens and not others from step 0). docs/memory_architectures.md says what each choice
  costs in language modelling.

Same steps, batch, learning rate (AdamW), seed, training data and evaluation data for all;
parameter counts reported (the Titans mixers carry their own memory projections, so they are
larger; a transformer cannot recall beyond its reach at any size). Recall accuracy is reported at
initialisation and after training. ``--models`` picks a subset: the results do not depend on
which models share a process (each model reseeds), so the models can run as separate processes.

Usage::

    python scripts/bench_memory_recall.py [--steps 300] [--threads 1] [--models hope mac]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from bench_common import emit, stamp

from tapered_megatron.config import load_config
from tapered_megatron.models import build_model, lm_loss
from tapered_megatron.models.attention import Attention
from tapered_megatron.models.titans import window_mask

FILLER, KEYS, VALUES = 64, 64, 64  # token ranges: [0, 64) filler, [64, 128) keys, [128, 192)
LAYERS = 2


class WindowAttention(Attention):
    """Our causal attention restricted to a sliding window (token t sees (t - window, t])."""

    window = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, g, k, v = self.project(x)
        q, k, v = (t.transpose(1, 2) for t in (self.rope(q), self.rope(k), v))
        mask = window_mask(s, self.window, x.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.grouped)
        return self.out(self.gate(o.transpose(1, 2), g).reshape(b, s, self.heads * self.head_dim))


def make_batch(batch: int, pairs: int, gap: int, gen: torch.Generator):
    """Token ids ``[batch, 4 pairs + gap + 1]`` and the 0/1 loss mask of the next-token targets
    (1 where the target is a queried value)."""
    keys = torch.stack([torch.randperm(KEYS, generator=gen)[:pairs] for _ in range(batch)])
    values = torch.stack([torch.randperm(VALUES, generator=gen)[:pairs] for _ in range(batch)])
    keys, values = keys + FILLER, values + FILLER + KEYS
    order = torch.stack([torch.randperm(pairs, generator=gen) for _ in range(batch)])
    store = torch.stack((keys, values), dim=-1).flatten(1)
    query = torch.stack((keys.gather(1, order), values.gather(1, order)), dim=-1).flatten(1)
    filler = torch.randint(0, FILLER, (batch, gap), generator=gen)
    ids = torch.cat((store, filler, query, torch.zeros(batch, 1, dtype=torch.long)), dim=1)
    mask = torch.zeros(batch, ids.shape[1] - 1)
    start = 2 * pairs + gap  # targets at positions start+1, start+3, ... are the queried values
    mask[:, start::2] = 1
    return ids, mask


def build(arch: str, window: int, seq: int, *extra: str) -> torch.nn.Module:
    """A small model of ``arch``; transformer and hope_attention get window attention."""
    own = {  # a config carries only its own architecture's settings
        "titans": ["--model.titans.window", str(window), "--model.titans.chunk_size", "8"],
        "hope_attention": ["--model.hope.periods", "0", "16", "8"],
    }
    cfg = load_config(
        "quickstart",
        [
            "--model.arch", arch, "--model.d_model", "64", "--model.layers", str(LAYERS),
            "--model.heads", "2", "--model.d_ff", "176", "--model.vocab_size", "192",
            "--model.make_vocab_size_divisible_by", "64", "--model.seq_len", str(seq),
            *own.get(arch, []), *extra,
        ],
    )  # fmt: skip
    model = build_model(cfg)
    if arch in ("transformer", "hope_attention"):
        WindowAttention.window = window
        for i, block in enumerate(model.layers):
            windowed = WindowAttention(cfg, i)
            windowed.load_state_dict(block.mixer.state_dict())  # the same initial weights
            block.mixer = windowed
    return model


def recall_accuracy(model, a: argparse.Namespace) -> float:
    """Share of queried values predicted exactly (argmax) on ``eval_batches`` fresh batches."""
    gen = torch.Generator().manual_seed(a.seed + 1)  # the same evaluation data for every model
    hits = total = 0
    with torch.no_grad():
        for _ in range(a.eval_batches):
            ids, mask = make_batch(a.batch, a.pairs, a.gap, gen)
            pred = model(ids[:, :-1]).argmax(-1)
            hits += ((pred == ids[:, 1:]) & (mask > 0)).sum().item()
            total += mask.sum().item()
    return round(hits / total, 4)


def train_and_eval(model, a: argparse.Namespace) -> dict:
    """AdamW on fresh batches; returns recall accuracy before and after, losses, seconds."""
    at_init = recall_accuracy(model, a)
    gen = torch.Generator().manual_seed(a.seed)  # the same training data for every model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    losses = []
    for step in range(1, a.steps + 1):
        ids, mask = make_batch(a.batch, a.pairs, a.gap, gen)
        loss = lm_loss(model(ids[:, :-1]), (ids[:, 1:], mask))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:  # progress on stderr
            recent, wall = sum(losses[-50:]) / 50, time.perf_counter() - t0
            print(f"step {step} loss {recent:.4f} {wall:.0f} s", file=sys.stderr)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tail = losses[-20:]
    return {
        "recall_accuracy": recall_accuracy(model, a),
        "recall_at_init": at_init,
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4),
        "train_s": round(seconds, 1),
        "train_cpu_s": round(cpu, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--gap", type=int, default=48, help="filler tokens between pairs and queries")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--models",
        nargs="+",
        default=[
            "transformer",
            "mag",
            "mac",
            "mac-p4",
            "hope",
            "hope-input",
            "hope-own",
            "hope-spread",
        ],
    )
    a = ap.parse_args(argv)
    if a.gap < LAYERS * a.window:
        ap.error(
            f"--gap must be at least {LAYERS} x --window (the reach of {LAYERS} stacked windows): "
            "the task is recall beyond what attention can see"
        )
    torch.set_num_threads(a.threads)
    seq = 4 * a.pairs + a.gap
    specs = {
        "transformer": ("transformer",),
        "mag": ("titans",),
        "mac": ("titans", "--model.titans.variant", "mac"),
        # MAC as the paper has it, with persistent tokens (as in bench_memory_archs.py): without
        # them MAC stays at chance here even at 600 steps (see docs/BENCHMARKS.md)
        "mac-p4": ("titans", "--model.titans.variant", "mac", "--model.titans.persistent_tokens",
                   "4"),
        "hope": ("hope_attention",),
        "hope-input": ("hope_attention", "--model.hope.step_norm", "input"),
        # hope.step_norm own, large initial steps: fast in-context binding
        "hope-own": ("hope_attention", "--model.hope.step_norm", "own", "--model.hope.lr", "1",
                     "--model.hope.rate_init", "0.5"),
        # W_2's gate logit spread widened at init (reliable recall, a language cost)
        "hope-spread": ("hope_attention", "--model.hope.w2_gate_spread", "4.8"),
    }  # fmt: skip
    results = {}
    for name in a.models:
        torch.manual_seed(a.seed)
        results[name] = train_and_eval(build(specs[name][0], a.window, seq, *specs[name][1:]), a)
        print(name, results[name], flush=True)
    emit(
        {
            "bench": "memory_recall",
            **stamp(),
            "torch": torch.__version__,
            "threads": a.threads,
            "task": {"pairs": a.pairs, "gap": a.gap, "window": a.window, "seq": seq,
                     "chance": round(1 / VALUES, 4)},
            "train": {"steps": a.steps, "batch": a.batch, "lr": a.lr, "seed": a.seed},
            "results": results,
        }
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
