"""GPT dataset: document, sample and shuffle indices over an indexed dataset (Megatron style).

For a split (a contiguous range of documents) and a sequence length ``L``:

- **doc_idx**: the split's document ids, one seeded permutation per epoch, epochs concatenated;
  read in this order the documents form one token stream, each epoch holding every token of
  the split exactly once.
- **sample_idx** ``[N + 1, 2]``: sample ``i`` starts at stream position ``i * L`` (entry ``i`` is
  ``(position in doc_idx, offset in that document)``) and holds ``L + 1`` tokens (inputs and
  shifted labels), so consecutive samples share one token and samples span document boundaries.
- **shuffle_idx** ``[N]``: samples permuted within each epoch (a sample belongs to the epoch its
  first token is in), so consuming samples in order finishes epoch ``e`` before epoch ``e + 1``.

Everything is vectorised numpy (a 10B-token index builds in seconds); the arrays are cached on
disk under a hash of what determines them (document lengths, split, ``L``, sample count, seed),
built once, and memory-mapped by every process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from tapered_megatron.config import parse_split

from .cache import build_once, digest, load_arrays, save_arrays
from .indexed import IndexedDataset, IndexedDatasetError

INDEX_VERSION = "gpt-index-v1"
CHUNK = 1 << 22  # positions per searchsorted chunk: bounds the temporary memory


def split_ranges(split: str | tuple | list, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's ``get_split_indices``: contiguous [start, end) document ranges per split."""
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(w * num_documents))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _rng(seed: int, stream: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, epoch])))


