"""Tokenizer training and tokenize.py: round trip, parallel order, formats, bad input, atomicity."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tapered_megatron.data import IndexedDataset, load_tokenizer, train_sentencepiece
from tapered_megatron.data.preprocess import InputError, iter_texts, paragraphs, tokenize_files
from tapered_megatron.data.sample_corpus import sample_corpus_docs

REPO = Path(__file__).resolve().parents[1]
TOKENIZE = [sys.executable, str(REPO / "data_tools/tokenize.py")]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """About 150 documents of the shipped corpus, plus unicode and edge cases."""
    out = sample_corpus_docs(limit=150)
    out += [
        "naïve café — 東京 😀 ünïcödé",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\n",
    ]
    return out


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory, docs) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    return train_sentencepiece(paragraphs(iter(docs)), prefix, vocab_size=600, num_threads=1)


def write_jsonl(path: Path, records: list, gz: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_tokenizer_specials_and_byte_fallback(tok_model):
    tok = load_tokenizer(tok_model)
    assert tok.vocab_size == 600
    assert (tok.eod_id, tok.bos_id, tok.pad_id) == (2, 1, 3)
    text = "Ω unseen ⊕ chars\nand a newline"
    assert tok.decode(tok.encode(text)) == text  # byte fallback: no <unk>
    assert 0 not in tok.encode(text)


@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip(tmp_path, docs, tok_model, workers):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    s = tokenize_files(
        [str(src)], str(tmp_path / "out"), tok_model, append_eod=True, workers=workers
    )
    tok = load_tokenizer(tok_model)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype == np.uint16
    assert ds.num_documents == s.documents["text"] == len(docs)
    assert ds.num_tokens == s.tokens["text"]
    for d, text in enumerate(docs):
        ids = ds.document(d).tolist()
        assert ids == [*tok.encode(text), tok.eod_id]
        assert tok.decode(ids[:-1]) == tok.decode(tok.encode(text))


def test_cli_workers_globs_gz_json_txt_multikey(tmp_path, docs, tok_model):
    recs = [{"text": d, "title": f"t{i}"} for i, d in enumerate(docs)]
    write_jsonl(tmp_path / "a.jsonl.gz", recs[:60], gz=True)
    write_jsonl(tmp_path / "b.jsonl", recs[60:100])
    (tmp_path / "c.json").write_text(json.dumps(recs[100:]))
    out = subprocess.run(
        [*TOKENIZE, "--input", str(tmp_path / "*.jsonl*"), str(tmp_path / "c.json"),
         "--json-keys", "text", "title", "--output-prefix", str(tmp_path / "o"),
         "--tokenizer-model", tok_model, "--workers", "2", "--log-interval", "50"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["documents"] == {"text": len(docs), "title": len(docs)}
    assert "processed 60 documents" in out.stderr  # logged per batch and "docs/s" in out.stderr
    tok = load_tokenizer(tok_model)
    titles = IndexedDataset(tmp_path / "o_title_document")
    texts = IndexedDataset(tmp_path / "o_text_document")
    for i in (0, 59, 60, 99, 100, len(docs) - 1):  # order kept across files and workers
        assert titles.document(i).tolist() == tok.encode(f"t{i}")
        assert texts.document(i).tolist() == tok.encode(docs[i])
    # txt: one document per line
    (tmp_path / "d.txt").write_text("first line\n\nthird line\n")
    s = tokenize_files([str(tmp_path / "d.txt")], str(tmp_path / "t"), tok_model)
    assert s.documents["text"] == 2 and s.skipped_empty["text"] == 1


def test_bad_lines(tmp_path, tok_model):
    lines = ['{"text": "good one"}', '{"text": broken', '{"other": "x"}', '{"text": 5}',
             '{"text": ""}', "", '{"text": "good two"}']  # fmt: skip
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "o")
    with pytest.raises(InputError, match=r"bad\.jsonl: line 2: invalid JSON"):
        tokenize_files([str(src)], out, tok_model)
    assert not list(tmp_path.glob("o_*"))  # nothing under final (or temporary) names
    s = tokenize_files([str(src)], out, tok_model, skip_bad_lines=True)
    assert s.skipped_bad_lines == 3 and s.skipped_empty["text"] == 1
    assert s.documents["text"] == 2
    assert "line 3: missing key 'text'" in s.first_errors[1]
    assert "line 4: key 'text' is int" in s.first_errors[2]
    # the CLI: one-line error naming file and line, exit 1, no output
    src.write_text('{"text": "ok"}\n{"other": 1}\n')
    r = subprocess.run(
        [*TOKENIZE, "--input", str(src), "--output-prefix", str(tmp_path / "c"),
         "--tokenizer-model", tok_model],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip() == f"error: {src}: line 2: missing key 'text' (has ['other'])"
    assert not list(tmp_path.glob("c_*"))


def test_invalid_utf8_and_missing_input(tmp_path, tok_model):
    src = tmp_path / "u.jsonl"
    src.write_bytes(b'{"text": "caf\xe9 ok"}\n{"text": "fine"}\n{"text": "lone \\ud800 half"}\n')
    s = tokenize_files([str(src)], str(tmp_path / "o"), tok_model)
    assert s.invalid_utf8 == 2 and s.documents["text"] == 3
    tok = load_tokenizer(tok_model)
    assert tok.decode(IndexedDataset(tmp_path / "o_text_document").document(0)) == "caf\ufffd ok"
    with pytest.raises(InputError, match="no such input file"):
        tokenize_files([str(tmp_path / "none*.jsonl")], str(tmp_path / "o"), tok_model)


@pytest.mark.parametrize("text", ["", "\n  \n\t\n", '{"text": ""}\n{"other": "x"}\n'])
def test_an_input_without_documents_is_an_error_naming_it(tmp_path, tok_model, text):
    src = tmp_path / "empty.jsonl"
    src.write_text(text)
    with pytest.raises(InputError, match=r"empty\.jsonl: no documents") as e:
        tokenize_files([str(src)], str(tmp_path / "o"), tok_model, skip_bad_lines=True)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_a_tokenizer_model_that_is_not_one_is_a_line_naming_it(tmp_path, capsys):
    """``--tokenizer-model`` given a text file: exit 1, one line naming the flag and the file,
    nothing written."""
    from tapered_megatron.data.cli import tokenize_main

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b c"}])
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o")]
    assert tokenize_main([*argv, "--tokenizer-model", str(notes)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --tokenizer-model {notes}: not a readable sentencepiece")
    assert "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "notes.txt"]


def test_a_long_document_is_encoded_in_segments_with_the_tokens_of_one_encode(tmp_path, tok_model):
    from tapered_megatron.data.preprocess import ENCODE_CHARS

    text = "\n\n".join(sample_corpus_docs(limit=400)) + " naïve  café — 東京 😀\tend"
    assert len(text) > 3 * ENCODE_CHARS and text.count("  ") > 10  # several cuts; double spaces
    src = write_jsonl(tmp_path / "long.jsonl", [{"text": text}, {"text": "a short one"}] * 2)
    tokenize_files([str(src)], str(tmp_path / "o"), tok_model, append_eod=True)
    tok = load_tokenizer(tok_model)
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert ds.document(0).tolist() == ds.document(2).tolist() == [*tok.encode(text), tok.eod_id]
    assert ds.document(3).tolist() == [*tok.encode("a short one"), tok.eod_id]


def peak_rss_kib(cmd: list[str]) -> int:
    """Peak resident memory (KiB) of the largest process among ``cmd`` and its children, read
    by a fresh parent (this process' own children would count too)."""
    probe = (
        "import resource, subprocess, sys; "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout)


@pytest.mark.parametrize(
    "mib", [8, pytest.param(50, marks=pytest.mark.slow)], ids=lambda m: f"{m}mib"
)
def test_a_huge_line_tokenizes_in_at_most_four_times_its_size(tmp_path, tok_model, mib):
    """One line of ``mib`` MiB without a newline: tokenize.py's peak memory above the same run
    on one short line stays below 4x the line, and the tokens equal the short text's repeated."""
    unit = " ".join(sample_corpus_docs(limit=40)).replace("\n", " ") + " "
    reps = (mib << 20) // len(unit.encode()) + 1
    src = write_jsonl(tmp_path / "huge.jsonl", [{"text": unit * reps}])
    size = src.stat().st_size
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": unit}])
    cmd = [*TOKENIZE, "--tokenizer-model", tok_model, "--workers", "2", "--no-progress"]
    base = peak_rss_kib([*cmd, "--input", str(small), "--output-prefix", str(tmp_path / "s")])
    peak = peak_rss_kib([*cmd, "--input", str(src), "--output-prefix", str(tmp_path / "h")])
    print(f"{size / 2**20:.1f} MiB line: peak {peak / 1024:.0f} MiB, base {base / 1024:.0f} MiB")
    assert (peak - base) * 1024 <= 4 * size, (peak, base, size)
    # the text is W + (" " + W) * (reps - 1) + " ": tokens of W, of " " + W after a word (reps - 1
    # times) and of the last space
    tok, word = load_tokenizer(tok_model), unit[:-1]
    first, x = tok.encode(word), len(tok.encode("x"))
    middle, last = tok.encode("x " + word)[x:], tok.encode("x ")[x:]
    ids = IndexedDataset(tmp_path / "h_text_document").document(0)
    assert ids.size == len(first) + (reps - 1) * len(middle) + len(last)
    assert ids[: len(first)].tolist() == first and ids[-len(last) :].tolist() == last
    assert (ids[len(first) : -len(last)].reshape(reps - 1, -1) == middle).all()


def test_interrupt_leaves_no_output(tmp_path, tok_model, monkeypatch):
    from tapered_megatron.data import preprocess

    src = write_jsonl(tmp_path / "c.jsonl", [{"text": f"doc {i}"} for i in range(5000)])
    calls = {"n": 0}
    real = preprocess.encode_batch

    def interrupted(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(batch)

    monkeypatch.setattr(preprocess, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize_files([str(src)], str(tmp_path / "o"), tok_model)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_train_tokenizer_cli(tmp_path, docs):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs[:40]])
    r = subprocess.run(
        [sys.executable, str(REPO / "data_tools/train_tokenizer.py"), "--input", str(src),
         "--vocab-size", "400", "--output", str(tmp_path / "tk"), "--threads", "1",
         "--model-type", "unigram"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(r.stdout)["vocab_size"] == 400
    assert load_tokenizer(tmp_path / "tk.model").vocab_size == 400
    assert (tmp_path / "tk.vocab").read_text().splitlines()[2].startswith("</s>")
    assert next(iter_texts([str(src)])) == docs[0]


def test_sigterm_mid_run_leaves_no_output(tmp_path, tok_model):
    import signal

    docs = sample_corpus_docs()
    src = write_jsonl(tmp_path / "big.jsonl", [{"text": d} for d in docs * 3])
    p = subprocess.Popen(
        [*TOKENIZE, "--input", str(src), "--output-prefix", str(tmp_path / "o"),
         "--tokenizer-model", tok_model, "--workers", "2", "--log-interval", "1", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = p.stderr.readline()  # the first progress line: the run is under way
    assert first.startswith("processed"), first
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted: no output written" in err
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]
