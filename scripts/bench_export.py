"""Peak memory of ``python -m tapered_megatron.export`` on a multi-shard checkpoint.

    python scripts/bench_export.py [--config transformer_440m] [--layers 4] [--work DIR]
        [--checkpoint DIR] [--max-shard-size 100MB] [--dtype float32|bfloat16]
        [--section.key value ...]

Without ``--checkpoint``, a real training run makes one: the preset's widths cut to
``--layers`` layers (its taper plan over that many layers), one optimizer step of one
32-token sample through ``pretrain/main.py`` (one process, ZeRO-0, fp32), saved through the
trainer's save path with its universal copy, on a random-token dataset written under
``--work``. The export then runs in a child process, which reports its resident memory from
``/proc/self/status``: ``footprint`` (``VmRSS`` after importing the export code and its
libraries, before any work) and ``peak`` (``VmHWM``, reset after the footprint was read). The
claim checked: ``peak - footprint`` stays near the largest tensor plus one shard, never the
whole model. One JSON line (MiB; ``largest_tensor`` in the export's dtype and in fp32, as read
from the checkpoint; ``largest_shard`` the largest file written).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import ROOT, emit, stamp

MiB = 2**20


def _status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def train_checkpoint(work: Path, config: str, layers: int, overrides: list[str]) -> Path:
    """Train the cut preset for one step in a real ``pretrain/main.py`` process; its save dir."""
    import numpy as np

    from tapered_megatron.data import write_indexed_dataset

    work.mkdir(parents=True, exist_ok=True)
    prefix = str(work / "random_text_document")
    rng = np.random.default_rng(0)
    write_indexed_dataset(prefix, [rng.integers(0, 255, 64).tolist() for _ in range(64)])
    save = work / "ckpt"
    cmd = [
        sys.executable, str(ROOT / "pretrain" / "main.py"),
        "--ds_config", str(ROOT / "ds_configs" / "zero0.json"), "--config", config,
        "--model.layers", str(layers), "--model.seq_len", "32",
        "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
        "--train.iters", "1", "--train.warmup_iters", "0", "--train.save_interval", "1",
        "--eval.interval", "0", "--data.path", prefix, "--data.cache_dir", str(work / "cache"),
        "--train.save_dir", str(save), *overrides,
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"training failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return save


def child(checkpoint: str, out: str, dtype: str, max_shard_size: str) -> None:
    """The measured process: import, read the footprint, export, read the peak."""
    # everything the export imports, imported before the footprint is read
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401
    from transformers import GenerationConfig  # noqa: F401

    import tapered_megatron.data
    import tapered_megatron.hf.configuration
    import tapered_megatron.hf.tokenization  # noqa: F401
    from tapered_megatron.export.__main__ import main

    footprint = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")
    t0 = time.perf_counter()
    argv = ["--checkpoint", checkpoint, "--out", out, "--dtype", dtype]
    rc = main([*argv, "--max_shard_size", max_shard_size, "--overwrite"])
    seconds = time.perf_counter() - t0
    print(json.dumps({"rc": rc, "footprint_kib": footprint, "peak_kib": _status_kib("VmHWM"),
                      "seconds": seconds}))  # fmt: skip


def measure(checkpoint: Path, out: Path, dtype: str, max_shard_size: str) -> dict[str, Any]:
    """Export ``checkpoint`` in a child process; its footprint, peak and the files written."""
    import torch
    from safetensors import safe_open

    from tapered_megatron.checkpoint.consolidate import resolve_checkpoint
    from tapered_megatron.models import build_model

    cmd = [sys.executable, __file__, "--child", str(checkpoint), str(out), dtype, max_shard_size]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"export failed:\n{(p.stdout + p.stderr)[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["rc"] != 0:
        raise SystemExit(f"export exited {r['rc']}:\n{p.stderr[-3000:]}")
    cfg = resolve_checkpoint(checkpoint).cfg
    params = list(build_model(cfg, device="meta").parameters())
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    shards = sorted(out.glob("model*.safetensors"))
    n_tensors = 0
    for f in shards:
        with safe_open(str(f), "pt") as s:
            n_tensors += len(list(s.keys()))
    largest = max(q.numel() for q in params)
    return {
        "params": sum(q.numel() for q in params),
        "tensors": n_tensors,
        "shards": len(shards),
        "model_mib": sum(q.numel() for q in params) * size / MiB,
        "largest_tensor_mib": largest * size / MiB,
        "largest_tensor_fp32_mib": largest * 4 / MiB,
        "largest_shard_mib": max(f.stat().st_size for f in shards) / MiB,
        "footprint_mib": r["footprint_kib"] / 1024,
        "peak_mib": r["peak_kib"] / 1024,
        "peak_above_footprint_mib": (r["peak_kib"] - r["footprint_kib"]) / 1024,
        "seconds": r["seconds"],
    }


def main() -> None:
    """The command line; see the module docstring."""
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="transformer_440m")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--work", default="bench_export_work", help="checkpoint, data and exports")
    ap.add_argument("--checkpoint", default=None, help="export this instead of training one")
    ap.add_argument("--max-shard-size", default="100MB")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a, overrides = ap.parse_known_args()
    work = Path(a.work)
    ckpt = Path(a.checkpoint) if a.checkpoint else train_checkpoint(
        work, a.config, a.layers, overrides
    )  # fmt: skip
    result = measure(ckpt, work / f"export-{a.dtype}", a.dtype, a.max_shard_size)
    emit({"bench": "export_memory", "config": a.config, "layers": a.layers,
          "max_shard_size": a.max_shard_size, "dtype": a.dtype, **result, **stamp()})  # fmt: skip


if __name__ == "__main__":
    main()