def num_epochs_for(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Fewest epochs whose token stream yields ``num_samples`` samples of ``seq_len + 1`` tokens."""
    if tokens_per_epoch <= 1:
        raise ValueError(f"split has {tokens_per_epoch} tokens: too few for any sample")
    need = num_samples * seq_len + 1
    return max(1, -(-need // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """Per-epoch seeded permutations of ``documents``, concatenated."""
    dtype = np.int32 if documents.size == 0 or documents.max() < 2**31 - 1 else np.int64
    out = np.empty(num_epochs * documents.size, dtype)
    for e in range(num_epochs):
        out[e * documents.size : (e + 1) * documents.size] = _rng(seed, 0, e).permutation(documents)
    return out


def build_sample_idx(
    doc_lengths: np.ndarray, doc_idx: np.ndarray, seq_len: int, num_samples: int, out=None
) -> np.ndarray:
    """``[num_samples + 1, 2]`` int64 (doc_idx position, offset) of stream positions ``i * L``.

    ``doc_lengths`` is indexed by document id. Computed in chunks of positions, so the temporary
    memory is the cumulative-length array plus O(CHUNK).
    """
    cum = np.zeros(doc_idx.size + 1, np.int64)
    np.cumsum(doc_lengths[doc_idx], out=cum[1:])
    if num_samples * seq_len + 1 > cum[-1]:
        raise ValueError(f"{num_samples} samples of {seq_len + 1} tokens need more than {cum[-1]}")
    out = np.empty((num_samples + 1, 2), np.int64) if out is None else out
    for lo in range(0, num_samples + 1, CHUNK):
        pos = np.arange(lo, min(lo + CHUNK, num_samples + 1), dtype=np.int64) * seq_len
        k = np.searchsorted(cum, pos, side="right") - 1  # last document starting at or before pos
        out[lo : lo + pos.size, 0] = k
        out[lo : lo + pos.size, 1] = pos - cum[k]
    return out


def build_shuffle_idx(
    num_samples: int, seq_len: int, tokens_per_epoch: int, seed: int
) -> np.ndarray:
    """Permutation of ``range(num_samples)``, shuffled within each epoch's block of samples."""
    dtype = np.int32 if num_samples < 2**31 - 1 else np.int64
    out = np.arange(num_samples, dtype=dtype)
    epoch, start = 0, 0
    while start < num_samples:
        # first sample whose start position lies in the next epoch
        end = min(num_samples, -(-(epoch + 1) * tokens_per_epoch // seq_len))
        out[start:end] = _rng(seed, 1, epoch).permutation(out[start:end])
        start, epoch = end, epoch + 1
    return out


def build_indices(
    doc_lengths: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for ``documents`` (ids into ``doc_lengths``).

    The index covers every sample of the epochs needed for ``num_samples``, so its length can be
    a little larger than asked.
    """
    tokens_per_epoch = int(doc_lengths[documents].sum())
    epochs = num_epochs_for(tokens_per_epoch, seq_len, num_samples)
    total = (epochs * tokens_per_epoch - 1) // seq_len
    doc_idx = build_doc_idx(documents, epochs, seed)
    sample_idx = build_sample_idx(doc_lengths, doc_idx, seq_len, total)
    shuffle_idx = build_shuffle_idx(total, seq_len, tokens_per_epoch, seed)
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset:
    """Samples of ``seq_len + 1`` int64 tokens from documents ``[start, end)`` of a dataset.

    ``len(ds)`` is every sample of the epochs needed for ``num_samples`` (>= ``num_samples``).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_len: int,
        num_samples: int,
        seed: int,
        cache_dir: str | os.PathLike,
        name: str = "train",
        barrier: bool = True,
        doc_lengths: np.ndarray | None = None,
        doc_offsets: np.ndarray | None = None,
        vocab_size: int | None = None,
    ):
        if seq_len < 1 or num_samples < 1:
            raise ValueError(f"{name}: seq_len and num_samples must be positive")
        self.indexed, self.name, self.seq_len, self.seed = indexed, name, seq_len, seed
        self.vocab_size = vocab_size  # with it, every sample's ids are checked as it is read
        start, end = doc_range
        self.doc_range = (int(start), int(end))
        self.doc_lengths = indexed.document_lengths if doc_lengths is None else doc_lengths
        self.doc_offsets = indexed.document_offsets if doc_offsets is None else doc_offsets
        lengths = np.ascontiguousarray(self.doc_lengths[start:end])
        if end <= start or lengths.sum() < 2:
            raise ValueError(
                f"{indexed.prefix}: {name} split (documents {start}:{end}) has "
                f"{int(lengths.sum())} tokens, too few for any sample"
            )
        key = digest(INDEX_VERSION, lengths, json.dumps([start, end, seq_len, num_samples, seed]))
        self.cache_path = Path(cache_dir) / "gpt_indices" / f"{name}_{key}"
        documents = np.arange(start, end, dtype=np.int64)

        def build(tmp: Path) -> None:
            doc_idx, sample_idx, shuffle_idx = build_indices(
                self.doc_lengths, documents, seq_len, num_samples, seed
            )
            meta = {
                "version": INDEX_VERSION,
                "prefix": indexed.prefix,
                "name": name,
                "documents": [start, end],
                "seq_len": seq_len,
                "num_samples_requested": num_samples,
                "num_samples": int(shuffle_idx.size),
                "seed": seed,
            }
            save_arrays(tmp, meta, doc_idx=doc_idx, sample_idx=sample_idx, shuffle_idx=shuffle_idx)

        build_once(self.cache_path, build, barrier=barrier)
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_arrays(
            self.cache_path, "doc_idx", "sample_idx", "shuffle_idx"
        )

    _MAPPED = ("doc_idx", "sample_idx", "shuffle_idx")

    def __getstate__(self) -> dict:
        """Pickle without the mapped arrays (reopened from the cache on unpickling)."""
        skip = {*self._MAPPED, "doc_lengths", "doc_offsets"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.doc_lengths = self.indexed.document_lengths
        self.doc_offsets = self.indexed.document_offsets
        for name, arr in zip(self._MAPPED, load_arrays(self.cache_path, *self._MAPPED)):
            setattr(self, name, arr)

    def __len__(self) -> int:
        return int(self.shuffle_idx.size)

    def sample_tokens(self, i: int) -> np.ndarray:
        """Unshuffled sample ``i`` (stream positions ``i*L`` .. ``i*L + L``)."""
        k, offset = (int(x) for x in self.sample_idx[i])
        need, parts, starts = self.seq_len + 1, [], []
        while need > 0:
            doc = int(self.doc_idx[k])
            take = min(int(self.doc_lengths[doc]) - offset, need)
            if take > 0:
                starts.append((int(self.doc_offsets[doc]) + offset, take))
                parts.append(self.indexed.tokens(*starts[-1]))
                need -= take
            k, offset = k + 1, 0
        tokens = np.concatenate(parts)
        if self.vocab_size is not None:
            self._check_ids(tokens, starts)
        return tokens.astype(np.int64, copy=False)

    def _check_ids(self, tokens: np.ndarray, starts: list[tuple[int, int]]) -> None:
        """Raise :class:`IndexedDatasetError` naming the file and the position of an id of
        ``tokens`` (read from ``starts``: ``(first token, count)`` in the file) outside
        ``[0, vocab_size)``: a file changed after pre-flight's check (whose marker is keyed by
        sampled pieces of a large file) is stopped at the batch, before an embedding lookup."""
        signed = np.issubdtype(tokens.dtype, np.signedinteger)
        if int(tokens.max()) < self.vocab_size and not (signed and int(tokens.min()) < 0):
            return
        at = int(np.flatnonzero((tokens >= self.vocab_size) | (tokens < 0))[0])
        ends = np.cumsum([count for _, count in starts])
        part = int(np.searchsorted(ends, at, side="right"))  # the read holding it
        position = starts[part][0] + at - int(ends[part] - starts[part][1])
        raise IndexedDatasetError(
            f"{self.indexed._bin_file}: token id {int(tokens[at])} at token {position} is "
            f"outside the vocabulary [0, {self.vocab_size}) (read for a {self.name} sample; "
            "the file changed after pre-flight checked it)"
        )

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.name}: sample {i} out of range ({len(self)})")
        return self.sample_tokens(int(self.shuffle_idx[i]))
