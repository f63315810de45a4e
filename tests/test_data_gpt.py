"""GPT sample index, splits, blending, sampler resume, cache safety, sample corpus, scale."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tapered_megatron.data import (
    GPTDataset,
    IndexedDataset,
    IndexedDatasetError,
    PretrainingSampler,
    build_gpt_datasets,
    load_tokenizer,
    parse_blend,
    prepare_sample_corpus,
    split_ranges,
    write_indexed_dataset,
)
from tapered_megatron.data.blended import blending_indices
from tapered_megatron.data.gpt_dataset import build_indices

SEQ = 16


def unique_token_dataset(path: Path, n_docs: int, base: int = 0, seed: int = 0) -> str:
    """Documents of random length (some empty) whose tokens are their global positions + base."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, n_docs)
    lengths[::17] = 0
    starts = np.concatenate([[0], np.cumsum(lengths)])
    docs = [list(range(base + s, base + s + n)) for s, n in zip(starts, lengths)]
    prefix = str(path)
    write_indexed_dataset(prefix, docs, dtype=np.int32)
    return prefix


@pytest.fixture
def data(tmp_path):
    return unique_token_dataset(tmp_path / "u_text_document", 300)


def split_tokens(prefix: str, split: str, which: int) -> np.ndarray:
    ds = IndexedDataset(prefix)
    lo, hi = split_ranges(split, ds.num_documents)[which]
    return np.concatenate([ds.document(d) for d in range(lo, hi)]).astype(np.int64)


def test_split_ranges_match_megatron():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("98,2,0", 7) == [(0, 7), (7, 7), (7, 7)]
    assert split_ranges("1", 5) == [(0, 5), (5, 5), (5, 5)]
    with pytest.raises(ValueError, match="split"):
        split_ranges("a,b", 5)


