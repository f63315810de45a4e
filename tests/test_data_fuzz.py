"""Fuzzing the readers with hypothesis: corrupted ``.idx`` / ``.bin`` pairs and arbitrary
jsonl / json / txt inputs raise only our errors (naming the file), and nothing is written
outside the output prefix.

The default run keeps ``max_examples`` small (a few seconds); ``HYPOTHESIS_FUZZ_EXAMPLES=2000``
runs a long campaign with the same tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tapered_megatron.data import (
    IndexedDataset,
    IndexedDatasetError,
    train_sentencepiece,
    write_indexed_dataset,
)
from tapered_megatron.data.indexed import HEADER
from tapered_megatron.data.preprocess import InputError, paragraphs, tokenize_files
from tapered_megatron.data.sample_corpus import sample_corpus_docs

FUZZ = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_FUZZ_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def valid_pair(tmp_path_factory) -> tuple[bytes, bytes]:
    """The ``.idx`` and ``.bin`` bytes of a small valid dataset (uint16 tokens, 6 documents)."""
    prefix = tmp_path_factory.mktemp("valid") / "d"
    docs = [[1, 2, 3], [], [7] * 20, [255, 0], [9] * 5, [4, 4, 4, 4]]
    write_indexed_dataset(str(prefix), docs)
    return Path(f"{prefix}.idx").read_bytes(), Path(f"{prefix}.bin").read_bytes()


_FIELDS = {"version": 1, "code": 2, "n_seq": 3, "n_doc": 4}  # positions in HEADER's tuple


@FUZZ
@given(
    target=st.sampled_from(["idx", "bin"]),
    edits=st.lists(
        st.tuples(st.one_of(st.integers(0, HEADER.size + 8), st.integers(0, 1 << 20)),
                  st.integers(0, 255)),
        max_size=4,
    ),
    field=st.one_of(st.none(), st.tuples(st.sampled_from(sorted(_FIELDS)),
                                         st.integers(0, (1 << 64) - 1))),
    cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
    tail=st.binary(max_size=24),
)  # fmt: skip
@example(target="idx", edits=[], field=("n_seq", (1 << 64) - 1), cut=None, tail=b"")
@example(target="idx", edits=[], field=("n_doc", 0), cut=None, tail=b"")
@example(target="bin", edits=[], field=None, cut=3, tail=b"")
def test_indexed_reader_raises_only_its_own_error(
    valid_pair, tmp_path_factory, target, edits, field, cut, tail
):
    """Any corruption of either file: opening raises ``IndexedDatasetError`` naming the file,
    or the dataset opens and every sequence and document reads back with its indexed length.
    The reader writes nothing."""
    folder = tmp_path_factory.mktemp("fuzz_idx")
    data = {"idx": bytearray(valid_pair[0]), "bin": bytearray(valid_pair[1])}
    blob = data[target]
    if field is not None and target == "idx":
        values = list(HEADER.unpack_from(blob))
        name, value = field
        values[_FIELDS[name]] = value % (256 if name == "code" else 1 << 64)
        blob[: HEADER.size] = HEADER.pack(*values)
    for pos, byte in edits:
        if blob:
            blob[pos % len(blob)] = byte
    if cut is not None:
        del blob[cut % (len(blob) + 1) :]
    blob += tail
    prefix = folder / "d"
    Path(f"{prefix}.idx").write_bytes(data["idx"])
    Path(f"{prefix}.bin").write_bytes(data["bin"])
    before = _files(folder)
    try:
        ds = IndexedDataset(str(prefix), vocab_size=256)
    except IndexedDatasetError as e:
        assert str(e).startswith(f"{prefix}."), e
    else:
        assert sum(len(ds[i]) for i in range(len(ds))) == ds.num_tokens
        assert [len(ds[i]) for i in range(len(ds))] == ds.sizes.tolist()
        lengths = [len(ds.document(d)) for d in range(ds.num_documents)]
        assert lengths == ds.document_lengths.tolist()
        assert int(ds.tokens(0, ds.num_tokens).max(initial=0)) < 256
    assert _files(folder) == before


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    docs = paragraphs(iter(sample_corpus_docs(limit=60)))
    return train_sentencepiece(docs, prefix, vocab_size=600, num_threads=1)


def _json_values() -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=8,
    )


def _records() -> st.SearchStrategy:
    """Lines that are mostly plausible records: objects with or without a string ``text``,
    other JSON values, free text, deeply nested arrays, blank lines."""
    good = st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=40))
    return st.one_of(
        good,
        good,
        st.builds(lambda v: json.dumps({"text": v}), _json_values()),
        st.builds(json.dumps, _json_values()),
        st.text(max_size=40),
        st.integers(1, 5000).map(lambda n: "[" * n + "]" * (n % 3)),
        st.just(""),
    )


def _bodies() -> st.SearchStrategy:
    lines = st.lists(_records(), max_size=6)
    return st.one_of(
        st.binary(max_size=200),
        lines.map(lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass")),
        lines.map(lambda ls: ("[" + ",\n".join(ls) + "]").encode("utf-8", "surrogatepass")),
        st.tuples(lines, st.binary(min_size=1, max_size=4)).map(
            lambda t: ("\n".join(t[0]) + "\n").encode() + t[1]  # stray (invalid UTF-8) bytes
        ),
    )


@FUZZ
@given(ext=st.sampled_from(["jsonl", "json", "txt"]), body=_bodies(), skip=st.booleans())
@example(ext="jsonl", body=b"[" * 5000 + b"\n", skip=False)
@example(ext="jsonl", body=b'{"text": ' + b"[" * 5000 + b"}\n", skip=True)
@example(ext="json", body=b"[" * 5000, skip=False)
@example(ext="json", body=b'[{"text": "a"}, ' + b"[" * 5000 + b"]", skip=True)
def test_text_readers_raise_only_input_errors(tok_model, tmp_path_factory, ext, body, skip):
    """Any input bytes: ``tokenize_files`` either finishes, writing only the output prefix's
    files (which open as valid datasets holding the counted documents), or raises
    ``InputError`` naming the input and leaves nothing behind."""
    folder = tmp_path_factory.mktemp("fuzz_text")
    src = folder / "in" / f"data.{ext}"
    src.parent.mkdir()
    src.write_bytes(body)
    out = folder / "out" / "corpus"
    out.parent.mkdir()
    try:
        summary = tokenize_files([str(src)], str(out), tok_model, skip_bad_lines=skip)
    except InputError as e:
        assert str(src) in str(e), e
        assert list(out.parent.iterdir()) == []
    else:
        (prefix,) = summary.outputs
        assert prefix == f"{out}_text_document"
        ds = IndexedDataset(prefix, vocab_size=600)
        assert ds.num_documents == summary.documents["text"]
        written = {p.name for p in out.parent.iterdir()}
        assert written == {"corpus_text_document.bin", "corpus_text_document.idx"}
    assert sorted(p.name for p in folder.iterdir()) == ["in", "out"]
    assert [p.name for p in src.parent.iterdir()] == [src.name]
    assert src.read_bytes() == body
