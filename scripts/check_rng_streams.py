"""Random streams under TP=2 on the accelerator: replicated dropout masks agree, TP-local differ.

Launches 2 ranks (gloo, one TP group); each seeds with ``model_parallel_seed`` and draws dropout
masks on ``get_accelerator().current_device_name()`` (``cuda:0`` on a GPU, shared by both
ranks): one on the default stream (a replicated region, e.g. a block's output), one under
``get_rng_tracker().fork()`` (a TP-split region), then one more on the default stream (the fork
hands it back untouched). The masks are compared on the CPU. Prints one JSON line::

    {"check": "rng_streams", "device": "cuda:0", "replicated_equal": true,
     "tp_local_differ": true, "ok": true}

and exits non-zero when not ok.

    python3 scripts/check_rng_streams.py
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

from tapered_megatron.parallel import get_rng_tracker, init_model_parallel, model_parallel_seed
from tapered_megatron.parallel.local_launch import run_workers


def mask_worker(rank: int, world: int, seed: int, numel: int, p: float) -> dict:
    """One TP rank: seed, then draw ``replicated``, ``tp_local`` (forked) and ``after`` masks."""
    init_model_parallel(tp=world, pp=1)
    model_parallel_seed(seed)
    device = get_accelerator().current_device_name()
    ones = torch.ones(numel, device=device)
    masks = {"replicated": F.dropout(ones, p) != 0}
    with get_rng_tracker().fork():
        masks["tp_local"] = F.dropout(ones, p) != 0
    masks["after"] = F.dropout(ones, p) != 0
    return {"device": device, **{k: m.cpu().numpy() for k, m in masks.items()}}


def check(seed: int = 1234, numel: int = 4096, p: float = 0.5) -> dict:
    """Run :func:`mask_worker` on 2 ranks and compare their masks."""
    a, b = run_workers(mask_worker, 2, seed, numel, p)
    replicated_equal = all(np.array_equal(a[k], b[k]) for k in ("replicated", "after"))
    tp_local_differ = not np.array_equal(a["tp_local"], b["tp_local"])
    return {
        "check": "rng_streams",
        "device": a["device"],
        "replicated_equal": replicated_equal,
        "tp_local_differ": tp_local_differ,
        "ok": replicated_equal and tp_local_differ,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--numel", type=int, default=4096, help="mask elements per draw")
    args = ap.parse_args()
    result = check(args.seed, args.numel)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
