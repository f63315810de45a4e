"""Corpus-scale data: Parquet, .zst, datasets folders, mixes; resume after a kill; merge; sample."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from indexed_reader import independent_read

from tapered_megatron.data import IndexedDataset, load_tokenizer, train_sentencepiece
from tapered_megatron.data import sources as sources_mod
from tapered_megatron.data.dataset_tools import merge_datasets, sample_dataset
from tapered_megatron.data.preprocess import InputError, iter_texts, paragraphs, tokenize_files
from tapered_megatron.data.sample_corpus import sample_corpus_docs

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "data_tools"


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """120 documents of the shipped corpus, plus unicode and edge cases."""
    return [*sample_corpus_docs(limit=120), "naïve café — 東京 😀", " spaces ", "tab\tand\nline"]


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory, docs) -> str:
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    return train_sentencepiece(paragraphs(iter(docs)), prefix, vocab_size=600, num_threads=1)


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def write_parquet(path: Path, texts: list, row_group_size: int) -> Path:
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_dataset_folder(path: Path, texts: list[str], shards: int) -> Path:
    import datasets  # the dev extra installs it: missing is a failure, not a skip

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
    ds.save_to_disk(str(path), num_shards=shards)
    return path


def make_mix(tmp: Path, docs: list[str]) -> tuple[list[str], list[str]]:
    """Every format in one folder; returns (input arguments, documents in input order)."""
    parts = np.array_split(np.arange(len(docs)), 7)
    d = [[docs[i] for i in p] for p in parts]
    write_parquet(tmp / "a.parquet", d[0], row_group_size=5)  # several row groups
    (tmp / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(d[1])))
    write_dataset_folder(tmp / "c_saved", d[2], shards=2)
    (tmp / "d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(d[3])))
    (tmp / "e.json").write_text(json.dumps([{"text": t} for t in d[4]], indent=1))
    (tmp / "f.jsonl").write_bytes(jsonl_bytes(d[5]))
    # a bare .zst made of two frames (concatenated compressions): read across frames
    half = len(d[6]) // 2
    frames = [
        zstandard.ZstdCompressor().compress(jsonl_bytes(x)) for x in (d[6][:half], d[6][half:])
    ]
    (tmp / "g.zst").write_bytes(b"".join(frames))
    names = ["a.parquet", "b.jsonl.zst", "c_saved", "d.jsonl.gz", "e.json", "f.jsonl", "g.zst"]
    inputs = [str(tmp / n) for n in names]
    return inputs, [t for part in d for t in part]


def assert_tokens(prefix: Path, texts: list[str], tok_model: str, eod: bool = True) -> None:
    tok = load_tokenizer(tok_model)
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(texts)
    for i, text in enumerate(texts):
        assert ds.document(i).tolist() == tok.encode(text) + ([tok.eod_id] if eod else []), i


@pytest.mark.parametrize("fmt", ["parquet", "zst", "datasets"])
def test_each_format_round_trips(tmp_path, docs, tok_model, fmt):
    if fmt == "parquet":
        src = write_parquet(tmp_path / "x.parquet", docs, row_group_size=17)
        assert pq.ParquetFile(src).metadata.num_row_groups == 8
    elif fmt == "zst":
        src = tmp_path / "x.jsonl.zst"
        src.write_bytes(zstandard.ZstdCompressor(level=5).compress(jsonl_bytes(docs)))
    else:
        src = write_dataset_folder(tmp_path / "saved", docs, shards=3)
    s = tokenize_files([str(src)], str(tmp_path / "o"), tok_model, append_eod=True)
    assert s.documents["text"] == len(docs) and s.input_bytes > 0
    assert_tokens(tmp_path / "o_text_document", docs, tok_model)
    assert list(iter_texts([str(src)])) == docs


def test_mixed_formats_in_one_run(tmp_path, docs, tok_model, monkeypatch):
    monkeypatch.setattr(sources_mod, "BATCH_BYTES", 20_000)  # many chunks, cut mid-file
    inputs, order = make_mix(tmp_path, docs)
    s = tokenize_files(inputs, str(tmp_path / "o"), tok_model, append_eod=True, workers=2)
    assert s.sources == 8  # the datasets folder is two Arrow shards
    assert_tokens(tmp_path / "o_text_document", order, tok_model)
    assert list(iter_texts(inputs)) == order


def test_json_array_streams_object_by_object(tmp_path, docs, tok_model, monkeypatch):
    monkeypatch.setattr(sources_mod, "BATCH_BYTES", 300)  # objects straddle every read
    src = tmp_path / "a.json"
    src.write_text(json.dumps([{"text": t, "n": 1.5} for t in docs[:30]], indent=2))
    tokenize_files([str(src)], str(tmp_path / "o"), tok_model)
    assert_tokens(tmp_path / "o_text_document", docs[:30], tok_model, eod=False)
    for bad, where in [
        ('[\n {"text": "a"},\n {"text": "b",,}\n]', "line 3: invalid JSON"),
        ('[{"text": "a"},\n\n {"text": "b"},]', "line 3: invalid JSON"),
        ('[{"text": "a"}\n {"text": "b"}]', "line 2: invalid JSON .expected ','"),
        ('[{"text": "a"},', "line 1: invalid JSON .the array is not closed"),
    ]:
        src.write_text(bad)
        with pytest.raises(InputError, match=rf"a\.json: {where}"):
            tokenize_files([str(src)], str(tmp_path / "o"), tok_model)
    src.write_text("[]")  # an empty array is an input without documents: said, not written
    with pytest.raises(InputError, match=r"a\.json: no documents"):
        tokenize_files([str(src)], str(tmp_path / "o"), tok_model)


def test_chunks_restart_at_every_cursor(tmp_path, docs, monkeypatch):
    """Reading from a chunk's cursor gives the rest of the source, numbered as before."""
    from tapered_megatron.data.preprocess import parse_chunk

    monkeypatch.setattr(sources_mod, "BATCH_BYTES", 40_000)
    inputs, _ = make_mix(tmp_path, docs)
    for src in sources_mod.expand_inputs(inputs):
        chunks = list(sources_mod.read_chunks(src, ["text"]))
        assert len(chunks) > 1 or src.size < 60_000, src
        texts = [parse_chunk(c.kind, c.payload, ["text"])[0]["text"] for c in chunks]
        for k, c in enumerate(chunks[:-1]):
            rest = list(sources_mod.read_chunks(src, ["text"], c.cursor, c.first + c.records))
            assert rest[0].first == chunks[k + 1].first, (src.path, k)
            got = [t for r in rest for t in parse_chunk(r.kind, r.payload, ["text"])[0]["text"]]
            assert got == [t for part in texts[k + 1 :] for t in part], (src.path, k)


