"""A reader of Megatron's indexed dataset files written from the byte layout alone (struct, no
project code): the independent check of what the data tests write."""

from __future__ import annotations

import struct
from pathlib import Path


def independent_read(prefix: str) -> tuple[str, list[list[list[int]]]]:
    """Reader written from the byte layout in system.md only (struct, no project code).

    b"MMIDIDX\\x00\\x00", <Q version, <B dtype code, <Q sequence count, <Q document-index count,
    int32 lengths, int64 byte pointers, int64 document indices. Returns (dtype, documents as
    lists of sequences).
    """
    codes = {1: ("B", 1), 2: ("b", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 8: ("H", 2)}
    names = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
    idx = Path(prefix + ".idx").read_bytes()
    data = Path(prefix + ".bin").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", idx, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", idx, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", idx, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", idx, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", idx, off)
    off += 8 * n_seq
    doc_index = struct.unpack_from(f"<{n_doc}q", idx, off)
    assert off + 8 * n_doc == len(idx)
    fmt, size = codes[code]
    seqs = [list(struct.unpack_from(f"<{n}{fmt}", data, p)) for n, p in zip(lengths, pointers)]
    assert sum(lengths) * size == len(data)
    docs = [seqs[doc_index[d] : doc_index[d + 1]] for d in range(n_doc - 1)]
    return names[code], docs
