"""Text -> MMIDIDX: the engine behind ``data_tools/tokenize.py`` (streaming, parallel, resumable).

The main process streams every source (:mod:`.sources`: jsonl/json/txt, optionally .gz/.zst,
Parquet, ``datasets`` folders) as chunks of ~256 KB of text; a process pool parses and encodes
one chunk per task; results come back in submission order with at most ``4 * workers`` chunks
in flight, and the main process appends them to the outputs. Memory stays bounded whatever the
input size: reads stream, the queue between reader and workers is bounded, and the writer keeps
nothing of what it wrote. Outputs grow under ``.partial`` names, checkpointed every
``checkpoint_seconds`` and at source ends (at most once a second there); ``resume=True``
continues a killed run from its last checkpoint and gives the same bytes as an uninterrupted
run.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import math
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np

from .indexed import IndexedDatasetWriter, token_dtype
from .sources import InputError, Source, expand_inputs, read_chunks, record_unit
from .tokenizer import load_tokenizer, splits_at_whitespace

__all__ = ["InputError", "TokenizeSummary", "iter_texts", "paragraphs", "tokenize_files"]

PARTIAL = ".partial"  # suffix of every file of an unfinished run
SOURCE_END_SECONDS = 1.0  # checkpoint at an input's end if the last one is this old (fsyncs)
STATE_VERSION = 1
ENCODE_CHARS = 1 << 16  # a longer document is encoded in segments of about this many characters
_WORD_START = re.compile(r"(?<=\S) (?=\S)")  # where a segment may end: a lone space


@dataclass
class TokenizeSummary:
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    lines: int = 0
    skipped_bad_lines: int = 0
    skipped_empty: dict[str, int] = field(default_factory=dict)
    invalid_utf8: int = 0
    seconds: float = 0.0
    sources: int = 0
    resumed_from_source: int | None = None
    outputs: list[str] = field(default_factory=list)
    first_errors: list[str] = field(default_factory=list)

    def throughput(self) -> dict[str, float]:
        s = max(self.seconds, 1e-9)
        docs = max(self.documents.values(), default=0)
        toks = sum(self.tokens.values())
        return {
            "docs_per_s": docs / s,
            "mb_per_s": self.input_bytes / s / 1e6,
            "tok_per_s": toks / s,
        }

    def as_dict(self) -> dict:
        return {**asdict(self), **{k: round(v, 2) for k, v in self.throughput().items()}}


# -- parsing and encoding (the workers' part) -------------------------------------------------
def _decode_lines(blob: bytes) -> tuple[list[str], int]:
    """Split a chunk into lines (no newlines); invalid UTF-8 is replaced, lines counted."""
    try:
        lines = blob.decode("utf-8").split("\n")
        bad = 0
    except UnicodeDecodeError:
        lines, bad = [], 0
        for raw in blob.split(b"\n"):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                lines.append(raw.decode("utf-8", errors="replace"))
                bad += 1
    if lines and not lines[-1] and blob.endswith(b"\n"):
        lines.pop()
    return lines, bad


def parse_chunk(
    kind: str, payload, keys: Sequence[str]
) -> tuple[dict[str, list[str]], list[tuple[int, str]], int, int, int]:
    """``(texts per key, errors (record index in chunk, fault), invalid UTF-8 lines, text bytes,
    records)`` of one chunk (see :class:`.sources.Chunk`). Bad records are reported, not raised,
    and dropped for every key (so the keys' outputs stay aligned)."""
    texts: dict[str, list[str]] = {k: [] for k in keys}
    errors: list[tuple[int, str]] = []
    if kind == "columns":
        import pyarrow.compute as pc

        cols = [payload[k].to_pylist() for k in keys]
        nbytes = sum(pc.sum(pc.binary_length(payload[k])).as_py() or 0 for k in keys)
        records = len(cols[0])
        for i in range(records):
            values = [c[i] for c in cols]
            if None in values:
                errors.append((i, f"key {keys[values.index(None)]!r} is null"))
                continue
            for k, v in zip(keys, values):
                texts[k].append(v)
        return texts, errors, 0, nbytes, records
    bad_utf8 = 0
    if kind == "obj":
        objs = payload
        nbytes = 0
    else:
        objs, bad_utf8 = _decode_lines(payload)
        nbytes = len(payload)
        if kind == "txt":
            texts[keys[0]] = [line.rstrip("\r") for line in objs]
            return texts, errors, bad_utf8, nbytes, len(objs)
    for i, obj in enumerate(objs):
        if kind == "jsonl":
            if not obj.strip():
                continue  # blank line between records
            try:
                obj = json.loads(obj)
            except json.JSONDecodeError as e:
                errors.append((i, f"invalid JSON ({e.msg} at column {e.colno})"))
                continue
            except RecursionError:  # the decoder recurses once per nesting level
                errors.append((i, "invalid JSON (nested deeper than Python's recursion limit)"))
                continue
        elif isinstance(obj, dict):  # parsed whole: count the text of the keys
            nbytes += sum(len(obj[k].encode()) for k in keys if isinstance(obj.get(k), str))
        if not isinstance(obj, dict):
            errors.append((i, f"expected a JSON object, got {type(obj).__name__}"))
            continue
        missing = [k for k in keys if k not in obj]
        if missing:
            errors.append((i, f"missing key {missing[0]!r} (has {sorted(obj)[:5]})"))
            continue
        wrong = [k for k in keys if not isinstance(obj[k], str)]
        if wrong:
            errors.append((i, f"key {wrong[0]!r} is {type(obj[wrong[0]]).__name__}, not a string"))
            continue
        for k in keys:
            texts[k].append(obj[k])
    return texts, errors, bad_utf8, nbytes, len(objs)


_TOKENIZER = None
_SETTINGS: dict = {}


def _init_worker(model_path: str, keys: Sequence[str], append_eod: bool) -> None:
    global _TOKENIZER, _SETTINGS
    if mp.parent_process() is not None:  # pool worker: default SIGTERM so terminate() ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _TOKENIZER is None or _TOKENIZER.model_path != model_path:  # forked: inherited already
        _TOKENIZER = load_tokenizer(model_path)
    dtype = np.dtype(token_dtype(_TOKENIZER.vocab_size))
    cut = splits_at_whitespace(_TOKENIZER)
    _SETTINGS = {"keys": list(keys), "append_eod": append_eod, "dtype": dtype, "cut": cut}


def _sp_encode(texts: list[str]) -> tuple[list[np.ndarray], int]:
    """Sentencepiece's ids of ``texts`` (numpy arrays) and the number with lone surrogates."""
    try:
        return _TOKENIZER.sp.encode(texts, num_threads=1, out_type="numpy"), 0
    except (UnicodeEncodeError, TypeError):  # lone surrogates (JSON escapes): not UTF-8
        clean = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
        bad = sum(a != b for a, b in zip(texts, clean))
        return _TOKENIZER.sp.encode(clean, num_threads=1, out_type="numpy"), bad


def _encode_long(text: str, dtype: np.dtype) -> tuple[list[np.ndarray], int]:
    """The tokens of one long document in segments of about ``ENCODE_CHARS`` characters.

    A segment ends before a single space between two words, and is encoded after the character
    that precedes it, whose tokens are dropped: a model that splits at whitespace never forms a
    token across such a space, so the tokens equal one encode of the whole text, while
    sentencepiece's working memory (tens of bytes per character) is that of one segment. A
    stretch without such a space is not cut.
    """
    parts, bad, start = [], 0, 0
    while start < len(text):
        cut = _WORD_START.search(text, start + ENCODE_CHARS)
        end = cut.start() if cut else len(text)
        before = max(start - 1, 0)
        (head, ids), b = _sp_encode([text[before:start], text[before:end]])
        parts.append(ids[len(head) :].astype(dtype))
        bad, start = max(bad, b), end
    return parts, bad


def _encode(texts: list[str], dtype: np.dtype, eod: int | None) -> tuple[list, np.ndarray, int]:
    """``(tokens, lengths, lines with lone surrogates)`` of a list of documents; ``tokens`` is a
    list of arrays that hold the documents back to back.

    Sentencepiece returns numpy arrays (no Python int per token); documents longer than
    ``ENCODE_CHARS`` are encoded in segments (:func:`_encode_long`) when the model splits at
    whitespace, and their segments are kept apart rather than copied into one array.
    """
    long = [i for i, t in enumerate(texts) if len(t) > ENCODE_CHARS] if _SETTINGS["cut"] else []
    short = list(texts)
    for i in long:
        short[i] = ""
    ids, bad = _sp_encode(short)
    docs: list[list[np.ndarray]] = [[x] for x in ids]
    del ids
    for i in long:
        docs[i], b = _encode_long(texts[i], dtype)
        bad += b
    lengths = np.fromiter((sum(map(len, d)) for d in docs), dtype=np.int64, count=len(docs))
    if eod is not None:  # after every non-empty document
        end = np.asarray([eod], dtype)
        for d, n in zip(docs, lengths):
            if n:
                d.append(end)
        lengths += lengths > 0
    tokens, run = [], []  # runs of short documents joined, a long one's segments as they are
    for d in docs:
        if len(d) > 2:
            tokens += [np.concatenate(run, dtype=dtype, casting="unsafe")] if run else []
            tokens += d
            run = []
        else:
            run += d
    tokens += [np.concatenate(run, dtype=dtype, casting="unsafe")] if run else []
    return tokens, lengths, bad


def encode_batch(batch: tuple) -> dict:
    """Worker: parse and encode one chunk ``(path, first record, kind, payload)``."""
    path, first, kind, payload = batch
    keys, dtype = _SETTINGS["keys"], _SETTINGS["dtype"]
    eod = _TOKENIZER.eod_id if _SETTINGS["append_eod"] else None
    texts, errors, bad_utf8, nbytes, records = parse_chunk(kind, payload, keys)
    out_tokens, out_lengths = {}, {}
    for k in keys:
        out_tokens[k], out_lengths[k], bad = _encode(texts[k], dtype, eod)
        bad_utf8 += bad
    return {
        "path": path,
        "lines": records,
        "errors": [(first + i, msg) for i, msg in errors],
        "tokens": out_tokens,
        "lengths": out_lengths,
        "bytes": nbytes,
        "invalid_utf8": bad_utf8,
    }


# -- the pipeline (the main process' part) ----------------------------------------------------
class _Step(NamedTuple):
    """Where a chunk leaves its source: what a checkpoint after it records."""

    source: int
    cursor: int
    next_record: int
    last: bool  # the source's last chunk
    kind: str
    disk_bytes: int

    def after(self) -> tuple:
        """The position to restart from after this chunk: (source, cursor, record number)."""
        if self.last:
            return (self.source + 1, 0, None)
        return (self.source, self.cursor, self.next_record)


def _jobs(sources: list[Source], keys: Sequence[str], start: tuple) -> Iterator[tuple]:
    first_source, cursor, record = start
    for i in range(first_source, len(sources)):
        src = sources[i]
        chunks = read_chunks(src, keys, *((cursor, record) if i == first_source else (0, None)))
        prev = next(chunks, None)
        while prev is not None:
            nxt = next(chunks, None)
            end = prev.first + prev.records
            step = _Step(i, prev.cursor, end, nxt is None, prev.kind, prev.disk_bytes)
            yield step, (src.path, prev.first, prev.kind, prev.payload)
            prev = nxt


def _ordered_results(jobs: Iterator[tuple], pool, workers: int) -> Iterator[tuple]:
    """``(step, result)`` in job order; at most 4 chunks per worker in flight."""
    if pool is None:
        for step, batch in jobs:
            yield step, encode_batch(batch)
        return
    pending: collections.deque = collections.deque()
    for step, batch in jobs:
        pending.append((step, pool.apply_async(encode_batch, (batch,))))
        if len(pending) >= 4 * workers:
            step, res = pending.popleft()
            yield step, res.get()
    while pending:
        step, res = pending.popleft()
        yield step, res.get()


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    return f"{output_prefix}_{key}_{level}"


def state_path(output_prefix: str) -> str:
    """The checkpoint of an unfinished run (JSON), beside its ``.partial`` outputs."""
    return f"{output_prefix}.tokenize{PARTIAL}"


def _fingerprint(sources: list[Source], model: str, keys: list[str], append_eod: bool) -> dict:
    with open(model, "rb") as f:
        model_digest = hashlib.sha256(f.read()).hexdigest()
    inputs = json.dumps([[os.path.abspath(s.path), s.size, s.mtime_ns] for s in sources])
    return {
        "inputs": hashlib.sha256(inputs.encode()).hexdigest(),  # small: rewritten often
        "tokenizer": model_digest,
        "json_keys": keys,
        "append_eod": append_eod,
    }


def _load_state(path: str, fingerprint: dict) -> dict | None:
    """The checkpoint at ``path`` if it belongs to this run; raise if it belongs to another."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        recorded = state["fingerprint"]
    except (ValueError, KeyError) as e:
        raise InputError(f"{path}: unreadable checkpoint ({e}); rerun without --resume") from e
    for name, value in fingerprint.items():
        if recorded.get(name) == value:
            continue
        what = {
            "inputs": "input list, or an input file changed size or modification time",
            "tokenizer": "tokenizer model",
        }.get(name, f"{name} setting")
        raise InputError(
            f"{path}: the interrupted run had a different {what}; rerun without --resume "
            "to start over"
        )
    return state


class _Outputs:
    """The writers of one run and its checkpoint file: open (fresh or at the checkpoint),
    checkpoint, finalize, or discard."""

    def __init__(
        self, output_prefix: str, keys: list[str], dtype: np.dtype, state: dict | None, fp: dict
    ):
        self.path = state_path(output_prefix)
        self.fingerprint = fp
        self.prefixes = {k: output_prefix_for(output_prefix, k) for k in keys}
        self.writers: dict[str, IndexedDatasetWriter] = {}
        try:
            for k, prefix in self.prefixes.items():
                at = state["writers"][k] if state else None
                self.writers[k] = IndexedDatasetWriter(prefix, dtype, tag=PARTIAL, resume=at)
        except BaseException:
            self.discard(keep=True)
            raise
        if not state and os.path.exists(self.path):
            note = "an interrupted run's checkpoint; starting over (--resume continues it)"
            print(f"{self.path}: {note}", file=sys.stderr)
            os.remove(self.path)  # a stale checkpoint must never pair with the new files

    def checkpoint(self, position: tuple, disk_bytes: int, summary: TokenizeSummary) -> None:
        """Flush the writers, then replace the checkpoint file atomically."""
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "position": position,
            "disk_bytes": disk_bytes,
            "writers": {k: w.checkpoint() for k, w in self.writers.items()},
            "summary": asdict(summary),
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def finalize(self) -> list[str]:
        for w in self.writers.values():
            w.finalize()
        if os.path.exists(self.path):
            os.remove(self.path)
        return list(self.prefixes.values())

    def discard(self, keep: bool) -> None:
        """Close the writers; keep the partial files and checkpoint (``keep``) or remove them."""
        for w in self.writers.values():
            w.close() if keep else w.abort()
        if not keep and os.path.exists(self.path):
            os.remove(self.path)


def tokenize_files(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_model: str,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_lines: bool = False,
    log_interval: int = 0,
    progress: bool | None = None,
    resume: bool = False,
    checkpoint_seconds: float = 30.0,
) -> TokenizeSummary:
    """Tokenize ``inputs`` into ``PREFIX_{key}_document.{bin,idx}`` per key; returns the summary.

    Raises :class:`InputError` naming the file and record for a bad record unless
    ``skip_bad_lines``. Outputs grow under ``.partial`` names with a checkpoint every
    ``checkpoint_seconds`` and at a source's end (at most one a second there); they are renamed
    into place when complete. On an error
    or interrupt the partial files are removed, unless ``resume``: then they are kept, and a
    later call with ``resume=True`` continues from the last checkpoint (same bytes as one
    uninterrupted run). A killed process leaves only ``.partial`` files behind.
    """
    t0 = time.perf_counter()
    sources = expand_inputs(inputs)
    keys = list(json_keys)
    init = (tokenizer_model, keys, append_eod)
    try:
        _init_worker(*init)  # before forking: the workers inherit the loaded tokenizer
    except (OSError, RuntimeError) as e:  # sentencepiece's parse error is a RuntimeError
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(
            f"--tokenizer-model {tokenizer_model}: not a readable sentencepiece model ({why}); "
            "pass the .model file data_tools/train_tokenizer.py wrote"
        ) from None
    fingerprint = _fingerprint(sources, tokenizer_model, keys, append_eod)
    state = _load_state(state_path(output_prefix), fingerprint) if resume else None
    summary = TokenizeSummary(
        documents=dict.fromkeys(keys, 0),
        tokens=dict.fromkeys(keys, 0),
        skipped_empty=dict.fromkeys(keys, 0),
        sources=len(sources),
    )
    position, disk_done = (0, 0, None), 0
    if state:
        for f in fields(TokenizeSummary):
            setattr(summary, f.name, state["summary"].get(f.name, getattr(summary, f.name)))
        position, disk_done = tuple(state["position"]), state["disk_bytes"]
        summary.resumed_from_source = position[0]
        t0 -= summary.seconds
        done = max(summary.documents.values())
        where = f"input {position[0] + 1} of {len(sources)}"
        print(f"resuming at {where} ({done:,} documents done)", file=sys.stderr)
    elif resume:
        print("no checkpoint to resume from: starting at the beginning", file=sys.stderr)
    # the pool forks before any output file is open, so no worker holds one
    pool = mp.get_context().Pool(workers, _init_worker, init) if workers > 1 else None
    try:
        outputs = _Outputs(output_prefix, keys, _SETTINGS["dtype"], state, fingerprint)
        report = _Progress(sources, disk_done, summary, progress, log_interval)
        try:
            last_checkpoint = -math.inf
            for step, res in _ordered_results(_jobs(sources, keys, position), pool, workers):
                _add_result(res, step, outputs.writers, summary, skip_bad_lines)
                summary.seconds = time.perf_counter() - t0
                report.update(step)
                since = time.monotonic() - last_checkpoint
                if since >= checkpoint_seconds or (step.last and since >= SOURCE_END_SECONDS):
                    outputs.checkpoint(step.after(), report.disk_done, summary)
                    last_checkpoint = time.monotonic()
            if not max(summary.documents.values()):
                names = ", ".join(str(s.path) for s in sources[:3])
                raise InputError(
                    f"{names}{' ...' if len(sources) > 3 else ''}: no documents (every record "
                    f"is empty or lacks the keys {keys}); nothing written"
                )
        except BaseException:
            report.close()
            outputs.discard(keep=resume)
            raise
        report.close()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    summary.outputs = outputs.finalize()
    summary.seconds = time.perf_counter() - t0
    return summary


def _add_result(res: dict, step: _Step, writers: dict, summary: TokenizeSummary, skip: bool):
    """Append one chunk's documents (raising on its first bad record unless ``skip``)."""
    for rec, msg in res["errors"]:
        where = f"{res['path']}: {record_unit(step.kind)} {rec}: {msg}"
        if not skip:
            raise InputError(where)
        summary.skipped_bad_lines += 1
        if len(summary.first_errors) < 5:
            summary.first_errors.append(where)
    for k, w in writers.items():
        lengths = res["lengths"][k]
        nonempty = lengths[lengths > 0]
        summary.skipped_empty[k] += lengths.size - nonempty.size
        w.add_documents(res["tokens"][k], nonempty)
        summary.documents[k] = w.num_documents
        summary.tokens[k] = w.num_tokens
    summary.input_bytes += res["bytes"]
    summary.lines += res["lines"]
    summary.invalid_utf8 += res["invalid_utf8"]


class _Progress:
    """The tqdm bar (input read on disk, rate, ETA; documents, tokens, text MB/s) and the
    ``log_interval`` lines."""

    def __init__(self, sources, disk_done: int, summary: TokenizeSummary, show, log_interval):
        from tqdm import tqdm

        self.ends = list(itertools.accumulate(s.size for s in sources))  # disk bytes after each
        self.disk_done, self.summary, self.log_interval = disk_done, summary, log_interval
        self.next_log = (max(summary.documents.values()) // max(log_interval, 1) + 1) * log_interval
        self.bar = tqdm(
            total=self.ends[-1] if self.ends else 0,
            initial=disk_done,
            unit="B",
            unit_scale=True,
            disable=not (sys.stderr.isatty() if show is None else show),
            desc="tokenize",
            smoothing=0.1,
        )

    def update(self, step: _Step) -> None:
        # estimates per chunk; exact at each source's end
        disk = self.ends[step.source] - self.disk_done if step.last else step.disk_bytes
        self.disk_done += disk
        self.bar.update(disk)
        s = self.summary
        rate = s.throughput()
        docs = max(s.documents.values())
        self.bar.set_postfix_str(
            f"{docs:,} docs, {sum(s.tokens.values()) / 1e6:.1f}M tokens, "
            f"text {rate['mb_per_s']:.2f} MB/s",
            refresh=False,
        )
        if self.log_interval and docs >= self.next_log:
            print(
                f"processed {docs} documents ({rate['docs_per_s']:.0f} docs/s, "
                f"{rate['mb_per_s']:.2f} MB/s)",
                file=sys.stderr,
            )
            self.next_log = (docs // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


def iter_texts(inputs: Sequence[str], json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Yield the text fields of every record (bad records skipped), one process, for training."""
    keys = list(json_keys)
    for src in expand_inputs(inputs):
        for chunk in read_chunks(src, keys):
            texts = parse_chunk(chunk.kind, chunk.payload, keys)[0]
            for record in zip(*(texts[k] for k in keys)):
                yield from record


def paragraphs(texts: Iterator[str], max_chars: int = 8192) -> Iterator[str]:
    """Split documents at blank lines (hard-wrapping huge paragraphs) for tokenizer training."""
    for text in texts:
        for para in text.split("\n\n"):
            for i in range(0, len(para), max_chars):
                piece = para[i : i + max_chars]
                if piece.strip():
                    yield piece