def test_bad_columnar_inputs(tmp_path, tok_model):
    src = write_parquet(tmp_path / "n.parquet", ["good", None, "fine"], row_group_size=2)
    with pytest.raises(InputError, match=r"n\.parquet: row 1: key 'text' is null"):
        tokenize_files([str(src)], str(tmp_path / "o"), tok_model)
    assert not list(tmp_path.glob("o*"))
    s = tokenize_files([str(src)], str(tmp_path / "o"), tok_model, skip_bad_lines=True)
    assert s.documents["text"] == 2 and s.skipped_bad_lines == 1
    with pytest.raises(InputError, match=r"no column 'body' \(columns: \['id', 'text'\]\)"):
        tokenize_files([str(src)], str(tmp_path / "p"), tok_model, json_keys=["body"])
    with pytest.raises(InputError, match="column 'id' holds int64, not strings"):
        tokenize_files([str(src)], str(tmp_path / "p"), tok_model, json_keys=["id"])
    import datasets  # the dev extra installs it: missing is a failure, not a skip

    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"text": ["x", "y"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"DatasetDict with splits \['train', 'test'\]; pass one"):
        tokenize_files([str(tmp_path / "dd")], str(tmp_path / "p"), tok_model)
    s = tokenize_files([str(tmp_path / "dd/test")], str(tmp_path / "p"), tok_model)
    assert s.documents["text"] == 2
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError, match=r"plain: a folder without state\.json"):
        tokenize_files([str(tmp_path / "plain")], str(tmp_path / "q"), tok_model)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=r"x\.csv: unknown input format '\.csv' \(use \.jsonl"):
        tokenize_files([str(tmp_path / "x.csv")], str(tmp_path / "q"), tok_model)
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstd data at all")
    with pytest.raises(InputError, match=r"bad\.jsonl\.zst: cannot read"):
        tokenize_files([str(tmp_path / "bad.jsonl.zst")], str(tmp_path / "q"), tok_model)
    assert not list(tmp_path.glob("q*"))


