#!/usr/bin/env python
"""The cost of the checkpoint manifest (sha256 of every file) against the save and load it guards.

Builds the trainer of ``pretrain/main.py`` (one rank, ZeRO per ``--ds_config``) on a model
whose checkpoint is a few hundred MB (``--shape``), takes one optimizer step (so Adam's moments
exist), then times, ``--rounds`` times each:

* ``save``: the trainer's save (DeepSpeed's files, RNG, config, and the manifest: every file
  hashed before ``complete`` is written); ``hash``: the manifest's hashing alone
  (``manifest.digests`` on the files just written, so from the page cache);
* ``verify``: the hash check resume makes (``resume.hash_problem``: every file re-hashed
  against the manifest); ``load``: resume's load (``safe_load.verify_tag`` of every ``.pt`` as
  plain data, then the engine's ``load_checkpoint`` and the RNG states);
* ``sha256_mem``: hashlib's sha256 over a 256 MiB buffer in memory (the CPU bound).

Prints one JSON line: sizes, median seconds, throughputs, the manifest's share of save and of
resume, and the implied hashing time of a 7B checkpoint (``transformer_7b``, bf16 weights with
fp32 master and Adam state, ``train.universal_checkpoint`` per the preset) on one core and per
rank when 64 ranks share it.

    python scripts/bench_checkpoint_hash.py --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import emit, stamp

SHAPE = [
    "--model.d_model", "512", "--model.layers", "4", "--model.heads", "8", "--model.d_ff",
    "2048", "--model.vocab_size", "8192", "--model.seq_len", "64",
    "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
]  # fmt: skip


def _sha256_mem(size: int = 256 << 20) -> float:
    """Seconds for hashlib's sha256 over ``size`` bytes already in memory."""
    buf = os.urandom(1 << 20) * (size >> 20)
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    return time.perf_counter() - t0


def _implied_7b(per_s: float, ranks: int = 64) -> dict:
    """Hashing time of the 7B preset's checkpoint at ``per_s`` bytes/s per core."""
    from tapered_megatron.checkpoint.save import checkpoint_bytes
    from tapered_megatron.config import load_config

    empty = tempfile.mkdtemp(prefix="bench_ckpt_7b_")  # no saved checkpoint: the estimate
    cfg = load_config("transformer_7b", ["--train.save_dir", empty])
    size = checkpoint_bytes(cfg, half=True)
    os.rmdir(empty)
    return {
        "ckpt_gb": round(size / 1e9, 1),
        "hash_s_one_core": round(size / per_s, 1),
        f"hash_s_per_rank_{ranks}_ranks": round(size / per_s / ranks, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ds_config", default="ds_configs/zero0.json")
    ap.add_argument("--tmp", default=None, help="folder for the checkpoints (default: $TMPDIR)")
    args, overrides = ap.parse_known_args()

    import torch

    from tapered_megatron.checkpoint import resume, safe_load
    from tapered_megatron.checkpoint.layout import tag_of
    from tapered_megatron.checkpoint.manifest import digests, tag_files
    from tapered_megatron.config import load_config
    from tapered_megatron.models import count_model
    from tapered_megatron.training import launch
    from tapered_megatron.training.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.tmp))
    try:
        iters = args.rounds + 1
        cfg = load_config(
            "quickstart",
            [*SHAPE, *overrides, "--train.iters", str(iters), "--eval.interval", "0",
             "--train.save_dir", str(work / "ckpt"), "--train.keep_last", "100"],
        )  # fmt: skip
        ds, layout = launch.resolve(cfg, launch.load_ds_config(args.ds_config), 1)
        launch.init_distributed()
        trainer = Trainer(cfg, ds, layout, time.time())
        batches = trainer.batches(trainer.train_ds, iters * layout.global_batch_size, 0)
        trainer.train_step(batches, want_norm=False)  # Adam's moments exist from here
        times: dict[str, list[float]] = {k: [] for k in ("save", "hash", "verify", "load")}
        size = files = 0
        for it in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            tag_dir = trainer.save(it)
            times["save"].append(time.perf_counter() - t0)
            names = tag_files(tag_dir)
            files, size = len(names), sum((tag_dir / n).stat().st_size for n in names)
            t0 = time.perf_counter()
            digests(tag_dir)
            times["hash"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert resume.hash_problem(tag_dir) is None
            times["verify"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            safe_load.verify_tag(tag_dir)
            trainer.load(tag_dir.parent, tag_of(it))
            times["load"].append(time.perf_counter() - t0)
            shutil.rmtree(tag_dir)
        med = {k: statistics.median(v) for k, v in times.items()}
        mem = min(_sha256_mem() for _ in range(3))
        per_s = size / med["hash"]
        emit(
            {
                "bench": "checkpoint_hash",
                **stamp(),
                "params": int(count_model(cfg).params_total),
                "ckpt_mb": round(size / 1e6, 1),
                "files": files,
                "rounds": args.rounds,
                **{f"{k}_s": round(v, 3) for k, v in med.items()},
                "hash_mb_per_s": round(per_s / 1e6, 1),
                "sha256_mem_mb_per_s": round((256 << 20) / mem / 1e6, 1),
                "hash_share_of_save": round(med["hash"] / med["save"], 3),
                "verify_share_of_resume": round(med["verify"] / (med["verify"] + med["load"]), 3),
                "implied_7b": _implied_7b(per_s),
            }
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
