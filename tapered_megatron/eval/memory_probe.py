"""The memory probe: does a model's in-context memory lower its loss? Validation loss with the
in-context updates (Titans' memory rule, Hope's CMS updates) switched off at evaluation against
on, at the training sequence length and at a longer one.

Off, each memory keeps its learned initial weights for the whole sequence
(:func:`tapered_megatron.models.in_context_memory`); everything else is the same model on the
same windows. ``gap = loss(off) - loss(on)`` in nats: positive where the memory's in-context
learning helps, about 0 where the trained model does not use it (a static network).

Command line (the last stdout line with ``--json`` is one JSON object: ``probes``, a list of
``{"seq_len", "on", "off", "gap", "tokens"}``, plus ``split`` and ``source``)::

    python -m tapered_megatron.eval.memory_probe --model OUT|--checkpoint DIR --data-path PREFIX \\
        [--seq-len N] [--long-factor 4] [--max-tokens N] [--json]

The long evaluation cuts the same tokens into windows of ``long-factor`` times ``--seq-len``
(default: the training sequence length), so it tests the memory beyond the context the model
was trained on. A model without in-context memory is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from tapered_megatron.eval.common import (
    emit_json,
    fail,
    load_with_tokens,
    model_data_parser,
    windows,
)
from tapered_megatron.eval.perplexity import perplexity_of
from tapered_megatron.export.load import ExportError
from tapered_megatron.models import in_context_memory


@dataclass(frozen=True)
class MemoryProbe:
    """Mean next-token loss at ``seq_len`` with the in-context memory on and off."""

    seq_len: int
    on: float
    off: float
    tokens: int

    @property
    def gap(self) -> float:
        """What switching the memory off costs, in nats."""
        return self.off - self.on

    def as_dict(self) -> dict[str, float | int]:
        """The probe as one JSON-ready record (``gap`` included)."""
        return {**asdict(self), "gap": self.gap}


def memory_probe(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | torch.nn.Module,
    stream: np.ndarray | torch.Tensor,
    seq_lens: list[int],
    batch_size: int = 8,
    device: str = "cpu",
) -> list[MemoryProbe]:
    """Loss of ``model(inputs, labels)`` over ``stream`` cut into windows of each of
    ``seq_lens``, with the in-context memory on and off; raises ``ValueError`` when the model
    has none."""
    probes = []
    for seq_len in seq_lens:
        losses = {}
        for on in (True, False):
            with in_context_memory(model, on) as n:
                if not n:
                    raise ValueError("the model has no in-context memory (titans, hope_attention)")
                r = perplexity_of(model, windows(stream, seq_len, batch_size, device))
            losses[on] = r
        probes.append(MemoryProbe(seq_len, losses[True].loss, losses[False].loss, r.tokens))
    return probes


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    ap = model_data_parser(
        "python -m tapered_megatron.eval.memory_probe",
        "Validation loss with the in-context memory on and off, at two sequence lengths.",
    )
    ap.add_argument("--long-factor", type=int, default=4, help="long windows: this x --seq-len")
    ap.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    try:
        if a.long_factor < 1:
            raise ExportError(f"--long-factor {a.long_factor}: give 1 or more")
        loaded, stream, split = load_with_tokens(a, a.max_tokens)
        seq_len = a.seq_len or loaded.cfg.model.seq_len
        lens = [seq_len] if a.long_factor == 1 else [seq_len, a.long_factor * seq_len]
        probes = memory_probe(loaded.module, stream, lens, a.batch_size, a.device)
    except (ExportError, FileNotFoundError, ValueError) as e:
        return fail(e)
    for p in probes:
        print(
            f"{loaded.source}: seq_len {p.seq_len}: loss {p.on:.4f} with the in-context memory, "
            f"{p.off:.4f} without (gap {p.gap:+.4f} nats over {p.tokens:,} tokens)"
        )
    if a.json:
        emit_json(
            {
                "probes": [p.as_dict() for p in probes],
                "split": split,
                "source": loaded.source,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