def test_progress_bar_and_summary(tmp_path, docs, tok_model, capsys):
    src = tmp_path / "c.jsonl.zst"
    src.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(docs)))
    tokenize_files([str(src)], str(tmp_path / "o"), tok_model, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("tokenize: 100%"), bar
    assert f"{len(docs):,} docs" in bar and "M tokens" in bar and "MB/s" in bar, bar
    assert "<00:00" in bar, bar  # the ETA
    r = subprocess.run(
        [sys.executable, str(TOOLS / "tokenize.py"), "--input", str(src), "--output-prefix",
         str(tmp_path / "p"), "--tokenizer-model", tok_model, "--no-progress"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"text: {len(docs)} documents" in r.stderr
    assert "1 inputs, " in r.stderr and " MB/s, " in r.stderr and " tok/s" in r.stderr


def _tokenize_cmd(inputs: list[str], out: Path, tok_model: str, *extra: str) -> list[str]:
    return [sys.executable, str(TOOLS / "tokenize.py"), "--input", *inputs, "--output-prefix",
            str(out), "--tokenizer-model", tok_model, "--append-eod", "--workers", "2",
            "--no-progress", "--log-interval", "1", *extra]  # fmt: skip


def _final_outputs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".idx"))


def _kill_after(cmd: list[str], results: int) -> None:
    """Start ``cmd`` in its own session and SIGKILL all of it after ``results`` progress lines."""
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = 0
    while seen < results:
        line = p.stderr.readline()
        assert line, f"run ended before {results} results"
        seen += line.startswith("processed")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    p.stderr.close()


def test_kill_then_resume_is_byte_identical(tmp_path, docs, tok_model):
    src = tmp_path / "in"
    src.mkdir()
    many = docs * 4
    inputs, order = make_mix(src, many)
    ref = tmp_path / "ref"
    ref.mkdir()
    tokenize_files(inputs, str(ref / "o"), tok_model, append_eod=True)
    expected = {n: (ref / n).read_bytes() for n in _final_outputs(ref)}
    assert sorted(expected) == ["o_text_document.bin", "o_text_document.idx"]

    seed = int.from_bytes(os.urandom(4), "little")
    point = random.Random(seed).randrange(2, 8)  # of the 8 inputs' results, before the kill
    out = tmp_path / "out"
    out.mkdir()
    cmd = _tokenize_cmd(inputs, out / "o", tok_model, "--checkpoint-seconds", "0")
    _kill_after(cmd, point)
    assert _final_outputs(out) == [], f"seed {seed}"  # nothing looks finished
    assert (out / "o.tokenize.partial").exists(), f"seed {seed}"
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True)
    assert r.returncode == 0, (seed, r.stderr)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["resumed_from_source"] is not None, f"seed {seed}"
    assert summary["documents"]["text"] == len(order)
    assert {n: (out / n).read_bytes() for n in _final_outputs(out)} == expected, f"seed {seed}"
    assert sorted(os.listdir(out)) == sorted(expected), f"seed {seed}"  # partial files gone

    # killed again; rerun without --resume: starts over, same bytes, no partial files left
    _kill_after(cmd, point)
    subprocess.run(cmd, capture_output=True, check=True)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == expected


