"""Text -> MMIDIDX: the engine behind ``data_tools/tokenize.py`` (streaming, parallel, ordered).

Inputs are read as raw bytes in batches by the main process; workers decode, parse and encode a
batch each; results come back in submission order with at most ``4 * workers`` batches in flight,
so memory stays bounded whatever the input size. Formats by extension (``.gz`` allowed on top):
``.jsonl`` one JSON object per line; ``.json`` a JSON array of objects (loaded whole) or jsonl;
``.txt`` one document per line.
"""

from __future__ import annotations

import collections
import glob
import gzip
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .indexed import IndexedDatasetWriter, token_dtype
from .tokenizer import load_tokenizer

BATCH_BYTES = 1 << 20
BATCH_LINES = 2048


class InputError(ValueError):
    """Bad input data; the message names the file and the line."""


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


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Expand globs (sorted, deduplicated, pattern order kept); fail on a pattern with no file."""
    out: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        hits = [h for h in hits if os.path.isfile(h)]
        if not hits:
            raise InputError(f"{pat}: no such input file")
        out.extend(h for h in hits if h not in out)
    return out


def input_format(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    if ext == ".json":
        return "json"
    if ext == ".txt":
        return "txt"
    raise InputError(
        f"{path}: unknown input format {ext!r} (use .jsonl, .json or .txt, optionally .gz)"
    )


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_batches(paths: Sequence[str]) -> Iterator[tuple]:
    """Yield ``(path, first_line_number, kind, items)`` batches of raw lines (or parsed objects)."""
    for path in paths:
        fmt = input_format(path)
        with _open(path) as f:
            if fmt == "json":
                head = f.read(4096)
                rest = head.lstrip()
                if rest.startswith(b"["):
                    data = head + f.read()
                    try:
                        objs = json.loads(data.decode("utf-8", errors="replace"))
                    except json.JSONDecodeError as e:
                        raise InputError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from e
                    for i in range(0, len(objs), BATCH_LINES):
                        yield path, i + 1, "obj", objs[i : i + BATCH_LINES]
                    continue
                f.seek(0)
                fmt = "jsonl"
            lines: list[bytes] = []
            size, first = 0, 1
            for lineno, line in enumerate(f, 1):
                lines.append(line)
                size += len(line)
                if size >= BATCH_BYTES or len(lines) >= BATCH_LINES:
                    yield path, first, fmt, lines
                    lines, size, first = [], 0, lineno + 1
            if lines:
                yield path, first, fmt, lines


_TOKENIZER = None
_SETTINGS: dict = {}


def _init_worker(model_path: str, keys: Sequence[str], append_eod: bool, dtype: str) -> None:
    global _TOKENIZER, _SETTINGS
    if mp.parent_process() is not None:  # pool worker: default SIGTERM so terminate() ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _TOKENIZER = load_tokenizer(model_path)
    _SETTINGS = {"keys": list(keys), "append_eod": append_eod, "dtype": np.dtype(dtype)}


def encode_batch(batch: tuple) -> dict:
    """Worker: parse and encode one batch. Bad lines are reported, never raised."""
    path, first, kind, items = batch
    keys, dtype = _SETTINGS["keys"], _SETTINGS["dtype"]
    eod = [_TOKENIZER.eod_id] if _SETTINGS["append_eod"] else []
    texts: dict[str, list[str]] = {k: [] for k in keys}
    errors: list[tuple[int, str]] = []
    nbytes = bad_utf8 = 0
    for i, item in enumerate(items):
        lineno = first + i
        if kind == "obj":
            obj = item
            nbytes += len(json.dumps(item))
        else:
            nbytes += len(item)
            try:
                line = item.decode("utf-8")
            except UnicodeDecodeError:
                line = item.decode("utf-8", errors="replace")
                bad_utf8 += 1
            if kind == "txt":
                texts[keys[0]].append(line.rstrip("\r\n"))
                continue
            if not line.strip():
                continue  # blank line between records
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append((lineno, f"invalid JSON ({e.msg} at column {e.colno})"))
                continue
        if not isinstance(obj, dict):
            errors.append((lineno, f"expected a JSON object, got {type(obj).__name__}"))
            continue
        missing = [k for k in keys if k not in obj]
        if missing:
            errors.append((lineno, f"missing key {missing[0]!r} (has {sorted(obj)[:5]})"))
            continue
        wrong = [k for k in keys if not isinstance(obj[k], str)]
        if wrong:
            errors.append(
                (lineno, f"key {wrong[0]!r} is {type(obj[wrong[0]]).__name__}, not a string")
            )
            continue
        for k in keys:
            texts[k].append(obj[k])
    out_tokens, out_lengths = {}, {}
    for k in keys:
        try:
            ids = _TOKENIZER.sp.encode(texts[k], num_threads=1) if texts[k] else []
        except (UnicodeEncodeError, TypeError):  # lone surrogates (JSON escapes): not UTF-8
            clean = [t.encode("utf-8", "replace").decode("utf-8") for t in texts[k]]
            bad_utf8 += sum(a != b for a, b in zip(texts[k], clean))
            ids = _TOKENIZER.sp.encode(clean, num_threads=1)
        if eod:
            for x in ids:
                if x:
                    x.extend(eod)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())
        )
        out_tokens[k], out_lengths[k] = flat, lengths
    return {
        "path": path,
        "lines": len(items),
        "errors": errors,
        "tokens": out_tokens,
        "lengths": out_lengths,
        "bytes": nbytes,
        "invalid_utf8": bad_utf8,
    }


def _ordered_results(batches: Iterator[tuple], workers: int, init_args: tuple) -> Iterator[dict]:
    if workers <= 1:
        _init_worker(*init_args)
        for b in batches:
            yield encode_batch(b)
        return
    with mp.get_context().Pool(workers, _init_worker, init_args) as pool:
        pending: collections.deque = collections.deque()
        for b in batches:
            pending.append(pool.apply_async(encode_batch, (b,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    return f"{output_prefix}_{key}_{level}"


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
) -> TokenizeSummary:
    """Tokenize ``inputs`` into ``PREFIX_{key}_document.{bin,idx}`` per key; returns the summary.

    Raises :class:`InputError` naming the file and line for a bad line unless ``skip_bad_lines``.
    On any error or interrupt the partial outputs are removed (final names never half-written).
    """
    t0 = time.perf_counter()
    paths = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer_model)
    dtype = np.dtype(token_dtype(tok.vocab_size))
    keys = list(json_keys)
    summary = TokenizeSummary(
        documents=dict.fromkeys(keys, 0),
        tokens=dict.fromkeys(keys, 0),
        skipped_empty=dict.fromkeys(keys, 0),
    )
    total = sum(os.path.getsize(p) for p in paths if not p.endswith(".gz")) or None
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="tokenize")
    writers = {k: IndexedDatasetWriter(output_prefix_for(output_prefix, k), dtype) for k in keys}
    next_log = log_interval
    try:
        init = (tokenizer_model, keys, append_eod, dtype.name)
        for res in _ordered_results(iter_batches(paths), workers, init):
            for lineno, msg in res["errors"]:
                where = f"{res['path']}: line {lineno}: {msg}"
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
            bar.update(res["bytes"])
            rate = summary.throughput()
            bar.set_postfix_str(f"{rate['docs_per_s']:.0f} docs/s, {rate['mb_per_s']:.2f} MB/s")
            ndocs = max(summary.documents.values())
            if log_interval and ndocs >= next_log:
                print(
                    f"processed {ndocs} documents ({rate['docs_per_s']:.0f} docs/s, "
                    f"{rate['mb_per_s']:.2f} MB/s)",
                    file=sys.stderr,
                )
                next_log = (ndocs // log_interval + 1) * log_interval
    except BaseException:
        bar.close()
        for w in writers.values():
            w.abort()
        raise
    bar.close()
    for k, w in writers.items():
        w.finalize()
        summary.outputs.append(output_prefix_for(output_prefix, k))
    summary.seconds = time.perf_counter() - t0
    return summary


def iter_texts(inputs: Sequence[str], json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Yield the text fields of every record (bad lines skipped), one process, for training."""
    for _path, _first, kind, items in iter_batches(expand_inputs(inputs)):
        for item in items:
            if kind == "obj":
                obj = item
            else:
                line = item.decode("utf-8", errors="replace")
                if kind == "txt":
                    yield line.rstrip("\r\n")
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
            if isinstance(obj, dict):
                yield from (obj[k] for k in json_keys if isinstance(obj.get(k), str))


def paragraphs(texts: Iterator[str], max_chars: int = 8192) -> Iterator[str]:
    """Split documents at blank lines (hard-wrapping huge paragraphs) for tokenizer training."""
    for text in texts:
        for para in text.split("\n\n"):
            for i in range(0, len(para), max_chars):
                piece = para[i : i + max_chars]
                if piece.strip():
                    yield piece
