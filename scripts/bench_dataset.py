#!/usr/bin/env python
"""GPT dataset: index build time (sample corpus; a synthetic 10B-token set of lengths only, both
in memory and through real files with a sparse .bin) and random sample reads/s. Prints one JSON
line per measurement.

    python scripts/bench_dataset.py                 # sample corpus + 10B-token index build
    python scripts/bench_dataset.py --tokens 1e9    # smaller synthetic scale
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from bench_common import emit, stamp

from tapered_megatron.data import build_gpt_datasets, prepare_sample_corpus
from tapered_megatron.data.gpt_dataset import build_indices
from tapered_megatron.data.indexed import HEADER, MAGIC


def scale(tokens: float, seq_len: int, mean_doc: int) -> dict:
    """Build the three indices for ``tokens`` tokens of random-length documents (in-process)."""
    rng = np.random.default_rng(0)
    n_docs = int(tokens // mean_doc)
    lengths = rng.integers(1, 2 * mean_doc, n_docs, dtype=np.int64).astype(np.int32)
    total = int(lengths.sum())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    doc_idx, sample_idx, shuffle_idx = build_indices(
        lengths, np.arange(n_docs), seq_len, (total - 1) // seq_len, 1234
    )
    elapsed = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "bench": "index_build_synthetic",
        "tokens": total,
        "documents": n_docs,
        "seq_len": seq_len,
        "samples": int(shuffle_idx.size),
        "build_s": round(elapsed, 2),
        "peak_rss_mib": round(rss / 1024),
        "rss_growth_mib": round((rss - rss0) / 1024),
        "index_mib": round((doc_idx.nbytes + sample_idx.nbytes + shuffle_idx.nbytes) / 2**20),
        **stamp(),
    }


def scale_on_disk(tokens: float, seq_len: int, mean_doc: int) -> dict:
    """The full path on files: a real .idx of ``tokens`` tokens and a sparse .bin (no disk use),
    opened, validated, split 969,30,1, indices built and cached, then memory-mapped."""
    rng = np.random.default_rng(0)
    n_docs = int(tokens // mean_doc)
    sizes = rng.integers(1, 2 * mean_doc, n_docs, dtype=np.int64).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = f"{tmp}/synthetic_text_document"
        pointers = np.zeros(n_docs, np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * 2, out=pointers[1:])
        with open(prefix + ".idx", "wb") as f:
            f.write(HEADER.pack(MAGIC, 1, 8, n_docs, n_docs + 1))
            f.write(sizes.tobytes() + pointers.tobytes())
            f.write(np.arange(n_docs + 1, dtype=np.int64).tobytes())
        with open(prefix + ".bin", "wb") as f:
            f.truncate(int(sizes.sum()) * 2)  # sparse: 20 GB of zeros that take no disk
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        train, _valid, _ = build_gpt_datasets(
            prefix, "969,30,1", seq_len, 1234, (int(sizes.sum() * 0.95) // seq_len, 1000, 0), tmp
        )
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_gpt_datasets(
            prefix, "969,30,1", seq_len, 1234, (int(sizes.sum() * 0.95) // seq_len, 1000, 0), tmp
        )
        reopen = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {
            "bench": "index_build_on_disk",
            "tokens": int(sizes.sum()),
            "documents": n_docs,
            "seq_len": seq_len,
            "train_samples": len(train),
            "build_s": round(build, 2),
            "cached_reopen_s": round(reopen, 2),
            "peak_rss_mib": round(rss / 1024),
            "rss_growth_mib": round((rss - rss0) / 1024),
            **stamp(),
        }


def sample_corpus(seq_len: int, reads: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        _, prefix = prepare_sample_corpus(tmp)
        prep = time.perf_counter() - t0
        t0 = time.perf_counter()
        train, _, _ = build_gpt_datasets(prefix, "969,30,1", seq_len, 1234, (20000, 0, 0), tmp)
        build = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        idx = rng.integers(0, len(train), reads)
        t0 = time.perf_counter()
        for i in idx:
            train[int(i)]
        rate = reads / (time.perf_counter() - t0)
        out.append(
            {
                "bench": "gpt_dataset_sample_corpus",
                "prepare_sample_corpus_s": round(prep, 2),
                "index_build_s": round(build, 3),
                "samples": len(train),
                "seq_len": seq_len,
                "random_reads_per_s": round(rate),
                **stamp(),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1e10)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--mean-doc", type=int, default=1000)
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--scale-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--disk-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scale_only:
        emit(scale(args.tokens, args.seq_len, args.mean_doc))
        return
    if args.disk_only:
        emit(scale_on_disk(args.tokens, args.seq_len, args.mean_doc))
        return
    for rec in sample_corpus(128, args.reads):
        emit(rec)
    # the scale run in a fresh process, so its peak RSS is its own
    for mode in ("--scale-only", "--disk-only"):
        cmd = [sys.executable, __file__, mode, "--tokens", str(args.tokens),
               "--seq-len", str(args.seq_len), "--mean-doc", str(args.mean_doc)]  # fmt: skip
        print(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


if __name__ == "__main__":
    main()