@pytest.mark.parametrize("checkpoint_seconds", [0.0, 1e9])
def test_resume_at_any_chunk_of_any_format(
    tmp_path, docs, tok_model, monkeypatch, checkpoint_seconds
):
    """Interrupt at a random chunk (small chunks: mid-Parquet, mid-Arrow, mid-stream) with a
    checkpoint after every chunk, or only at input ends (the data after it cut on resume)."""
    from tapered_megatron.data import preprocess

    monkeypatch.setattr(sources_mod, "BATCH_BYTES", 30_000)
    inputs, order = make_mix(tmp_path, docs)
    kw = dict(append_eod=True, checkpoint_seconds=checkpoint_seconds)
    calls = {"n": 0, "stop": 0}
    real = preprocess.encode_batch

    def counted(batch):
        calls["n"] += 1
        if calls["n"] == calls["stop"]:
            raise KeyboardInterrupt
        return real(batch)

    monkeypatch.setattr(preprocess, "encode_batch", counted)
    tokenize_files(inputs, str(tmp_path / "ref"), tok_model, **kw)
    assert calls["n"] > 12  # chunks
    seed = int.from_bytes(os.urandom(4), "little")
    calls.update(stop=random.Random(seed).randrange(2, calls["n"]), n=0)
    with pytest.raises(KeyboardInterrupt):
        tokenize_files(inputs, str(tmp_path / "o"), tok_model, resume=True, **kw)
    monkeypatch.setattr(preprocess, "encode_batch", real)
    s = tokenize_files(inputs, str(tmp_path / "o"), tok_model, resume=True, **kw)
    assert s.documents["text"] == len(order) and s.lines == len(order), f"seed {seed}"
    for ext in (".bin", ".idx"):
        got = (tmp_path / f"o_text_document{ext}").read_bytes()
        assert got == (tmp_path / f"ref_text_document{ext}").read_bytes(), f"seed {seed}"
    assert not list(tmp_path.glob("o*.partial*"))


