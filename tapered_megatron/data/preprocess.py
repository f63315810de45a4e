"""Text -> MMIDIDX: the engine behind ``data_tools/tokenize.py`` (streaming, parallel, resumable).

The main process streams every source (:mod:`.sources`: jsonl/json/txt, optionally .gz/.zst,
Parquet, ``datasets`` folders) as ~1 MB chunks; a process pool parses and encodes one chunk per
task; results come back in submission order with at most ``4 * workers`` chunks in flight, and
the main process appends them to the outputs. Memory stays bounded whatever the input size:
reads stream, the queue between reader and workers is bounded, and the writer keeps nothing of
what it wrote. Outputs grow under ``.partial`` names, checkpointed at every source end and every
``checkpoint_seconds``; ``resume=True`` continues a killed run from its last checkpoint and gives
the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np

from .indexed import IndexedDatasetWriter, token_dtype
from .sources import InputError, Source, expand_inputs, read_chunks, record_unit
from .tokenizer import load_tokenizer

__all__ = ["InputError", "TokenizeSummary", "iter_texts", "paragraphs", "tokenize_files"]

PARTIAL = ".partial"  # suffix of every file of an unfinished run
STATE_VERSION = 1


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


def _init_worker(model_path: str, keys: Sequence[str], append_eod: bool, dtype: str) -> None:
    global _TOKENIZER, _SETTINGS
    if mp.parent_process() is not None:  # pool worker: default SIGTERM so terminate() ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _TOKENIZER is None or _TOKENIZER.model_path != model_path:  # forked: inherited already
        _TOKENIZER = load_tokenizer(model_path)
    _SETTINGS = {"keys": list(keys), "append_eod": append_eod, "dtype": np.dtype(dtype)}


def _encode(texts: list[str], dtype: np.dtype, eod: int | None) -> tuple[np.ndarray, ...]:
    """``(flat tokens, lengths, lines with lone surrogates)`` of a list of documents.

    Sentencepiece returns numpy arrays (no Python int per token); EODs go in with one insert.
    """
    bad = 0
    try:
        ids = _TOKENIZER.sp.encode(texts, num_threads=1, out_type="numpy")
    except (UnicodeEncodeError, TypeError):  # lone surrogates (JSON escapes): not UTF-8
        clean = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
        bad = sum(a != b for a, b in zip(texts, clean))
        ids = _TOKENIZER.sp.encode(clean, num_threads=1, out_type="numpy")
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate(ids).astype(dtype, copy=False) if ids else np.empty(0, dtype)
    if eod is not None:  # after every non-empty document
        nonempty = lengths > 0
        flat = np.insert(flat, np.cumsum(lengths)[nonempty], np.asarray(eod, dtype))
        lengths += nonempty
    return flat, lengths, bad


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


def _ordered_results(jobs: Iterator[tuple], workers: int, init_args: tuple) -> Iterator[tuple]:
    _init_worker(*init_args)  # before forking, so workers inherit the loaded tokenizer
    if workers <= 1:
        for step, batch in jobs:
            yield step, encode_batch(batch)
        return
    with mp.get_context().Pool(workers, _init_worker, init_args) as pool:
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
    return {
        "inputs": [[os.path.abspath(s.path), s.size, s.mtime_ns] for s in sources],
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
        what = name
        if name == "inputs":
            old = {p: (size, mtime) for p, size, mtime in recorded.get(name, [])}
            changed = [p for p, size, mtime in value if old.get(p) != (size, mtime)]
            what = f"input {changed[0]} (changed or new)" if changed else "the input list"
        raise InputError(
            f"{path}: the interrupted run had a different {what}; rerun without --resume "
            "to start over"
        )
    return state


def _save_state(path: str, state: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    ``skip_bad_lines``. Outputs grow under ``.partial`` names with a checkpoint at every source
    end and every ``checkpoint_seconds``; they are renamed into place when complete. On an error
    or interrupt the partial files are removed, unless ``resume``: then they are kept, and a
    later call with ``resume=True`` continues from the last checkpoint (same bytes as one
    uninterrupted run). A killed process leaves only ``.partial`` files behind.
    """
    t0 = time.perf_counter()
    sources = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer_model)
    dtype = np.dtype(token_dtype(tok.vocab_size))
    keys = list(json_keys)
    fingerprint = _fingerprint(sources, tokenizer_model, keys, append_eod)
    ckpt = state_path(output_prefix)
    state = _load_state(ckpt, fingerprint) if resume else None
    summary = TokenizeSummary(
        documents=dict.fromkeys(keys, 0),
        tokens=dict.fromkeys(keys, 0),
        skipped_empty=dict.fromkeys(keys, 0),
        sources=len(sources),
    )
    position, disk_done = (0, 0, None), 0
    if state:
        for f in fields(TokenizeSummary):
            if f.name in state["summary"]:
                setattr(summary, f.name, state["summary"][f.name])
        position, disk_done = tuple(state["position"]), state["disk_bytes"]
        summary.resumed_from_source = position[0]
        t0 -= summary.seconds
    ends = list(itertools.accumulate(s.size for s in sources))  # disk bytes after each source
    writers: dict[str, IndexedDatasetWriter] = {}
    try:
        for k in keys:
            writers[k] = IndexedDatasetWriter(
                output_prefix_for(output_prefix, k),
                dtype,
                tag=PARTIAL,
                resume=state["writers"][k] if state else None,
            )
    except BaseException:
        for w in writers.values():
            w.close()
        raise
    if not state and os.path.exists(ckpt):
        os.remove(ckpt)  # a stale checkpoint must never pair with the new files
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    bar = tqdm(
        total=ends[-1] if ends else 0,
        initial=disk_done,
        unit="B",
        unit_scale=True,
        disable=not progress,
        desc="tokenize",
        smoothing=0.1,
    )
    next_log = (max(summary.documents.values()) // max(log_interval, 1) + 1) * log_interval
    last_ckpt = time.monotonic()

    def checkpoint(step: _Step) -> None:
        pos = (step.source, step.cursor, step.next_record)
        if step.last:
            pos = (step.source + 1, 0, None)
        summary.seconds = time.perf_counter() - t0
        state = {
            "version": STATE_VERSION,
            "fingerprint": fingerprint,
            "position": pos,
            "disk_bytes": disk_done,
            "writers": {k: w.checkpoint() for k, w in writers.items()},
            "summary": asdict(summary),
        }
        _save_state(ckpt, state)

    try:
        init = (tokenizer_model, keys, append_eod, dtype.name)
        for step, res in _ordered_results(_jobs(sources, keys, position), workers, init):
            for rec, msg in res["errors"]:
                where = f"{res['path']}: {record_unit(step.kind)} {rec}: {msg}"
                if not skip_bad_lines:
                    raise InputError(where)
                summary.skipped_bad_lines += 1
                if len(summary.first_errors) < 5:
                    summary.first_errors.append(where)
            for k in keys:
                lengths, w = res["lengths"][k], writers[k]
                nonempty = lengths[lengths > 0]
                summary.skipped_empty[k] += lengths.size - nonempty.size
                w.add_documents(res["tokens"][k], nonempty)
                summary.documents[k] = w.num_documents
                summary.tokens[k] = w.num_tokens
            summary.input_bytes += res["bytes"]
            summary.lines += res["lines"]
            summary.invalid_utf8 += res["invalid_utf8"]
            summary.seconds = time.perf_counter() - t0
            disk = step.disk_bytes
            if step.last:  # estimates end exact: the whole file is done
                disk = ends[step.source] - disk_done
            disk_done += disk
            bar.update(disk)
            rate = summary.throughput()
            bar.set_postfix_str(
                f"{max(summary.documents.values()):,} docs, "
                f"{sum(summary.tokens.values()) / 1e6:.1f}M tokens, "
                f"text {rate['mb_per_s']:.2f} MB/s",
                refresh=False,
            )
            ndocs = max(summary.documents.values())
            if log_interval and ndocs >= next_log:
                print(
                    f"processed {ndocs} documents ({rate['docs_per_s']:.0f} docs/s, "
                    f"{rate['mb_per_s']:.2f} MB/s)",
                    file=sys.stderr,
                )
                next_log = (ndocs // log_interval + 1) * log_interval
            if step.last or time.monotonic() - last_ckpt >= checkpoint_seconds:
                checkpoint(step)
                last_ckpt = time.monotonic()
    except BaseException:
        bar.close()
        for w in writers.values():
            w.close() if resume else w.abort()
        if not resume and os.path.exists(ckpt):
            os.remove(ckpt)
        raise
    bar.close()
    for k, w in writers.items():
        w.finalize()
        summary.outputs.append(output_prefix_for(output_prefix, k))
    if os.path.exists(ckpt):
        os.remove(ckpt)
    summary.seconds = time.perf_counter() - t0
    return summary


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
