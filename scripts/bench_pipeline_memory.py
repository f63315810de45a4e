"""Peak memory per pipeline stage of a PP=2 training run, this tree against a reference tree.

    git archive fa2ad84 | (mkdir -p /tmp/ref && tar -x -C /tmp/ref)     # the tree to compare with
    python scripts/bench_pipeline_memory.py --reference /tmp/ref [--rounds 2] [--seq-len 2048]

Both trees train the same small model with a large vocabulary (32,000, sequence 2,048: the LM
head's logits are the largest tensor of the run) through ``pretrain/main.py`` on two gloo ranks
(PP=2, DeepSpeed's uniform split: embedding + layer 0 | layer 1 + head), on the same synthetic
token corpus, for a few iterations. Each rank reports its peak resident memory (``ru_maxrss``);
runs of the two trees alternate and the smallest peak of each is kept. Prints one JSON line with
the per-stage peaks, the last stage's drop and the size of one micro-batch's fp32 logits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_common import ROOT, emit, stamp

WRAPPER = """
import json, resource, runpy, sys
sys.argv = ["pretrain/main.py", *sys.argv[1:]]
code = 0
try:
    runpy.run_path("pretrain/main.py", run_name="__main__")
except SystemExit as e:
    code = e.code or 0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("BENCH_PEAK " + json.dumps({"code": code, "peak_bytes": peak}), flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def corpus(folder: Path, vocab: int) -> str:
    """Random-token documents (the data does not matter for memory) as a Megatron dataset."""
    from tapered_megatron.data import write_indexed_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab - 1, int(rng.integers(500, 3000))).tolist() for _ in range(200)]
    prefix = str(folder / "bench_text_document")
    write_indexed_dataset(prefix, docs)
    return prefix


def run(tree: Path, args: list[str], out: Path) -> list[int]:
    """Peak resident bytes of each of the two ranks of one PP=2 run of ``tree``."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-c", WRAPPER, f"--local_rank={rank}", *args]
        cmd += ["--train.save_dir", str(out / "ckpt")]
        procs.append(
            subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    peaks = []
    for p in procs:
        text, _ = p.communicate(timeout=1800)
        line = next((x for x in text.splitlines() if x.startswith("BENCH_PEAK ")), None)
        if p.returncode != 0 or line is None or json.loads(line[11:])["code"]:
            raise RuntimeError(f"{tree}: a rank failed:\n{text[-3000:]}")
        peaks.append(int(json.loads(line[11:])["peak_bytes"]))
    return peaks


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, help="source tree to compare with")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each tree")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args(argv)
    trees = {"reference": Path(a.reference).resolve(), "current": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = corpus(Path(tmp), a.vocab)
        args = [
            "--ds_config", str(ROOT / "ds_configs" / "pipeline.json"),
            "--model.vocab_size", str(a.vocab), "--model.seq_len", str(a.seq_len),
            "--model.d_model", "128", "--model.heads", "2", "--model.layers", "2",
            "--model.d_ff", "256", "--taper.multiple", "16",
            "--parallel.pp", "2", "--parallel.partition", "uniform",
            "--train.micro_batch_size", "1", "--train.global_batch_size", "4",
            "--train.iters", str(a.iters), "--train.warmup_iters", "1",
            "--eval.interval", "0", "--logging.interval", "1",
            "--data.path", prefix, "--data.cache_dir", str(Path(tmp) / "cache"),
        ]  # fmt: skip
        peaks: dict[str, list[list[int]]] = {k: [] for k in trees}
        for r in range(a.rounds):
            for name, tree in trees.items():
                peaks[name].append(run(tree, args, Path(tmp) / f"{name}{r}"))
    best = {k: [min(p[s] for p in v) for s in range(2)] for k, v in peaks.items()}
    logits = a.seq_len * a.vocab * 4  # one micro-batch of fp32 logits (CPU: fp32 training)
    drop = best["reference"][1] - best["current"][1]
    emit(
        {
            "bench": "pipeline_memory",
            **stamp(),
            "pp": 2,
            "seq_len": a.seq_len,
            "vocab": a.vocab,
            "micro_batch_size": 1,
            "micro_batches": 4,
            "reference_tree": str(trees["reference"]),
            "peak_bytes": best,
            "all_runs": peaks,
            "last_stage_drop_bytes": drop,
            "logits_bytes": logits,
            "drop_over_logits": round(drop / logits, 3),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
