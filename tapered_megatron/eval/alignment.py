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
during training (``eval.alignment``) the trainer holds an :class:`AlignmentProbe` on its
engine's module (any TP/PP/DP/ZeRO layout) while the validation batches run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tapered_megatron.eval.common import (
    add_data_args,
    add_model_args,
    emit_json,
    fail,
    load_from_args,
    token_stream,
    windows,
)
from tapered_megatron.export.load import ExportError
from tapered_megatron.models import LanguageModel
from tapered_megatron.models.language_model import Block


@dataclass(frozen=True)
class LayerAlignment:
    """Token-averaged cosines of one layer."""

    layer: int
    rho_block: float
    rho_mlp: float


class AlignmentProbe:
    """Forward hooks that sum ``rho_block`` and ``rho_mlp`` over the tokens of every layer a
    module runs: a whole model, or one pipeline stage's blocks and block halves.

    A layer's sums from one forward pass wait in ``pending`` until :meth:`commit`; a later pass
    over the same input replaces them, so only the model's real pass counts (Hope's teach
    signal runs the blocks once before it). ``commit_each_pass=True`` commits as soon as a
    layer finishes, for pipeline engines, which run several micro-batches per call and never
    run a block twice. A layer whose two halves sit on different pipeline stages is not
    measured (its result is NaN). Use as a context manager: hooks live inside the ``with``.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: int,
        device: torch.device | str = "cpu",
        commit_each_pass: bool = False,
    ) -> None:
        self.blocks = [m for m in module.modules() if isinstance(m, Block)]
        self.commit_each_pass = commit_each_pass
        self.sums = torch.zeros(layers, 3, dtype=torch.float64, device=device)
        self.pending: dict[int, torch.Tensor] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._mlp_out: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []

    def __enter__(self) -> AlignmentProbe:
        for block in self.blocks:
            if "mixer" in block.halves:
                self._hooks.append(block.register_forward_pre_hook(self._block_input))
            if "mlp" in block.halves:
                self._hooks.append(block.mlp.register_forward_hook(self._mlp_output(block.layer)))
                self._hooks.append(block.register_forward_hook(self._block_output))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._inputs.clear()
        self._mlp_out.clear()

    def _block_input(self, block: Block, args: tuple) -> None:
        self._inputs[block.layer] = args[0]

    def _mlp_output(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            self._mlp_out[layer] = out

        return hook

    def _block_output(self, block: Block, args: tuple, out: torch.Tensor) -> None:
        h = self._inputs.pop(block.layer, None)
        mlp = self._mlp_out.pop(block.layer)
        if h is None:  # the layer's first half ran on another pipeline stage
            return
        rho_block = F.cosine_similarity((out - h).float(), h.float(), dim=-1).double().sum()
        rho_mlp = F.cosine_similarity(mlp.float(), h.float(), dim=-1).double().sum()
        tokens = torch.tensor(h[..., 0].numel(), dtype=torch.float64, device=rho_block.device)
        self.pending[block.layer] = torch.stack([rho_block, rho_mlp, tokens])
        if self.commit_each_pass:
            self.commit()

    def commit(self) -> None:
        """Add the pending sums of the last pass to the totals."""
        for layer, sums in self.pending.items():
            self.sums[layer] += sums.to(self.sums.device)
        self.pending.clear()

    def result(self, all_ranks: bool = False) -> list[LayerAlignment]:
        """Token-averaged values per layer (NaN where no token was seen). ``all_ranks``: sum
        over every rank of the process group first (collective; TP replicas cancel out)."""
        sums = self.sums.clone()
        if all_ranks and dist.is_initialized():
            dist.all_reduce(sums)
        rows = []
        for layer, (rho_block, rho_mlp, tokens) in enumerate(sums.tolist()):
            n = tokens if tokens > 0 else float("nan")
            rows.append(LayerAlignment(layer, rho_block / n, rho_mlp / n))
        return rows


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


def figure(rows: list[LayerAlignment], title: str) -> Any:
    """Both curves against depth as a matplotlib figure (close it with ``plt.close``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    layers = [r.layer for r in rows]
    ax.plot(layers, [r.rho_block for r in rows], "o-", label=r"$\rho_{block}$")
    ax.plot(layers, [r.rho_mlp for r in rows], "s--", label=r"$\rho_{mlp}$")
    ax.axhline(0.0, color="grey", lw=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine with the residual stream")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(rows: list[LayerAlignment], path: str, title: str) -> None:
    """Both curves against depth, saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.eval.alignment",
        description="Per-layer rho_block and rho_mlp (arXiv 2606.23670).",
    )
    add_model_args(ap)
    add_data_args(ap)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens to average over")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = ap.parse_args(argv)
    try:
        loaded = load_from_args(a)
        stream, split = token_stream(a, loaded, a.tokens + 1)
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
