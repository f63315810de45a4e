"""Per-rank activation memory of one training forward with and without sequence parallelism,
measured against the cost model's prediction.

    python scripts/bench_sp_memory.py [--tp 2] [--micro-batch 2] [--archs transformer titans ...]

For each architecture, ``--tp`` gloo ranks build the model of the library shape (``--layers``
layers) at TP ``--tp``, without and with ``parallel.sequence_parallel``, and each rank counts the
bytes autograd keeps for backward in one forward of the fused loss (``saved_tensors_hooks``,
unique storages, parameters and the token ids excluded:
``pipeline.profile.model_saved_bytes``). The
prediction is the sum of the cost model's per-unit activations of one micro-batch
(``pipeline.cost.unit_costs``, fp32, no checkpointing) for the same shape. Prints one JSON line
per architecture: measured and predicted bytes per rank, their ratio, and the saving SP brings
(measured and predicted).
"""

from __future__ import annotations

import argparse

from bench_common import LIBRARY_SHAPE, emit, stamp

from tapered_megatron.architectures import BUILT_IN
from tapered_megatron.config import Config, load_config
from tapered_megatron.parallel import init_model_parallel, model_parallel_seed
from tapered_megatron.parallel.local_launch import run_workers
from tapered_megatron.planning import cost as costlib
from tapered_megatron.planning.profile import model_saved_bytes

ARCHS = BUILT_IN


def _cfg(arch: str, a: argparse.Namespace, sp: bool) -> Config:
    shape = list(LIBRARY_SHAPE)
    shape[shape.index("--model.layers") + 1] = str(a.layers)
    return load_config(
        "quickstart",
        [
            *shape, "--model.arch", arch,
            "--parallel.tp", str(a.tp), "--parallel.sequence_parallel", str(sp).lower(),
            "--train.micro_batch_size", str(a.micro_batch),
        ],
    )  # fmt: skip


def _worker(rank: int, world: int, a: argparse.Namespace) -> dict[str, float]:
    init_model_parallel(tp=world, pp=1)
    model_parallel_seed(1234)
    return {
        f"{arch}:{sp}": model_saved_bytes(_cfg(arch, a, sp), a.micro_batch)
        for arch in a.archs
        for sp in (False, True)
    }


def predicted(cfg: Config, a: argparse.Namespace, sp: bool) -> float:
    """Activation bytes of one micro-batch on one rank by the cost model (fp32, no recompute)."""
    shape = costlib.RunShape(
        micro_batch_size=a.micro_batch,
        seq_len=cfg.model.seq_len,
        micro_batches=1,
        tp=a.tp,
        sequence_parallel=sp,
        precision="fp32",
        pipeline=False,
    )
    return sum(u.act for u in costlib.unit_costs(cfg, shape, costlib.get_device("cpu")))


def main() -> None:
    """CLI entry (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    a = ap.parse_args()
    per_rank = run_workers(_worker, a.tp, a)
    for arch in a.archs:
        row: dict = {"bench": "sp_memory", "arch": arch, "tp": a.tp, "layers": a.layers}
        row["micro_batch"] = a.micro_batch
        for sp in (False, True):
            key = "sp" if sp else "no_sp"
            measured = [r[f"{arch}:{sp}"] for r in per_rank]
            pred = predicted(_cfg(arch, a, sp), a, sp)
            row[f"{key}_measured_mib"] = [round(m / 2**20, 3) for m in measured]
            row[f"{key}_predicted_mib"] = round(pred / 2**20, 3)
            row[f"{key}_measured_over_predicted"] = round(max(measured) / pred, 4)
        ms = [row[f"{k}_measured_mib"][0] for k in ("no_sp", "sp")]
        ps = [row[f"{k}_predicted_mib"] for k in ("no_sp", "sp")]
        row["saving_measured"] = round(1 - ms[1] / ms[0], 4)
        row["saving_predicted"] = round(1 - ps[1] / ps[0], 4)
        emit({**row, **stamp()})


if __name__ == "__main__":
    main()