def test_interrupt_with_resume_keeps_progress_and_checks_inputs(tmp_path, docs, tok_model):
    parts = [tmp_path / f"s{i}.jsonl" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(jsonl_bytes(docs[i * 40 : (i + 1) * 40]))
    inputs = [str(tmp_path / "s*.jsonl")]
    p = subprocess.Popen(_tokenize_cmd(inputs, tmp_path / "o", tok_model, "--resume"),
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stderr.readline().startswith("no checkpoint to resume from")
    for _ in range(2):  # the second result is logged after the first input's checkpoint
        assert p.stderr.readline().startswith("processed")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "progress kept at the last checkpoint" in err, err
    assert (tmp_path / "o.tokenize.partial").exists() and not _final_outputs(tmp_path)
    parts[2].write_bytes(jsonl_bytes(docs[80:100]))  # an input changes before the resume
    with pytest.raises(InputError, match=r"different input list, or an input file changed"):
        tokenize_files(inputs, str(tmp_path / "o"), tok_model, append_eod=True, resume=True)
    s = tokenize_files(inputs, str(tmp_path / "o"), tok_model, append_eod=True)  # starts over
    assert s.resumed_from_source is None and s.documents["text"] == 100
    assert _final_outputs(tmp_path) == ["o_text_document.bin", "o_text_document.idx"]
    assert not list(tmp_path.glob("*.partial*"))


def test_second_writer_of_the_same_prefix_is_refused(tmp_path, docs, tok_model):
    from tapered_megatron.data import IndexedDatasetError, IndexedDatasetWriter

    src = tmp_path / "a.jsonl"
    src.write_bytes(jsonl_bytes(docs[:5]))
    holder = IndexedDatasetWriter(tmp_path / "o_text_document", tag=".partial")
    with pytest.raises(IndexedDatasetError, match="another process is writing this dataset"):
        tokenize_files([str(src)], str(tmp_path / "o"), tok_model)
    holder.abort()


def test_merge_equals_tokenizing_the_concatenation(tmp_path, docs, tok_model):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    a.write_bytes(jsonl_bytes(docs[:50]))
    write_parquet(b, docs[50:], row_group_size=30)
    for name, src in (("A", a), ("B", b)):
        tokenize_files([str(src)], str(tmp_path / name), tok_model, append_eod=True)
    tokenize_files([str(a), str(b)], str(tmp_path / "AB"), tok_model, append_eod=True)
    r = subprocess.run(
        [sys.executable, str(TOOLS / "merge_datasets.py"), "--inputs",
         str(tmp_path / "A_text_document"), str(tmp_path / "B_text_document.bin"),
         "--output-prefix", str(tmp_path / "M_text_document")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(r.stdout)["documents"] == len(docs)
    for ext in (".bin", ".idx"):
        merged = (tmp_path / f"M_text_document{ext}").read_bytes()
        assert merged == (tmp_path / f"AB_text_document{ext}").read_bytes(), ext
    # multi-sequence documents (Megatron's sentence-split files) keep their structure
    fixture = str(REPO / "tests/fixtures/megatron_u16_text_document")
    merge_datasets([fixture, fixture], str(tmp_path / "F"))
    _, docs_one = independent_read(fixture)
    assert independent_read(str(tmp_path / "F")) == ("uint16", docs_one * 2)
    with pytest.raises(Exception, match="token dtypes differ"):
        merge_datasets([fixture, str(REPO / "tests/fixtures/megatron_i32_text_document")], "x")


def test_sample_exact_tokens_and_disjoint_rest(tmp_path, docs, tok_model):
    tokenize_files([str(write_parquet(tmp_path / "c.parquet", docs, 50))], str(tmp_path / "c"),
                   tok_model, append_eod=True)  # fmt: skip
    full = IndexedDataset(tmp_path / "c_text_document")
    r = subprocess.run(
        [sys.executable, str(TOOLS / "sample_dataset.py"), "--input",
         str(tmp_path / "c_text_document"), "--tokens", "2.5K", "--output-prefix",
         str(tmp_path / "s"), "--rest-prefix", str(tmp_path / "r")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    head = IndexedDataset(tmp_path / "s")
    assert head.num_tokens == 2500
    assert np.array_equal(head.tokens(0, 2500), full.tokens(0, 2500))  # the first 2,500 tokens
    cut = json.loads(r.stdout)["cut_document"]
    assert head.num_documents == cut + 1
    rest = IndexedDataset(tmp_path / "r")
    assert [rest.document(i).tolist() for i in range(rest.num_documents)] == [
        full.document(d).tolist() for d in range(cut + 1, full.num_documents)
    ]
    # seeded: exact count, documents in input order, the rest disjoint and complete
    src = str(tmp_path / "c_text_document")
    out = sample_dataset(src, str(tmp_path / "h"), 7000, seed=3, rest_prefix=str(tmp_path / "t"))
    held, train = IndexedDataset(tmp_path / "h"), IndexedDataset(tmp_path / "t")
    assert held.num_tokens == 7000
    whole = [full.document(d).tolist() for d in range(full.num_documents)]
    cut = out["cut_document"]
    picked = []
    for i in range(held.num_documents):
        ids = held.document(i).tolist()
        picked.append(whole.index(ids) if ids in whole else cut)
        assert ids == whole[picked[-1]][: len(ids)]
    assert cut in picked and picked == sorted(set(picked))
    rest = [d for d in range(full.num_documents) if d not in picked]
    assert [train.document(i).tolist() for i in range(train.num_documents)] == [
        whole[d] for d in rest
    ]
    sample_dataset(src, str(tmp_path / "h2"), 7000, seed=3)  # the seed decides everything
    assert (tmp_path / "h2.bin").read_bytes() == (tmp_path / "h.bin").read_bytes()
    with pytest.raises(Exception, match=r"asked for 9999999 tokens, the dataset has"):
        sample_dataset(str(tmp_path / "c_text_document"), str(tmp_path / "z"), 9_999_999)
    bad = subprocess.run(
        [sys.executable, str(TOOLS / "sample_dataset.py"), "--input", "x", "--tokens", "1.5",
         "--output-prefix", "y"], capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "a token count is a positive whole number" in bad.stderr


@pytest.mark.slow
def test_memory_bounded_whatever_the_input_size(tmp_path):
    """Peak memory of tokenize.py (main + 2 workers) on 0.05 and 0.2 GB of mixed formats."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_tokenize.py"), "--skip-throughput",
         "--workers", "2", "--memory-gb", "0.05", "0.2", "--tmp", str(tmp_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    small, big = [json.loads(x) for x in r.stdout.splitlines() if '"tokenize_memory"' in x]
    assert big["gb_text"] > 3.5 * small["gb_text"]
    assert big["peak_hwm_sum_mib"] < 1024, big
    assert big["peak_hwm_sum_mib"] < 1.25 * small["peak_hwm_sum_mib"], (small, big)
    assert os.listdir(tmp_path) == []  # the generated corpus is deleted
