"""Blends ("w1 prefix1 w2 prefix2 ...") and the one-call entry point ``build_gpt_datasets``."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from .cache import build_once, digest, load_arrays, save_arrays
from .gpt_dataset import GPTDataset, split_ranges
from .indexed import IndexedDataset, normalise_prefix

SPLIT_NAMES = ("train", "valid", "test")


def parse_blend(blend: str | list) -> list[tuple[float, str]]:
    """``"prefix"`` or ``"w1 prefix1 w2 prefix2 ..."`` -> normalised ``[(weight, prefix), ...]``.

    A string naming an existing token file pair is one prefix, spaces in its path included."""
    if isinstance(blend, str) and Path(normalise_prefix(blend.strip()) + ".idx").is_file():
        return [(1.0, normalise_prefix(blend.strip()))]
    parts = blend.split() if isinstance(blend, str) else [str(p) for p in blend]
    if not parts:
        raise ValueError("data path is empty")
    if len(parts) == 1:
        return [(1.0, normalise_prefix(parts[0]))]
    if len(parts) % 2:
        raise ValueError(f"blend {blend!r}: expected 'w1 prefix1 w2 prefix2 ...' (odd item count)")
    pairs = []
    for w, p in zip(parts[0::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError as e:
            raise ValueError(f"blend {blend!r}: weight {w!r} is not a number") from e
        if weight < 0 or not math.isfinite(weight):
            raise ValueError(f"blend {blend!r}: weight {w!r} must be a finite number >= 0")
        pairs.append((weight, normalise_prefix(p)))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError(f"blend {blend!r}: weights sum to zero")
    return [(w / total, p) for w, p in pairs]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy assignment: sample ``i`` goes to the dataset furthest behind its share.

    Picks ``argmax_d(w_d * (i + 1) - count_d)`` (lowest ``d`` on ties), so after any prefix of
    ``n`` samples every dataset has ``w_d * n`` samples to within one. Returns (dataset_index
    int16, dataset_sample_index int64). Sequential by nature: ~1 s per million samples, cached.
    """
    counts = [0] * len(weights)
    ds_index = np.empty(size, np.int16)
    ds_sample = np.empty(size, np.int64)
    order = range(len(weights))
    for i in range(size):
        target = i + 1
        best = max(order, key=lambda d: weights[d] * target - counts[d])
        ds_index[i] = best
        ds_sample[i] = counts[best]
        counts[best] += 1
    return ds_index, ds_sample


class BlendedDataset:
    """Deterministic interleaving of datasets in proportion to ``weights``; ``size`` samples."""

    def __init__(self, datasets, weights, size, cache_dir, name="train", barrier=True):
        self.datasets, self.weights, self.size, self.name = (
            list(datasets),
            list(weights),
            size,
            name,
        )
        key = digest(
            "blend-v1",
            json.dumps([weights, size]),
            *(str(getattr(d, "cache_path", len(d))) for d in self.datasets),
        )
        self.cache_path = Path(cache_dir) / "blend_indices" / f"{name}_{key}"

        def build(tmp: Path) -> None:
            ds_index, ds_sample = blending_indices(self.weights, size)
            for d, ds in enumerate(self.datasets):
                used = ds_sample[ds_index == d]
                if used.size and used.max() >= len(ds):
                    raise ValueError(f"{name}: blend needs {used.max() + 1} samples of dataset {d}")
            meta = {"weights": weights, "size": size, "name": name}
            save_arrays(tmp, meta, dataset_index=ds_index, dataset_sample_index=ds_sample)

        build_once(self.cache_path, build, barrier=barrier)
        self.dataset_index, self.dataset_sample_index = load_arrays(
            self.cache_path, "dataset_index", "dataset_sample_index"
        )

    def __getstate__(self) -> dict:
        skip = {"dataset_index", "dataset_sample_index"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.dataset_index, self.dataset_sample_index = load_arrays(
            self.cache_path, "dataset_index", "dataset_sample_index"
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


#: Token files up to this size are hashed whole for the vocabulary-check marker; larger ones
#: by their index, size and 16 evenly spread 1 MiB pieces.
WHOLE_HASH_BYTES = 64 << 20
HASH_PIECES, HASH_PIECE_BYTES = 16, 1 << 20


def content_key(ds: IndexedDataset) -> str:
    """A key of a token file pair's content (not its name, size or mtime): an in-place edit
    of the tokens makes a new key."""
    idx, bin_file = Path(ds._idx_file), Path(ds._bin_file)
    size = bin_file.stat().st_size
    parts: list[bytes | str] = [idx.read_bytes(), str(size)]
    with open(bin_file, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            parts.append(f.read())
        else:
            for k in range(HASH_PIECES):
                f.seek((size - HASH_PIECE_BYTES) * k // (HASH_PIECES - 1))
                parts.append(f.read(HASH_PIECE_BYTES))
    return digest(*parts)


def check_vocab_cached(ds: IndexedDataset, vocab_size: int, cache_dir: str | os.PathLike) -> None:
    """Scan token ids once per (content, vocabulary); later runs read a marker. Raises
    :class:`IndexedDatasetError` naming the first id outside ``[0, vocab_size)``."""
    marker = Path(cache_dir) / "vocab_checked" / digest(content_key(ds), str(vocab_size))
    if marker.exists():
        return
    ds.check_vocab(vocab_size)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(ds.prefix)


def build_gpt_datasets(
    blend: str | list,
    split: str,
    seq_len: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | os.PathLike,
    vocab_size: int | None = None,
    barrier: bool = True,
    log=None,
) -> tuple:
    """(train, valid, test) datasets, each indexable giving int64 arrays of ``seq_len + 1`` tokens.

    ``blend`` is a prefix or ``"w1 prefix1 w2 prefix2 ..."``; ``split`` like ``"969,30,1"`` cuts
    every dataset's documents into train/valid/test ranges. A split asked for 0 samples, or
    whose range is empty, is ``None``. With ``vocab_size``, the files are checked to hold ids
    below it (once per content, :func:`check_vocab_cached`) and every sample again as it is
    read. Bad files raise :class:`IndexedDatasetError` naming the file and the fault. Under
    ``torch.distributed`` every rank must call this (index building is rank-0-first + barrier)
    unless ``barrier=False`` (the file lock alone still keeps concurrent builders safe).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    pairs = parse_blend(blend)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must be (train, valid, test), got {num_samples}")
    indexed = []
    for _, prefix in pairs:
        ds = IndexedDataset(prefix)
        if vocab_size is not None:
            check_vocab_cached(ds, vocab_size, cache_dir)
        indexed.append(ds)
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples[s])
        if n <= 0:
            out.append(None)
            continue
        parts, weights = [], []
        for (w, prefix), ds in zip(pairs, indexed):
            start, end = split_ranges(split, ds.num_documents)[s]
            if w == 0:
                continue
            if end <= start:
                log(f"{prefix}: {name} split {split!r} has no documents; skipped")
                continue
            want = n if len(pairs) == 1 else math.ceil(n * w * 1.005)
            parts.append(
                GPTDataset(
                    ds,
                    (start, end),
                    seq_len,
                    want,
                    seed,
                    cache_dir,
                    name,
                    barrier,
                    vocab_size=vocab_size,
                )
            )
            weights.append(w)
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0])
        else:
            total = sum(weights)
            weights = [w / total for w in weights]
            out.append(BlendedDataset(parts, weights, n, cache_dir, name, barrier))
    return tuple(out)
