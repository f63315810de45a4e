"""Inputs of the tokenizer: formats, discovery, and streamed reads in chunks with resume cursors.

A *source* is one input shard: a text file (``.jsonl``/``.ndjson``, ``.json``, ``.txt``, each
optionally ``.gz`` or ``.zst`` compressed; a bare ``.zst`` is jsonl), a Parquet file, or one Arrow
file of a Hugging Face ``datasets`` folder saved with ``save_to_disk`` (read with pyarrow alone;
the ``datasets`` package is not needed). :func:`read_chunks` streams a source as chunks of about
``BATCH_BYTES`` of text, each carrying the cursor just after it, and can start at any such
cursor, so an interrupted run restarts exactly where its last checkpoint was. Nothing is read
whole: text is decompressed as a stream, JSON arrays are parsed object by object, Parquet row
groups are read in record batches from a buffered stream, Arrow files batch by batch.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

BATCH_BYTES = 1 << 18  # text per chunk: ~50 ms of encoding, so workers finish together
BATCH_LINES = 2048  # at most this many records per chunk
MAX_RECORD_CHARS = 1 << 28  # a JSON array element longer than this is taken as malformed

_COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
_TEXT_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".txt": "txt"}
FORMATS_HELP = (
    ".jsonl, .json, .txt (each optionally .gz or .zst), .parquet, or a datasets folder saved "
    "with save_to_disk"
)


class InputError(ValueError):
    """Bad input data; the message names the file and the record."""


@dataclass(frozen=True)
class Source:
    """One input shard. ``format``: jsonl, json, txt, parquet or arrow; ``compression``: gz, zst
    or empty; ``size``: bytes on disk; ``mtime_ns`` tells a changed file on resume."""

    path: str
    format: str
    compression: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str, fmt: str, compression: str) -> Source:
        st = os.stat(path)
        return cls(path, fmt, compression, st.st_size, st.st_mtime_ns)


@dataclass
class Chunk:
    """A piece of a source. ``kind``: jsonl or txt (``payload`` is bytes of whole lines), obj
    (a list of parsed JSON values) or columns (``{key: pyarrow string array}``). ``first`` is
    the number of its first record (lines and objects count from 1, rows from 0), ``cursor``
    the position after it (stream offset, object or row index), ``disk_bytes`` its share of the
    file on disk (for progress)."""

    kind: str
    payload: object
    first: int
    records: int
    cursor: int
    disk_bytes: int


def record_unit(kind: str) -> str:
    """How errors name a record of this chunk kind."""
    return {"obj": "object", "columns": "row"}.get(kind, "line")


def first_record(src: Source) -> int:
    return 0 if src.format in ("parquet", "arrow") else 1


def source_format(path: str) -> tuple[str, str]:
    """``(format, compression)`` of a file, from its name."""
    name, compression = path, ""
    for ext, comp in _COMPRESSIONS.items():
        if name.lower().endswith(ext):
            name, compression = name[: -len(ext)], comp
            break
    ext = os.path.splitext(name)[1].lower()
    if ext in _TEXT_FORMATS:
        return _TEXT_FORMATS[ext], compression
    if compression == "zst" and not ext:
        return "jsonl", compression
    if ext in (".parquet", ".arrow") and not compression:
        return ext[1:], ""
    raise InputError(f"{path}: unknown input format {ext or name!r} (use {FORMATS_HELP})")


def _dataset_folder(path: str) -> list[Source]:
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):
        try:
            with open(state, encoding="utf-8") as f:
                files = [d["filename"] for d in json.load(f)["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{state}: not a datasets save_to_disk state file ({e})") from e
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise InputError(f"{path}: datasets folder lacks {missing[0]} named in state.json")
        return [Source.of(os.path.join(path, f), "arrow", "") for f in files]
    splits_file = os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits_file):
        with open(splits_file, encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        example = os.path.join(path, splits[0]) if splits else path
        raise InputError(
            f"{path}: a DatasetDict with splits {splits}; pass one split's folder, e.g. {example}"
        )
    raise InputError(
        f"{path}: a folder without state.json, so not a datasets save_to_disk folder; "
        "pass files or globs"
    )


def expand_inputs(patterns: Sequence[str]) -> list[Source]:
    """Expand files, globs and datasets folders into sources (globs sorted, duplicates dropped,
    pattern order kept); fail on a pattern that matches nothing or on an unknown format."""
    out: list[Source] = []
    seen: set[str] = set()
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        found: list[Source] = []
        for h in hits:
            if os.path.isdir(h):
                found.extend(_dataset_folder(h))
            elif os.path.isfile(h):
                found.append(Source.of(h, *source_format(h)))
        if not found:
            raise InputError(f"{pat}: no such input file")
        for s in found:
            if s.path not in seen:
                seen.add(s.path)
                out.append(s)
    return out


def read_chunks(
    src: Source, keys: Sequence[str], cursor: int = 0, first: int | None = None
) -> Iterator[Chunk]:
    """Stream ``src`` in chunks, starting at ``cursor`` (a chunk's ``cursor`` from an earlier
    read) whose first record is number ``first``."""
    first = first_record(src) if first is None else first
    try:
        if src.format == "parquet":
            yield from _parquet_chunks(src, keys, cursor, first)
        elif src.format == "arrow":
            yield from _arrow_chunks(src, keys, cursor, first)
        elif src.format == "json" and _starts_json_array(src):
            yield from _json_array_chunks(src, cursor, first)
        else:
            yield from _line_chunks(src, "txt" if src.format == "txt" else "jsonl", cursor, first)
    except (OSError, EOFError) as e:  # corrupt compressed data, unreadable file
        raise InputError(f"{src.path}: cannot read ({e})") from e
    except Exception as e:  # pyarrow and zstandard raise their own error types
        if type(e).__module__.split(".")[0] in ("pyarrow", "zstd", "zstandard"):
            raise InputError(f"{src.path}: cannot read ({e})") from e
        raise


# -- text formats ----------------------------------------------------------------------------
def _open(src: Source):
    """``(raw file, decompressed stream)``; the raw file's position measures progress on disk."""
    raw = open(src.path, "rb")  # noqa: SIM115 - returned to the caller, closed there
    if src.compression == "gz":
        return raw, gzip.GzipFile(fileobj=raw)
    if src.compression == "zst":
        import zstandard

        return raw, zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return raw, raw


