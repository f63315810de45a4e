"""Datasets from datasets: merge several MMIDIDX datasets, cut a sample of a fixed token count.

Both copy whole runs of documents through :meth:`IndexedDatasetWriter.add_range` (tokens and
index entries in chunks, so memory stays bounded) and write under temporary names renamed when
complete.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, normalise_prefix


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> dict:
    """Concatenate datasets in order into ``output_prefix``: the same bytes as tokenizing their
    inputs in one run. Every input must have the same token dtype."""
    if not prefixes:
        raise IndexedDatasetError("merge: no input datasets given")
    out = normalise_prefix(output_prefix)
    if out in {normalise_prefix(p) for p in prefixes}:
        raise IndexedDatasetError(f"{out}: the output prefix is also an input; pick another")
    datasets = [IndexedDataset(p) for p in prefixes]  # validated on open
    dtypes = {ds.dtype for ds in datasets}
    if len(dtypes) > 1:
        names = ", ".join(f"{ds.prefix} {ds.dtype.name}" for ds in datasets)
        raise IndexedDatasetError(f"merge: token dtypes differ ({names}); use one tokenizer")
    with IndexedDatasetWriter(out, datasets[0].dtype) as w:
        for ds in datasets:
            w.add_range(ds, 0, ds.num_documents)
    return {
        "output": out,
        "inputs": len(datasets),
        "documents": w.num_documents,
        "sequences": w.num_sequences,
        "tokens": w.num_tokens,
    }


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Sorted indices -> ``[(start, end), ...]`` runs of consecutive values."""
    if not indices.size:
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [indices.size]])
    return [(int(indices[s]), int(indices[e - 1]) + 1) for s, e in zip(starts, ends)]


def _add_head(w: IndexedDatasetWriter, ds: IndexedDataset, doc: int, tokens: int) -> None:
    """Append the first ``tokens`` tokens of document ``doc`` (its sequences kept, the last cut)."""
    for seq in ds.document_sequences(doc):
        if tokens <= 0:
            break
        w.add_sequence(seq[:tokens])
        tokens -= min(tokens, seq.size)
    w.end_document()


def sample_dataset(
    prefix: str,
    output_prefix: str,
    tokens: int,
    seed: int | None = None,
    rest_prefix: str | None = None,
) -> dict:
    """Cut exactly ``tokens`` tokens of whole documents from ``prefix`` into ``output_prefix``.

    Documents are taken from the start (``seed`` None) or in a seeded random order, and written
    in their original order; the last one taken is cut to make the count exact. ``rest_prefix``
    receives every document not taken, whole (the cut document goes to neither side's remainder),
    so a held-out sample and the rest share no text.
    """
    ds = IndexedDataset(prefix)
    if not 0 < tokens <= ds.num_tokens:
        raise IndexedDatasetError(
            f"{ds.prefix}: asked for {tokens} tokens, the dataset has {ds.num_tokens}"
        )
    outs = [normalise_prefix(p) for p in (output_prefix, rest_prefix) if p]
    if ds.prefix in outs:
        raise IndexedDatasetError(f"{ds.prefix}: an output prefix is the input; pick another")
    n = ds.num_documents
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    cum = np.cumsum(ds.document_lengths[order])
    k = int(np.searchsorted(cum, tokens))  # the document that reaches the count
    cut_doc = int(order[k])
    head = tokens - (int(cum[k - 1]) if k else 0)
    whole = np.sort(order[:k])
    if head == ds.document_lengths[cut_doc]:
        whole, cut_doc = np.sort(order[: k + 1]), -1
    taken = np.sort(np.append(whole, cut_doc)) if cut_doc >= 0 else whole
    result = {
        "input": ds.prefix,
        "output": outs[0],
        "tokens": tokens,
        "seed": seed,
        "documents": int(taken.size),
        "cut_document": cut_doc if cut_doc >= 0 else None,
    }
    with IndexedDatasetWriter(outs[0], ds.dtype) as w:
        for start, end in _runs(taken):
            if start <= cut_doc < end:
                w.add_range(ds, start, cut_doc)
                _add_head(w, ds, cut_doc, head)
                w.add_range(ds, cut_doc + 1, end)
            else:
                w.add_range(ds, start, end)
    if rest_prefix:
        rest = np.ones(n, bool)
        rest[taken] = False
        with IndexedDatasetWriter(outs[1], ds.dtype) as r:
            for start, end in _runs(np.flatnonzero(rest)):
                r.add_range(ds, start, end)
        result.update(rest=outs[1], rest_documents=r.num_documents, rest_tokens=r.num_tokens)
    return result
