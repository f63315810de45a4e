"""The paper's mechanistic analysis (arXiv 2606.23670): what each layer writes.

Per layer ``l``, averaged over tokens::

    rho_block(l) = cos(h_{l+1} - h_l, h_l)     # the whole block's update vs its input stream
    rho_mlp(l)   = cos(F_l(z_l), h_l)          # the MLP's output vs the block's input stream

near 0: the layer writes new directions; near 1: it reinforces the residual stream. Works for
every architecture (the MLP slot's output is read with a forward hook, so Hope's CMS counts as
``F_l``).

Command line (``--json``: the last stdout line is ``{"layers": [{"layer", "rho_block",
"rho_mlp"}, ...], "tokens": N}``)::

    python -m tapered_megatron.eval.alignment --model OUT|--checkpoint DIR --data-path PREFIX \\
        [--tokens 16384] [--plot rho.png] [--json]

From Python: :func:`alignment_of` with our single-process module and batches of token ids;
during training (``eval.alignment``) the trainer measures the same with
:class:`~tapered_megatron.training.alignment.AlignmentProbe`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import asdict

import torch

from tapered_megatron.eval.common import (
    emit_json,
    fail,
    load_with_tokens,
    model_data_parser,
    windows,
)
from tapered_megatron.export.load import ExportError
from tapered_megatron.models import LanguageModel
from tapered_megatron.training.alignment import AlignmentProbe, LayerAlignment, figure


@torch.no_grad()
def alignment_of(
    model: LanguageModel, batches: torch.Tensor | Iterable[torch.Tensor]
) -> tuple[list[LayerAlignment], int]:
    """``rho_block`` and ``rho_mlp`` of every layer, averaged over all tokens of ``batches``
    (token ids ``[b, s]``, or an iterable of them), measured on the model's own forward pass;
    also returns the token count."""
    if isinstance(batches, torch.Tensor):
        batches = [batches]
    device = next(model.parameters()).device
    count = 0
    with AlignmentProbe(model, model.cfg.model.layers, device) as probe:
        for ids in batches:
            model(ids)
            probe.commit()
            count += ids.numel()
    if count == 0:
        raise ValueError("alignment_of: no tokens")
    return probe.result(), count


def table(rows: list[LayerAlignment], widths: Iterable[int]) -> str:
    """A plain-text table of the per-layer values beside each layer's MLP width."""
    lines = ["layer  d_ff   rho_block  rho_mlp"]
    for r, w in zip(rows, widths):
        lines.append(f"{r.layer:5d} {w:5d}  {r.rho_block:9.4f}  {r.rho_mlp:7.4f}")
    return "\n".join(lines)


def plot(rows: list[LayerAlignment], path: str, title: str) -> None:
    """Both curves against depth, saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    ap = model_data_parser(
        "python -m tapered_megatron.eval.alignment",
        "Per-layer rho_block and rho_mlp (arXiv 2606.23670).",
    )
    ap.add_argument("--tokens", type=int, default=16384, help="tokens to average over")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    try:
        loaded, stream, split = load_with_tokens(a, a.tokens + 1)
    except (ExportError, FileNotFoundError) as e:
        return fail(e)
    seq_len = a.seq_len or loaded.cfg.model.seq_len
    inputs = (x for x, _ in windows(stream, seq_len, a.batch_size, a.device))
    rows, tokens = alignment_of(loaded.module, inputs)
    print(table(rows, loaded.cfg.taper_plan.widths))
    print(f"{loaded.source}: {tokens:,} tokens of the {split} split, windows of {seq_len}")
    if a.plot:
        plan = loaded.cfg.taper_plan
        plot(rows, a.plot, f"{loaded.cfg.model.arch}, {plan.schedule} taper, {tokens:,} tokens")
        print(f"wrote {a.plot}")
    if a.json:
        emit_json({"layers": [asdict(r) for r in rows], "tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
