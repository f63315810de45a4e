#!/usr/bin/env python
"""The cost of keeping token ids inside the vocabulary, per TB of token data.

Writes a ``.bin``/``.idx`` pair of ``--mib`` MiB of random uint16 ids (in memory-mapped reads
from the page cache, as training reads them), then times, median of ``--rounds``:

* ``scan``: pre-flight's full check (``IndexedDataset.check_vocab``: max and min over every id,
  once per file content, remembered by a marker keyed by ``content_key``);
* ``key``: that content key (the index, the size and 16 pieces of 1 MiB of a file over 64 MiB);
* ``read`` / ``read_checked``: every sample of ``--seq-len`` + 1 tokens read by ``GPTDataset``
  without and with the per-sample check (``vocab_size`` given), so their difference is what the
  check adds to the data loader.

Prints one JSON line with the seconds and the implied seconds per TB (10**12 bytes) of tokens.

    python scripts/bench_token_check.py --mib 256 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import emit, stamp

from tapered_megatron.data import GPTDataset, IndexedDataset, write_indexed_dataset
from tapered_megatron.data.blended import content_key

TB = 10**12


def _median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _read_all(ds: GPTDataset) -> None:
    for i in range(len(ds)):
        ds.sample_tokens(i)


def main() -> None:
    """Parse the arguments, run the timings, print the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the token file")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    n = (a.mib << 20) // 2
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "tokens")
        ids = np.random.default_rng(0).integers(0, 32000, n, dtype=np.uint16)
        write_indexed_dataset(prefix, np.array_split(ids, 64))
        del ids
        ds = IndexedDataset(prefix)
        nbytes = Path(prefix + ".bin").stat().st_size
        samples = (n - 1) // a.seq_len
        plain, checked = (
            GPTDataset(ds, (0, 64), a.seq_len, samples, 0, tmp, "train", False, vocab_size=v)
            for v in (None, 32000)
        )
        timed = {
            "scan": lambda: ds.check_vocab(32000),
            "key": lambda: content_key(ds),
            "read": lambda: _read_all(plain),
            "read_checked": lambda: _read_all(checked),
        }
        seconds = {name: _median_seconds(fn, a.rounds) for name, fn in timed.items()}
    per_tb = {f"{k}_s_per_tb": round(v * TB / nbytes, 1) for k, v in seconds.items()}
    added = seconds["read_checked"] - seconds["read"]
    emit(
        {
            "bytes": nbytes,
            "seq_len": a.seq_len,
            "samples": samples,
            **{f"{k}_s": round(v, 4) for k, v in seconds.items()},
            **per_tb,
            "check_added_s_per_tb": round(added * TB / nbytes, 1),
            "check_added_pct_of_read": round(100 * added / seconds["read"], 1),
            **stamp(),
        }
    )


if __name__ == "__main__":
    main()
