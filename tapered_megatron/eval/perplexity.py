"""Token-weighted loss and perplexity of a model over a dataset split.

Command line (the last stdout line with ``--json`` is one JSON object with at least ``loss``,
``perplexity`` and ``tokens``)::

    python -m tapered_megatron.eval.perplexity --model OUT|--checkpoint DIR --data-path PREFIX \\
        [--split valid] [--data-split 969,30,1] [--seq-len N] [--max-tokens N] [--memory off]
        [--json]

The split's documents are one token stream cut into windows of ``seq_len`` (see
:func:`tapered_megatron.eval.common.windows`): every token but the first is predicted once, with
up to ``seq_len - 1`` tokens of context. ``loss`` is the mean next-token cross-entropy over all
those tokens (natural log, over the model's padded vocabulary as in training), ``perplexity``
its exponential. ``--memory off`` evaluates with the in-context memory's updates switched off
(Titans, Hope; :mod:`tapered_megatron.eval.memory_probe` compares both).

From Python (e.g. a training loop): :func:`perplexity_of` takes any callable ``model(inputs,
labels) -> mean loss`` (our module, or a DeepSpeed engine around it) and ``(inputs, labels)``
batches.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tapered_megatron.eval.common import (
    emit_json,
    fail,
    load_with_tokens,
    model_data_parser,
    windows,
)
from tapered_megatron.export.load import ExportError
from tapered_megatron.models import in_context_memory


@dataclass(frozen=True)
class Perplexity:
    """Mean next-token loss over ``tokens`` predicted tokens and its exponential."""

    loss: float
    perplexity: float
    tokens: int


@torch.no_grad()
def perplexity_of(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    progress: Callable[[int], None] | None = None,
) -> Perplexity:
    """Token-weighted mean of ``model(inputs, labels)`` (a mean loss per batch) over batches.

    ``progress(n)`` is called with the number of tokens of each batch done.
    """
    total, count = 0.0, 0
    for x, y in batches:
        n = y.numel()
        total += float(model(x, y)) * n
        count += n
        if progress is not None:
            progress(n)
    if count == 0:
        raise ValueError("perplexity_of: no tokens")
    loss = total / count
    return Perplexity(loss, math.exp(loss), count)


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    ap = model_data_parser(
        "python -m tapered_megatron.eval.perplexity",
        "Loss and perplexity of a model over a dataset split.",
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    ap.add_argument(
        "--memory",
        choices=("on", "off"),
        default="on",
        help="off: the in-context memory keeps its learned weights (no updates in the sequence)",
    )
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    try:
        loaded, stream, split = load_with_tokens(a, a.max_tokens)
    except (ExportError, FileNotFoundError) as e:
        return fail(e)
    from tqdm import tqdm

    seq_len = a.seq_len or loaded.cfg.model.seq_len
    t0 = time.perf_counter()
    with (
        tqdm(total=len(stream) - 1, unit="tok", file=sys.stderr, disable=None) as bar,
        in_context_memory(loaded.module, a.memory == "on") as n,
    ):
        if a.memory == "off" and not n:
            return fail(ValueError("--memory off: the model has no in-context memory"))
        result = perplexity_of(
            loaded.module, windows(stream, seq_len, a.batch_size, a.device), bar.update
        )
    seconds = time.perf_counter() - t0
    print(
        f"{loaded.source}: loss {result.loss:.4f}, perplexity {result.perplexity:.3f} over "
        f"{result.tokens:,} tokens (seq_len {seq_len}, {result.tokens / seconds:,.0f} tokens/s)"
    )
    if a.json:
        emit_json(
            {
                "loss": result.loss,
                "perplexity": result.perplexity,
                "tokens": result.tokens,
                "seq_len": seq_len,
                "memory": a.memory,
                "split": split,
                "source": loaded.source,
                "tokens_per_s": result.tokens / seconds,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
