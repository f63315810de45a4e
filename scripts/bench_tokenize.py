#!/usr/bin/env python
"""tokenize.py throughput vs its limit: raw sentencepiece encode in one process x worker count.

For each corpus (the shipped sample corpus, and a larger jsonl made by repeating it) this times
(1) the limit's base: one process decoding the same jsonl lines and calling ``encode`` on every
document, nothing else; (2) ``data_tools/tokenize.py --workers N`` end to end (read, parse,
encode, write .bin/.idx) as a subprocess. Prints one JSON line per corpus with the ratio
``(raw / N) / tokenize`` (goal >= 0.8). Shared-CPU machines make wall-clock ratios noisy (best
of ``--repeats``; the load average is printed), so it also reports ``cpu_efficiency``: the raw
encode's CPU seconds over tokenize.py's (main process + workers), which is the ratio reachable
when N cores are free.

    python scripts/bench_tokenize.py --workers 2 --large-mb 40
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tapered_megatron.data import load_tokenizer, prepare_sample_corpus  # noqa: E402
from tapered_megatron.data.sample_corpus import sample_corpus_path  # noqa: E402


def raw_encode_seconds(path: Path, model: str) -> tuple[float, float]:
    """One process: read lines, json-decode, encode each document. Returns (wall s, CPU s)."""
    tok = load_tokenizer(model)
    t0, c0 = time.perf_counter(), time.process_time()
    with open(path, "rb") as f:
        for line in f:
            tok.sp.encode(json.loads(line)["text"], num_threads=1)
    return time.perf_counter() - t0, time.process_time() - c0


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def tokenize_seconds(path: Path, model: str, workers: int, out: Path) -> tuple[float, float, dict]:
    cmd = [sys.executable, str(REPO / "data_tools/tokenize.py"), "--input", str(path),
           "--output-prefix", str(out), "--tokenizer-model", model, "--append-eod",
           "--workers", str(workers), "--no-progress", "--log-interval", "0"]  # fmt: skip
    t0, c0 = time.perf_counter(), children_cpu()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    return wall, cpu, json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--large-mb", type=float, default=40.0, help="size of the generated jsonl")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(REPO / ".cache/tapered_megatron"))
    args = ap.parse_args()
    model, _ = prepare_sample_corpus(args.cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sample = tmp / "sample.jsonl"
        lines = gzip.decompress(sample_corpus_path().read_bytes()).splitlines(keepends=True)
        sample.write_bytes(b"".join(lines))
        large = tmp / "large.jsonl"
        rng = random.Random(0)
        with open(large, "wb") as f:
            written = 0
            while written < args.large_mb * 1e6:
                block = lines[:]
                rng.shuffle(block)
                data = b"".join(block)
                f.write(data)
                written += len(data)
        for name, path in (("sample", sample), ("large", large)):
            raws = [raw_encode_seconds(path, model) for _ in range(args.repeats)]
            raw, raw_cpu = min(r[0] for r in raws), min(r[1] for r in raws)
            runs = [
                tokenize_seconds(path, model, args.workers, tmp / name) for _ in range(args.repeats)
            ]
            wall, cpu, summary = min(runs, key=lambda r: r[0])
            limit = raw / args.workers
            print(
                json.dumps(
                    {
                        "bench": "tokenize",
                        "corpus": name,
                        "mb": round(path.stat().st_size / 1e6, 1),
                        "documents": summary["documents"]["text"],
                        "tokens": summary["tokens"]["text"],
                        "workers": args.workers,
                        "raw_encode_1proc_s": round(raw, 2),
                        "limit_s": round(limit, 2),
                        "tokenize_wall_s": round(wall, 2),
                        "tokenize_inner_s": round(summary["seconds"], 2),
                        "tokenize_mb_per_s": round(path.stat().st_size / 1e6 / wall, 2),
                        "ratio_to_limit": round(limit / wall, 3),
                        "ratio_to_limit_inner": round(limit / summary["seconds"], 3),
                        "raw_encode_cpu_s": round(raw_cpu, 2),
                        "tokenize_cpu_s": round(cpu, 2),
                        "cpu_efficiency": round(raw_cpu / cpu, 3),
                        "loadavg_1m": os.getloadavg()[0],
                        "cpus": os.cpu_count(),
                        "machine": platform.node(),
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
