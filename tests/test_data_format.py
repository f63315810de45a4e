"""MMIDIDX format: Megatron-LM's own files, an independent reader, and every malformed-file case."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from indexed_reader import independent_read

from tapered_megatron.data import IndexedDataset, IndexedDatasetError, write_indexed_dataset
from tapered_megatron.data.indexed import token_dtype

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["megatron_u16_text_document", "megatron_i32_text_document"])
def test_megatron_fixtures_read_exactly(name):
    expected = json.loads((FIXTURES / "megatron_fixtures.json").read_text())[name]
    ds = IndexedDataset(FIXTURES / name)
    assert ds.dtype.name == expected["dtype"]
    assert ds.num_documents == len(expected["documents"])
    for d, doc in enumerate(expected["documents"]):
        assert [s.tolist() for s in ds.document_sequences(d)] == doc
        assert ds.document(d).tolist() == [t for seq in doc for t in seq]
    assert ds.document_lengths.tolist() == [sum(map(len, doc)) for doc in expected["documents"]]
    # and the independent reader agrees with Megatron's JSON (checks the checker itself)
    assert independent_read(str(FIXTURES / name)) == (expected["dtype"], expected["documents"])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_files_pass_independent_reader_and_match_megatron_bytes(tmp_path, dtype):
    name = "megatron_u16_text_document" if dtype == np.uint16 else "megatron_i32_text_document"
    expected = json.loads((FIXTURES / name.replace(name, "megatron_fixtures.json")).read_text())
    docs = expected[name]["documents"]
    prefix = str(tmp_path / "ours_text_document")
    write_indexed_dataset(prefix, docs, dtype=dtype)
    assert independent_read(prefix) == (np.dtype(dtype).name, docs)
    # byte-identical to what Megatron-LM wrote for the same documents
    for ext in (".idx", ".bin"):
        assert Path(prefix + ext).read_bytes() == (FIXTURES / (name + ext)).read_bytes()


def test_dtype_rule():
    assert token_dtype(32000) is np.uint16
    assert token_dtype(65499) is np.uint16
    assert token_dtype(65500) is np.int32
    assert token_dtype(128256) is np.int32


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "d_text_document")
    for ext in (".idx", ".bin"):
        shutil.copy(FIXTURES / ("megatron_u16_text_document" + ext), prefix + ext)
        os.chmod(prefix + ext, 0o644)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _fails(prefix, *fragments, vocab_size=None):
    with pytest.raises(IndexedDatasetError) as e:
        IndexedDataset(prefix, vocab_size=vocab_size)
    msg = str(e.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_wrong_magic(good):
    _patch(good + ".idx", 0, b"NOTMAGIC!")
    _fails(good, good + ".idx", "wrong magic")


def test_wrong_version(good):
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    _fails(good, good + ".idx", "unsupported version 2")


def test_unknown_dtype_code(good):
    _patch(good + ".idx", 17, struct.pack("<B", 9))
    _fails(good, good + ".idx", "unknown dtype code 9")


def test_truncated_idx(good):
    os.truncate(good + ".idx", os.path.getsize(good + ".idx") - 8)
    _fails(good, good + ".idx", "truncated index")
    os.truncate(good + ".idx", 20)
    _fails(good, good + ".idx", "truncated index")


def test_trailing_bytes_idx(good):
    with open(good + ".idx", "ab") as f:
        f.write(b"\0" * 8)
    _fails(good, good + ".idx", "trailing bytes")


def test_truncated_bin(good):
    os.truncate(good + ".bin", os.path.getsize(good + ".bin") - 2)
    _fails(good, good + ".bin", "truncated data")


def test_bin_larger_than_index(good):
    with open(good + ".bin", "ab") as f:
        f.write(b"\0" * 4)
    _fails(good, good + ".bin", "do not match")


def test_dtype_mismatch_detected_by_size(good):
    _patch(good + ".idx", 17, struct.pack("<B", 4))  # says int32, data is uint16
    _fails(good, good + ".idx", "dtype mismatch", "int32")


def test_inconsistent_pointer(good):
    n_seq = struct.unpack_from("<Q", Path(good + ".idx").read_bytes(), 18)[0]
    _patch(good + ".idx", 34 + 4 * n_seq + 8 * 3, struct.pack("<q", 7))
    _fails(good, good + ".idx", "pointer of sequence 3")


def test_bad_document_index(good):
    raw = Path(good + ".idx").read_bytes()
    _patch(good + ".idx", len(raw) - 8, struct.pack("<q", 99))
    _fails(good, good + ".idx", "document index")


def test_missing_files(good):
    os.remove(good + ".bin")
    _fails(good, good + ".bin", "not found")
    _fails(good + "_nope", "index file not found")


def test_vocab_mismatch(good):
    _fails(good, good + ".bin", "outside the vocabulary [0, 1000)", vocab_size=1000)
    _fails(good, "cannot hold", vocab_size=100_000)  # uint16 file, 100k vocabulary
    IndexedDataset(good, vocab_size=32000)  # ids all < 32000: fine


def test_empty_documents_and_writer_abort(tmp_path):
    from tapered_megatron.data import IndexedDatasetWriter

    prefix = str(tmp_path / "x")
    write_indexed_dataset(prefix, [[1, 2], [], [3]])
    ds = IndexedDataset(prefix)
    assert ds.document_lengths.tolist() == [2, 0, 1]
    assert ds.document(1).tolist() == []
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "y") as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == sorted(os.listdir(tmp_path)) and not any(
        n.startswith("y") for n in os.listdir(tmp_path)
    )
