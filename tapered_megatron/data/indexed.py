"""Megatron-LM "MMIDIDX" version-1 indexed datasets: memory-mapped reader, streaming writer.

Layout of ``PREFIX.idx`` (little endian)::

    b"MMIDIDX\\x00\\x00"  <Q version=1  <B dtype code  <Q sequence count S  <Q doc-index count D
    int32 sizes[S]  int64 byte pointers[S]  int64 document index[D]

``PREFIX.bin`` holds the tokens of every sequence back to back. A *sequence* is one row of the
file (a sentence when Megatron's ``--split-sentences`` was used, else a whole document); the
document index ``[0, ..., S]`` marks where documents start in sequence numbers, so document ``d``
is sequences ``doc_idx[d]:doc_idx[d + 1]``. Files written by Megatron-LM and GPT-NeoX read here
unchanged, and ours read there.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, doc-index count
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
COPY_CHUNK = 1 << 22  # entries per step when streaming arrays (bounded memory)
UINT16_VOCAB_LIMIT = 65500  # Megatron: uint16 tokens below this vocabulary size, else int32


class IndexedDatasetError(ValueError):
    """A malformed or inconsistent .idx/.bin pair; the message names the file and the fault."""


def error_line(error: IndexedDatasetError) -> str:
    """The one-line message of ``error``, also when a ``DataLoader`` worker raised it (torch
    re-raises it with the worker's traceback, whose last line is ``...Error: message``)."""
    last = [line for line in str(error).splitlines() if line.strip()][-1:] or [""]
    head, sep, rest = last[0].partition(f"{IndexedDatasetError.__name__}: ")
    return rest if sep and "." in head else last[0]


def token_dtype(vocab_size: int) -> type:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65,500 entries, else int32."""
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def normalise_prefix(path: str | os.PathLike) -> str:
    """Accept ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx``."""
    p = os.fspath(path)
    return p[:-4] if p.endswith((".bin", ".idx")) else p


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.idx`` + ``PREFIX.bin``, validated on open.

    ``ds[i]`` / ``ds.sequence(i)`` return sequence ``i``; ``ds.document(d)`` the concatenated tokens
    of document ``d``. ``sizes``, ``pointers`` and ``doc_idx`` are the index arrays (memory-mapped).
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int | None = None):
        self.prefix = normalise_prefix(prefix)
        self._idx_file = idx_path(self.prefix)
        self._bin_file = bin_path(self.prefix)
        self._read_index()
        self._check_bin()
        self._bin = (
            np.memmap(self._bin_file, dtype=self.dtype, mode="r")
            if self._bin_bytes
            else np.empty(0, self.dtype)
        )
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    # -- opening and validation --------------------------------------------------------------
    def _fail(self, path: str, fault: str) -> IndexedDatasetError:
        return IndexedDatasetError(f"{path}: {fault}")

    def _read_index(self) -> None:
        path = self._idx_file
        if not os.path.isfile(path):
            raise self._fail(path, "index file not found")
        size = os.path.getsize(path)
        if size < HEADER.size:
            raise self._fail(path, f"truncated index: {size} bytes, header needs {HEADER.size}")
        with open(path, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise self._fail(
                path, f"wrong magic {magic!r}, expected {MAGIC!r} (not an MMIDIDX index)"
            )
        if version != VERSION:
            raise self._fail(path, f"unsupported version {version}, expected {VERSION}")
        if code not in DTYPES:
            raise self._fail(path, f"unknown dtype code {code} (valid: 1-8)")
        expected = HEADER.size + 12 * n_seq + 8 * n_doc
        if size < expected:
            raise self._fail(
                path,
                f"truncated index: {size} bytes, header declares {n_seq} sequences and "
                f"{n_doc} document-index entries ({expected} bytes)",
            )
        if size > expected:
            raise self._fail(path, f"{size - expected} trailing bytes after the document index")
        self.dtype = np.dtype(DTYPES[code])
        self.dtype_code = code
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        off = HEADER.size
        self.sizes = np.frombuffer(mm, np.int32, n_seq, off)
        off += 4 * n_seq
        self.pointers = np.frombuffer(mm, np.int64, n_seq, off)
        off += 8 * n_seq
        self.doc_idx = np.frombuffer(mm, np.int64, n_doc, off)
        self._idx_mmap = mm
        if n_doc < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n_seq:
            first = self.doc_idx[0] if n_doc else None
            last = self.doc_idx[-1] if n_doc else None
            raise self._fail(
                path,
                f"document index must run from 0 to the sequence count {n_seq}, "
                f"got first={first} last={last} ({n_doc} entries)",
            )
        if n_doc > 1 and np.any(np.diff(self.doc_idx) < 0):
            raise self._fail(path, "document index is not non-decreasing")
        if n_seq and self.sizes.min() < 0:
            raise self._fail(path, f"negative sequence length {int(self.sizes.min())}")

    def _check_bin(self) -> None:
        path = self._bin_file
        if not os.path.isfile(path):
            raise self._fail(path, "data file not found")
        self._bin_bytes = os.path.getsize(path)
        item = self.dtype.itemsize
        n = len(self.sizes)
        if n:
            expected_ptr = np.empty(n, np.int64)
            expected_ptr[0] = 0
            np.cumsum(self.sizes[:-1].astype(np.int64) * item, out=expected_ptr[1:])
            bad = np.flatnonzero(self.pointers != expected_ptr)
            if bad.size:
                for other in (1, 2, 4, 8):
                    if other != item and np.array_equal(
                        self.pointers, expected_ptr // item * other
                    ):
                        raise self._fail(
                            self._idx_file,
                            f"dtype mismatch: header dtype {self.dtype.name} has {item}-byte "
                            f"tokens but the pointers imply {other}-byte tokens",
                        )
                i = int(bad[0])
                raise self._fail(
                    self._idx_file,
                    f"pointer of sequence {i} is {int(self.pointers[i])}, sizes imply "
                    f"{int(expected_ptr[i])} ({bad.size} inconsistent pointers)",
                )
            need = int(expected_ptr[-1]) + int(self.sizes[-1]) * item
        else:
            need = 0
        if self._bin_bytes < need:
            raise self._fail(
                path,
                f"truncated data: {self._bin_bytes} bytes, index needs {need} "
                f"({need // item} {self.dtype.name} tokens)",
            )
        if self._bin_bytes > need:
            raise self._fail(
                path,
                f"{self._bin_bytes} bytes but the index describes {need}: index and data do "
                "not match (wrong .idx for this .bin, or dtype mismatch)",
            )

    def check_vocab(self, vocab_size: int, chunk_tokens: int = 1 << 26) -> None:
        """Fail if the dtype cannot hold ``vocab_size`` ids or a token id is >= ``vocab_size``."""
        if np.issubdtype(self.dtype, np.floating):
            raise self._fail(self._idx_file, f"float dtype {self.dtype.name} cannot hold token ids")
        if vocab_size - 1 > np.iinfo(self.dtype).max:
            raise self._fail(
                self._idx_file,
                f"dtype {self.dtype.name} cannot hold ids of a {vocab_size}-entry vocabulary",
            )
        for start in range(0, len(self._bin), chunk_tokens):
            chunk = self._bin[start : start + chunk_tokens]
            if int(chunk.max()) >= vocab_size or int(chunk.min()) < 0:
                pos = int(np.flatnonzero((chunk >= vocab_size) | (chunk < 0))[0])
                raise self._fail(
                    self._bin_file,
                    f"token id {int(chunk[pos])} at token {start + pos} is outside the "
                    f"vocabulary [0, {vocab_size})",
                )

    def __getstate__(self) -> dict:
        """Pickle by path (DataLoader workers under spawn), never the mapped contents."""
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    # -- access ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    @functools.cached_property
    def _cum_sizes(self) -> np.ndarray:
        cum = np.zeros(len(self.sizes) + 1, np.int64)
        np.cumsum(self.sizes, out=cum[1:])
        return cum

    @functools.cached_property
    def document_lengths(self) -> np.ndarray:
        """Tokens per document (sum of its sequences), int64."""
        return self._cum_sizes[self.doc_idx[1:]] - self._cum_sizes[self.doc_idx[:-1]]

    @functools.cached_property
    def document_offsets(self) -> np.ndarray:
        """Token offset of each document's first token in the .bin (documents are contiguous)."""
        return self._cum_sizes[self.doc_idx[:-1]]

    def tokens(self, offset: int, length: int) -> np.ndarray:
        """``length`` tokens starting at token ``offset`` of the .bin (a memory-mapped view)."""
        return self._bin[offset : offset + length]

    def sequence(self, i: int) -> np.ndarray:
        ptr = int(self.pointers[i]) // self.dtype.itemsize
        return self._bin[ptr : ptr + int(self.sizes[i])]

    __getitem__ = sequence

    def document(self, d: int) -> np.ndarray:
        lo, hi = int(self.doc_idx[d]), int(self.doc_idx[d + 1])
        if lo == hi:
            return self._bin[:0]
        start = int(self.pointers[lo]) // self.dtype.itemsize
        end = int(self.pointers[hi - 1]) // self.dtype.itemsize + int(self.sizes[hi - 1])
        return self._bin[start:end]

    def document_sequences(self, d: int) -> list[np.ndarray]:
        return [self.sequence(i) for i in range(int(self.doc_idx[d]), int(self.doc_idx[d + 1]))]


class IndexedDatasetWriter:
    """Streams ``PREFIX.bin`` and writes ``PREFIX.idx`` on ``finalize``, in bounded memory.

    Tokens, sequence lengths and document ends stream to three files under temporary names
    (``PREFIX.bin`` + ``tag`` and two sidecars); ``finalize`` assembles the index from the
    sidecars in chunks and renames both files into place (the .idx last), so an interrupted run
    leaves nothing under the final names. The temporary .bin is locked while open: a second
    writer of the same prefix and tag fails instead of interleaving. ``checkpoint()`` flushes to
    disk and returns counts that ``resume=`` takes to reopen the files cut back to that point
    (with a fixed ``tag``, across processes). Use as a context manager: leaving the block with
    an exception removes the temporary files.
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        dtype: type | np.dtype = np.uint16,
        tag: str | None = None,
        resume: dict | None = None,
    ):
        self.prefix = normalise_prefix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"unsupported dtype {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = tag or f".tmp{os.getpid()}"
        self._tmp_bin = bin_path(self.prefix) + tag
        self._tmp_idx = idx_path(self.prefix) + tag
        self._tmp_sizes = f"{self.prefix}.sizes{tag}"  # int32 length of every sequence
        self._tmp_ends = f"{self.prefix}.docs{tag}"  # int64 sequence count at each document end
        state = resume or {"tokens": 0, "sequences": 0, "documents": 0}
        self._files = []
        try:
            self._bin = self._open(self._tmp_bin, state["tokens"] * self.dtype.itemsize, True)
            self._sizes = self._open(self._tmp_sizes, state["sequences"] * 4)
            self._ends = self._open(self._tmp_ends, state["documents"] * 8)
        except BaseException:
            self.close()
            raise
        self.num_tokens = state["tokens"]
        self.num_sequences = state["sequences"]
        self.num_documents = state["documents"]

    def _open(self, path: str, length: int, lock: bool = False):
        """Open ``path`` for writing at ``length`` bytes (cut back to it; it must be that long)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        f = os.fdopen(fd, "r+b", buffering=1 << 20)
        self._files.append(f)
        if lock:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._files.pop().close()
                raise IndexedDatasetError(
                    f"{path}: another process is writing this dataset (file locked)"
                ) from None
        have = os.fstat(fd).st_size
        if have < length:
            raise IndexedDatasetError(
                f"{path}: {have} bytes, the checkpoint needs {length} (partial output damaged; "
                "start over without resuming)"
            )
        f.truncate(length)
        f.seek(length)
        return f

    def add_sequence(self, tokens: Iterable[int] | np.ndarray) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.write(struct.pack("<i", arr.size))
        self.num_sequences += 1
        self.num_tokens += arr.size

    def end_document(self) -> None:
        self._ends.write(struct.pack("<q", self.num_sequences))
        self.num_documents += 1

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """One document of one sequence (the usual case without sentence splitting)."""
        self.add_sequence(tokens)
        self.end_document()

    def add_documents(self, flat: np.ndarray | Sequence[np.ndarray], lengths: np.ndarray) -> None:
        """Many one-sequence documents at once: ``flat`` (an array, or a list of arrays to be
        read one after the other) holds them back to back."""
        pieces = [
            np.asarray(a, self.dtype) for a in ([flat] if isinstance(flat, np.ndarray) else flat)
        ]
        lengths = np.asarray(lengths, dtype=np.int32)
        size = sum(a.size for a in pieces)
        if int(lengths.sum()) != size:
            raise ValueError(f"lengths sum to {int(lengths.sum())}, tokens are {size}")
        for a in pieces:
            self._bin.write(memoryview(np.ascontiguousarray(a)).cast("B"))  # no copy
        self._sizes.write(lengths.tobytes())
        first = self.num_sequences
        self._ends.write(np.arange(first + 1, first + 1 + lengths.size, dtype=np.int64).tobytes())
        self.num_sequences += lengths.size
        self.num_documents += lengths.size
        self.num_tokens += size

    def add_range(self, ds: IndexedDataset, first_doc: int, end_doc: int) -> None:
        """Append documents ``[first_doc, end_doc)`` of ``ds`` as they are (copied in chunks)."""
        if ds.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{ds.prefix}: tokens are {ds.dtype.name}, this dataset's are {self.dtype.name}"
            )
        lo, hi = int(ds.doc_idx[first_doc]), int(ds.doc_idx[end_doc])
        start = int(ds.pointers[lo]) // self.dtype.itemsize if lo < hi else 0
        n_tokens = int(ds.sizes[lo:hi].sum(dtype=np.int64))
        for i in range(start, start + n_tokens, COPY_CHUNK):
            self._bin.write(ds.tokens(i, min(COPY_CHUNK, start + n_tokens - i)).tobytes())
        for i in range(lo, hi, COPY_CHUNK):
            self._sizes.write(np.asarray(ds.sizes[i : min(i + COPY_CHUNK, hi)]).tobytes())
        shift = self.num_sequences - lo
        for d in range(first_doc + 1, end_doc + 1, COPY_CHUNK):
            ends = ds.doc_idx[d : min(d + COPY_CHUNK, end_doc + 1)] + shift
            self._ends.write(ends.astype(np.int64).tobytes())
        self.num_sequences += hi - lo
        self.num_documents += end_doc - first_doc
        self.num_tokens += n_tokens

    def checkpoint(self) -> dict:
        """Flush everything to disk; the counts returned reopen the files here (``resume=``)."""
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())
        return {
            "tokens": self.num_tokens,
            "sequences": self.num_sequences,
            "documents": self.num_documents,
        }

    def finalize(self) -> None:
        """Write the index from the sidecars and rename both files into place."""
        last = self._last_end() if self.num_documents else 0
        if last != self.num_sequences:  # sequences added after the last end_document()
            self.end_document()
        self.checkpoint()
        self.write_index(self._tmp_idx)
        self.close()
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        for p in (self._tmp_sizes, self._tmp_ends):
            os.remove(p)

    def _last_end(self) -> int:
        self._ends.flush()
        with open(self._tmp_ends, "rb") as f:
            f.seek(-8, os.SEEK_END)
            return struct.unpack("<q", f.read(8))[0]

    def write_index(self, path: str) -> None:
        """Write the MMIDIDX index of everything added so far to ``path`` (in chunks)."""
        for f in self._files:
            f.flush()
        n_seq, n_doc = self.num_sequences, self.num_documents + 1
        with open(path, "wb") as out, open(self._tmp_sizes, "rb") as sizes:
            out.write(HEADER.pack(MAGIC, VERSION, CODES[self.dtype], n_seq, n_doc))
            for _ in range(0, n_seq, COPY_CHUNK):
                out.write(sizes.read(4 * COPY_CHUNK))
            sizes.seek(0)
            offset = 0
            for _ in range(0, n_seq, COPY_CHUNK):
                chunk = np.frombuffer(sizes.read(4 * COPY_CHUNK), np.int32).astype(np.int64)
                chunk *= self.dtype.itemsize
                ptr = np.empty_like(chunk)
                ptr[0] = offset
                np.cumsum(chunk[:-1], out=ptr[1:])
                ptr[1:] += offset
                offset += int(chunk.sum())
                out.write(ptr.tobytes())
            out.write(np.zeros(1, np.int64).tobytes())
            with open(self._tmp_ends, "rb") as ends:
                shutil.copyfileobj(ends, out, 1 << 22)
            out.flush()
            os.fsync(out.fileno())

    def close(self) -> None:
        """Close the files and keep them, for a later ``resume=`` from the last checkpoint."""
        for f in self._files:
            f.close()
        self._files = []

    def abort(self) -> None:
        self.close()
        for p in (self._tmp_bin, self._tmp_idx, self._tmp_sizes, self._tmp_ends):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(prefix, documents: Iterable, dtype=np.uint16) -> None:
    """Write documents, each a token list or a list of sequences (token lists)."""
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in documents:
            if len(doc) and not np.isscalar(doc[0]):
                for seq in doc:
                    w.add_sequence(seq)
                w.end_document()
            else:
                w.add_document(doc)