def _starts_json_array(src: Source) -> bool:
    raw, stream = _open(src)
    with raw:
        return stream.read(4096).lstrip()[:1] == b"["


def _split_lines(region: bytes) -> Iterator[tuple[bytes, int]]:
    """Cut ``region`` (whole lines) into pieces of at most ``BATCH_LINES`` lines."""
    n = region.count(b"\n") + (not region.endswith(b"\n"))
    if n <= BATCH_LINES:
        yield region, n
        return
    start = 0
    while start < len(region):
        end = start
        for _ in range(BATCH_LINES):
            end = region.find(b"\n", end) + 1
            if end == 0 or end >= len(region):
                end = len(region)
                break
        piece = region[start:end]
        yield piece, piece.count(b"\n") + (not piece.endswith(b"\n"))
        start = end


def _line_chunks(src: Source, kind: str, cursor: int, first: int) -> Iterator[Chunk]:
    raw, stream = _open(src)
    with raw:
        if cursor and not src.compression:
            raw.seek(cursor)
        elif cursor:  # a compressed stream cannot seek: decompress up to the cursor
            left = cursor
            while left:
                skipped = len(stream.read(min(left, BATCH_BYTES)))
                if not skipped:
                    raise InputError(f"{src.path}: shorter than the recorded progress")
                left -= skipped
        offset, record, disk = cursor, first, raw.tell()
        carry: list[bytes] = []  # the start of a line that has no newline yet
        eof = False
        while not eof:
            block = stream.read(BATCH_BYTES)
            eof = not block
            end = len(block) if eof else block.rfind(b"\n") + 1
            if not end and not eof:  # inside a long line: joined once, at its end
                carry.append(block)
                continue
            buf = b"".join([*carry, block[:end]]) if carry else block[:end]
            carry = [block[end:]] if end < len(block) else []
            for piece, n in _split_lines(buf) if buf else ():
                offset += len(piece)
                now = raw.tell() if src.compression else offset
                yield Chunk(kind, piece, record, n, offset, now - disk)
                record, disk = record + n, now


def _json_array_chunks(src: Source, cursor: int, first: int) -> Iterator[Chunk]:
    """A JSON array of objects, parsed one object at a time (``cursor``: objects consumed)."""
    raw, stream = _open(src)
    with raw:
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
        decoder = json.JSONDecoder()
        buf, pos, eof, line = text.read(BATCH_BYTES), 0, False, 1
        pos = buf.index("[") + 1
        index, objs, size, disk = 0, [], 0, 0

        def fail(at: int, msg: str) -> InputError:
            return InputError(f"{src.path}: line {line + buf.count(chr(10), 0, at)}: {msg}")

        expect_value = True  # after "[" or ","
        while True:
            while True:  # skip blanks; refill when the buffer runs out
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                line += buf.count("\n", 0, pos)
                buf, pos = text.read(BATCH_BYTES), 0
                eof = not buf
            if pos == len(buf):
                raise fail(pos, "invalid JSON (the array is not closed)")
            if buf[pos] == "]" and not (expect_value and index):
                break
            if not expect_value:
                if buf[pos] != ",":
                    raise fail(pos, "invalid JSON (expected ',' or ']' after an array element)")
                pos, expect_value = pos + 1, True
                continue
            try:
                obj, end = decoder.raw_decode(buf, pos)
                if end == len(buf) and not eof:
                    raise json.JSONDecodeError("value may continue", buf, end)
            except RecursionError:  # the decoder recurses once per nesting level
                raise fail(
                    pos, "invalid JSON (nested deeper than Python's recursion limit)"
                ) from None
            except json.JSONDecodeError as e:
                if eof or len(buf) - pos > MAX_RECORD_CHARS:
                    raise fail(e.pos, f"invalid JSON ({e.msg})") from e
                line += buf.count("\n", 0, pos)
                more = text.read(max(BATCH_BYTES, len(buf)))
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            if index >= cursor:
                objs.append(obj)
                size += end - pos
            index, pos, expect_value = index + 1, end, False
            if size >= BATCH_BYTES or len(objs) >= BATCH_LINES:
                number = first + index - len(objs) - cursor
                yield Chunk("obj", objs, number, len(objs), index, raw.tell() - disk)
                objs, size, disk = [], 0, raw.tell()
        if objs:
            number = first + index - len(objs) - cursor
            yield Chunk("obj", objs, number, len(objs), index, src.size - disk)