def test_every_token_once_per_epoch_and_no_split_crossing(data, tmp_path):
    split = "80,15,5"
    train_tok = split_tokens(data, split, 0)
    valid_tok = split_tokens(data, split, 1)
    T = train_tok.size
    want = 3 * T // SEQ  # about three epochs
    train, valid, _ = build_gpt_datasets(data, split, SEQ, 7, (want, 10, 0), tmp_path / "c")
    assert len(train) >= want
    assert all(train[i].dtype == np.int64 and train[i].shape == (SEQ + 1,) for i in range(5))
    # the unshuffled samples tile the token stream; each epoch of it is every token once
    stream = np.concatenate([train.sample_tokens(i)[:-1] for i in range(len(train))])
    for epoch in range(2):
        assert np.array_equal(np.sort(stream[epoch * T : (epoch + 1) * T]), np.sort(train_tok))
        assert not np.array_equal(stream[:T], stream[T : 2 * T])  # a fresh order per epoch
        # the shuffle stays inside the epoch: consuming in order finishes the epoch first
        first, end = -(-epoch * T // SEQ), -(-(epoch + 1) * T // SEQ)
        assert sorted(train.shuffle_idx[first:end].tolist()) == list(range(first, end))
    for i in range(len(train) - 1):  # labels: consecutive samples share one token
        assert train.sample_tokens(i)[-1] == train.sample_tokens(i + 1)[0]
    train_set, valid_set = set(train_tok.tolist()), set(valid_tok.tolist())
    assert all(set(train[i].tolist()) <= train_set for i in range(len(train)))
    assert all(set(valid[i].tolist()) <= valid_set for i in range(len(valid)))
    # same seed, same order; another seed, another order
    again, _, _ = build_gpt_datasets(data, split, SEQ, 7, (want, 10, 0), tmp_path / "c2")
    assert all(np.array_equal(train[i], again[i]) for i in range(len(train)))
    other, _, _ = build_gpt_datasets(data, split, SEQ, 8, (want, 10, 0), tmp_path / "c2")
    assert not all(np.array_equal(train[i], other[i]) for i in range(len(train)))


def test_cache_reused_and_keyed(data, tmp_path):
    cache = tmp_path / "cache"
    a, _, _ = build_gpt_datasets(data, "1", SEQ, 1, (50, 0, 0), cache)
    mtime = os.path.getmtime(a.cache_path / "sample_idx.npy")
    b, _, _ = build_gpt_datasets(data, "1", SEQ, 1, (50, 0, 0), cache)
    assert b.cache_path == a.cache_path
    assert os.path.getmtime(b.cache_path / "sample_idx.npy") == mtime
    assert isinstance(b.sample_idx, np.memmap)
    c, _, _ = build_gpt_datasets(data, "1", SEQ + 1, 1, (50, 0, 0), cache)
    assert c.cache_path != a.cache_path
    assert len(list((cache / "gpt_indices").glob("*.lock"))) == 2


def test_sampler_same_order_any_dp_and_resume():
    total, gb = 103, 8
    order = [i for step in PretrainingSampler(total, 0, gb, 0, 1) for i in step]
    assert order == list(range(96))
    for dp in (1, 2, 4, 8):
        per_rank = [list(PretrainingSampler(total, 0, gb // dp, r, dp)) for r in range(dp)]
        steps = [[i for r in range(dp) for i in per_rank[r][s]] for s in range(len(per_rank[0]))]
        assert [i for st in steps for i in st] == order
        assert all(len(p) == len(PretrainingSampler(total, 0, gb // dp, 0, dp)) for p in per_rank)
    for k in (0, 8, 40, 96):
        for dp in (1, 2):
            full = list(PretrainingSampler(total, 0, 4, dp - 1, dp))
            resumed = list(PretrainingSampler(total, k, 4, dp - 1, dp))
            assert resumed == full[k // (4 * dp) :]
    tail = list(PretrainingSampler(10, 8, 4, 0, 1, drop_last=False))
    assert tail == [[8, 9]]
    with pytest.raises(ValueError):
        PretrainingSampler(10, 11, 4, 0, 1)


def test_resume_sees_same_batches(data, tmp_path):
    train, _, _ = build_gpt_datasets(data, "1", SEQ, 3, (64, 0, 0), tmp_path / "c")

    def batches(consumed):
        s = PretrainingSampler(len(train), consumed, 4, 0, 1)
        return [np.stack([train[i] for i in b]) for b in s]

    full, resumed = batches(0), batches(20)
    assert len(resumed) == len(full) - 5
    assert all(np.array_equal(x, y) for x, y in zip(full[5:], resumed))


def test_blending_proportions_and_determinism(tmp_path):
    a = unique_token_dataset(tmp_path / "a", 200, base=0, seed=1)
    b = unique_token_dataset(tmp_path / "b", 150, base=10**6, seed=2)
    c = unique_token_dataset(tmp_path / "c", 100, base=2 * 10**6, seed=3)
    assert parse_blend(f"2 {a} 6 {b}.bin 2 {c}") == [(0.2, a), (0.6, b), (0.2, c)]
    n = 3000
    train, _, _ = build_gpt_datasets(f"0.2 {a} 0.5 {b} 0.3 {c}", "1", SEQ, 5, (n, 0, 0), tmp_path)
    assert len(train) == n
    counts = np.bincount(train.dataset_index, minlength=3) / n
    assert np.allclose(counts, [0.2, 0.5, 0.3], atol=0.01)
    for m in (10, 100, 777):  # every prefix is within one sample of its share
        pre = np.bincount(train.dataset_index[:m], minlength=3)
        assert np.all(np.abs(pre - np.array([0.2, 0.5, 0.3]) * m) <= 1)
    for i in range(0, n, 97):  # each sample comes from the dataset the index names
        assert train[i].min() // 10**6 == train.dataset_index[i]
    ds_index, ds_sample = blending_indices([0.2, 0.5, 0.3], n)
    assert np.array_equal(ds_index, train.dataset_index)
    assert np.array_equal(ds_sample, train.dataset_sample_index)
    with pytest.raises(ValueError, match="odd item count"):
        parse_blend(f"0.5 {a} 0.5")
    with pytest.raises(ValueError, match="not a number"):
        parse_blend(f"x {a} 0.5 {b}")


def test_pickles_by_path(data, tmp_path):
    import pickle

    a = unique_token_dataset(tmp_path / "a", 50, seed=1)
    train, _, _ = build_gpt_datasets(f"1 {data} 1 {a}", "1", SEQ, 2, (100, 0, 0), tmp_path)
    blob = pickle.dumps(train)
    assert len(blob) < 20_000  # paths and scalars, not the mapped arrays or tokens
    again = pickle.loads(blob)
    assert all(np.array_equal(train[i], again[i]) for i in range(len(train)))


def test_bad_files_fail_before_training(data, tmp_path):
    with pytest.raises(IndexedDatasetError, match="outside the vocabulary"):
        build_gpt_datasets(data, "1", SEQ, 1, (10, 0, 0), tmp_path, vocab_size=100)
    os.truncate(data + ".bin", 8)
    with pytest.raises(IndexedDatasetError, match="truncated data"):
        build_gpt_datasets(data, "1", SEQ, 1, (10, 0, 0), tmp_path)


def _build_in_process(args):
    prefix, cache, n = args
    ds = GPTDataset(IndexedDataset(prefix), (0, 300), SEQ, n, 11, cache)
    return ds.cache_path.name, np.asarray(ds.shuffle_idx[:50]).tolist(), ds[0].tolist()


def test_concurrent_processes_build_once(data, tmp_path):
    cache = str(tmp_path / "cache")
    with mp.get_context("spawn").Pool(3) as pool:
        out = pool.map(_build_in_process, [(data, cache, 400)] * 3)
    assert out[0] == out[1] == out[2]
    assert len([p for p in (tmp_path / "cache/gpt_indices").iterdir() if p.is_dir()]) == 1


def _rank_fn(rank, world, prefix, cache):
    train, _valid, _ = build_gpt_datasets(prefix, "90,10,0", SEQ, 3, (200, 20, 0), cache)
    sampler = PretrainingSampler(len(train), 0, 2, rank, world)
    return [train[i].tolist() for b in list(sampler)[:3] for i in b]


@pytest.mark.distributed
def test_ranks_build_once_and_agree(data, tmp_path):
    from tapered_megatron.parallel.local_launch import run_workers

    cache = str(tmp_path / "cache")
    out = run_workers(_rank_fn, 2, data, cache)
    ref = _rank_fn(0, 1, data, cache)  # one rank, same seed: the same global order
    merged = [x for s in range(3) for r in range(2) for x in out[r][2 * s : 2 * s + 2]]
    single = [x for b in itertools.islice(PretrainingSampler(10**9, 0, 4, 0, 1), 3) for x in b]
    train, _, _ = build_gpt_datasets(data, "90,10,0", SEQ, 3, (200, 20, 0), cache)
    assert merged == [train[i].tolist() for i in single]
    assert ref[:2] == out[0][:2]
    assert len([p for p in (tmp_path / "cache/gpt_indices").iterdir() if p.is_dir()]) == 2


def _prepare(cache):
    return prepare_sample_corpus(cache)


def test_sample_corpus_prepared_once(tmp_path):
    cache = str(tmp_path / "cache")
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(2) as pool:
        a, b = pool.map(_prepare, [cache, cache])
    assert a == b
    assert time.perf_counter() - t0 < 60
    assert prepare_sample_corpus(cache) == a  # idempotent, instant
    tok_path, prefix = a
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size == 8192
    ds = IndexedDataset(prefix, vocab_size=tok.vocab_size)
    assert ds.num_documents > 1000 and ds.num_tokens > 1_000_000
    assert tok.decode(ds.document(0)[:-1]).startswith("ALL'S WELL THAT ENDS WELL")
    assert ds.document(0)[-1] == tok.eod_id
    train, valid, test = build_gpt_datasets(
        prefix, "969,30,1", 128, 1234, (1200, 32, 8), cache, vocab_size=8192
    )
    assert len(train) >= 1200 and len(valid) >= 32 and len(test) >= 8
    assert len(list(Path(cache, "sample_corpus").iterdir())) == 2  # the folder and its lock


@pytest.mark.slow
def test_scale_10b_tokens_index_under_a_minute():
    rng = np.random.default_rng(0)
    n_docs = 10_000_000
    lengths = rng.integers(1, 2000, n_docs, dtype=np.int64).astype(np.int32)  # mean ~1000
    total = int(lengths.sum())
    seq = 2048
    tracemalloc.start()
    t0 = time.perf_counter()
    _doc_idx, _sample_idx, shuffle_idx = build_indices(
        lengths, np.arange(n_docs), seq, (total - 1) // seq, 1234
    )
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\n10B-scale index: {total} tokens, {shuffle_idx.size} samples, {elapsed:.1f} s, "
          f"peak {peak / 2**20:.0f} MiB")  # fmt: skip
    assert total > 9.9e9
    assert elapsed < 60
    assert peak < 2 * 2**30


def test_paths_with_spaces_and_any_bytes_build_datasets(tmp_path):
    """A prefix whose path holds spaces is one prefix, not a blend; a path with bytes that are
    not UTF-8 builds and caches its index like any other."""
    from tapered_megatron.data.blended import parse_blend

    docs = [list(range(1, 40)) for _ in range(20)]
    spaced = tmp_path / "my data" / "a b"
    spaced.parent.mkdir()
    write_indexed_dataset(str(spaced), docs)
    assert parse_blend(str(spaced)) == [(1.0, str(spaced))]
    assert parse_blend(f"{spaced}.bin") == [(1.0, str(spaced))]
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9")
    write_indexed_dataset(odd, docs)
    for prefix in (str(spaced), odd):
        train, _, _ = build_gpt_datasets(
            prefix, "1,0,0", 8, 1, (10, 0, 0), tmp_path / "cache", vocab_size=64
        )
        assert len(train) >= 10 and train[0].shape == (9,)