# -- columnar formats ------------------------------------------------------------------------
def _check_schema(src: Source, schema, keys: Sequence[str]) -> None:
    import pyarrow as pa

    for k in keys:
        i = schema.get_field_index(k)
        if i < 0:
            raise InputError(
                f"{src.path}: no column {k!r} (columns: {schema.names[:8]}); pick with --json-keys"
            )
        t = schema.field(i).type
        is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or is_view(t)):
            raise InputError(f"{src.path}: column {k!r} holds {t}, not strings")


def _column_chunks(batches: Iterator, keys: Sequence[str], cursor: int, first: int, row: int):
    """Regroup record batches ``(batch, disk bytes)``, the first at row ``row``, into chunks of
    about ``BATCH_BYTES`` from row ``cursor`` on (big batches are cut). Arrays are copied
    compactly (a pickled slice would carry its whole buffer)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    pending, size, disk = [], 0, 0
    for batch, batch_disk in batches:
        n = batch.num_rows
        if row + n <= cursor:
            row += n
            continue
        if row < cursor:
            batch, row = batch.slice(cursor - row), cursor
        cols = [batch.column(k) for k in keys]
        lengths = [pc.binary_length(c) for c in cols]
        batch_bytes = sum(pc.sum(x).as_py() or 0 for x in lengths)
        step = max(1, batch.num_rows * BATCH_BYTES // max(batch_bytes, 1))
        for start in range(0, batch.num_rows, step):
            piece = [c.slice(start, step) for c in cols]
            rows = len(piece[0])
            pending.append(piece)
            size += batch_bytes * rows // max(batch.num_rows, 1)
            disk += batch_disk * rows // max(n, 1)
            row += rows
            if size >= BATCH_BYTES or sum(len(p[0]) for p in pending) >= BATCH_LINES:
                yield _columns_chunk(pa, pending, keys, row, first, disk, cursor)
                pending, size, disk = [], 0, 0
    if pending:
        yield _columns_chunk(pa, pending, keys, row, first, disk, cursor)


def _columns_chunk(pa, pending: list, keys, row: int, first: int, disk: int, cursor: int):
    payload = {k: pa.concat_arrays([cols[i] for cols in pending]) for i, k in enumerate(keys)}
    n = len(payload[keys[0]])
    return Chunk("columns", payload, first + row - n - cursor, n, row, disk)


def _parquet_chunks(src: Source, keys: Sequence[str], cursor: int, first: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src.path, buffer_size=1 << 20, pre_buffer=False)  # pages streamed
    _check_schema(src, pf.schema_arrow, keys)
    groups = [pf.metadata.row_group(g) for g in range(pf.metadata.num_row_groups)]
    start, skipped = 0, 0  # whole row groups before the cursor are not read at all
    while start < len(groups) and skipped + groups[start].num_rows <= cursor:
        skipped += groups[start].num_rows
        start += 1

    def batches():
        rows_per_batch = 64
        for g in range(start, len(groups)):
            group = groups[g]
            on_disk = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
            disk_per_row = on_disk / max(group.num_rows, 1)
            seen_rows = seen_bytes = 0
            for b in pf.iter_batches(rows_per_batch, [g], list(keys), use_threads=False):
                yield b, round(disk_per_row * b.num_rows)
                seen_rows += b.num_rows
                seen_bytes += b.nbytes
            if seen_rows:  # size the next group's batches to about a sixteenth of a chunk
                per_row = max(seen_bytes / seen_rows, 1.0)
                rows_per_batch = int(min(max(BATCH_BYTES / 16 / per_row, 8), 8192))

    yield from _column_chunks(batches(), keys, cursor, first, skipped)


def _arrow_chunks(src: Source, keys: Sequence[str], cursor: int, first: int) -> Iterator[Chunk]:
    import pyarrow as pa

    with pa.OSFile(src.path) as f:  # read, not mapped: resident memory stays one batch
        try:
            reader = pa.ipc.open_stream(f)
            it = iter(reader)
        except pa.ArrowInvalid:  # the random-access file format rather than a stream
            f.seek(0)
            reader = pa.ipc.open_file(f)
            it = (reader.get_batch(i) for i in range(reader.num_record_batches))
        _check_schema(src, reader.schema, keys)

        def batches():
            total = 0
            for b in it:
                share = min(b.nbytes, src.size - total)
                total += share
                yield b, share

        yield from _column_chunks(batches(), keys, cursor, first, 0)
