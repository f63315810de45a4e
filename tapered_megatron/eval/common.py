"""Shared command-line pieces of the evaluation tools: which model, which tokens, JSON output.

Model: ``--model OUT`` (an export) or ``--checkpoint DIR [--tag T]`` (a training checkpoint of
any layout, consolidated in memory). Tokens: ``--data-path`` is a Megatron indexed dataset
prefix (``PREFIX_text_document``, its ``.bin``/``.idx``) or a ``.jsonl``/``.json``/``.txt`` file
(optionally ``.gz``; one document per line, key ``text``) tokenized on the fly with the model's
tokenizer, an end-of-document token after each document. ``--split train|valid|test`` takes that
part of the documents with the training split string (``--data-split``, default the run's
``data.split``), ``all`` takes every document; the default is ``valid`` for indexed datasets and
``all`` for text files. Without ``--data-path`` the sample corpus the quickstart trains on is used.
The split's documents are read in their stored order as one token stream.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import numpy as np
import torch

from tapered_megatron.export.load import (
    DTYPES,
    PLUGINS_HELP,
    ExportError,
    LoadedModel,
    check_tokenizer,
    load_model,
)

SPLITS = ("train", "valid", "test", "all")
_TEXT_FILE = re.compile(r"\.(jsonl|json|txt)(\.gz)?$")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """``--model`` / ``--checkpoint`` / ``--tag`` / ``--tokenizer-model`` / ``--device`` /
    ``--dtype`` / ``--plugins``."""
    from deepspeed.accelerator import get_accelerator

    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="export directory (python -m tapered_megatron.export)")
    src.add_argument("--checkpoint", help="training checkpoint directory (train.save_dir)")
    ap.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    ap.add_argument(
        "--tokenizer-model",
        default=None,
        help="sentencepiece model (default: the export's, or the run's data.tokenizer_model)",
    )
    ap.add_argument(
        "--device",
        default=get_accelerator().device_name(),
        help="torch device (default: DeepSpeed's accelerator, e.g. cuda on a GPU, else cpu)",
    )
    ap.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights and compute dtype (default float32; bfloat16 halves memory on a GPU)",
    )
    ap.add_argument("--plugins", nargs="+", default=[], help=PLUGINS_HELP)


def add_data_args(ap: argparse.ArgumentParser) -> None:
    """``--data-path`` / ``--split`` / ``--data-split`` / ``--seq-len`` / ``--batch-size``."""
    ap.add_argument(
        "--data-path",
        default=None,
        help="Megatron indexed-dataset prefix or a .jsonl/.json/.txt file (default: the "
        "quickstart sample corpus)",
    )
    ap.add_argument("--split", choices=SPLITS, default=None, help="documents to use (see above)")
    ap.add_argument("--data-split", default=None, help="split string, default the run's data.split")
    ap.add_argument("--seq-len", type=int, default=None, help="window length (default: training's)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")


def model_data_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A tool's command line with the model (:func:`add_model_args`) and data
    (:func:`add_data_args`) options; the tool adds its own."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    add_model_args(ap)
    add_data_args(ap)
    return ap


def load_with_tokens(
    a: argparse.Namespace, max_tokens: int | None
) -> tuple[LoadedModel, np.ndarray, str]:
    """:func:`load_from_args` and :func:`token_stream` of parsed arguments ``a``."""
    loaded = load_from_args(a)
    return (loaded, *token_stream(a, loaded, max_tokens))


def load_from_args(a: argparse.Namespace) -> LoadedModel:
    """The model named by ``--model`` / ``--checkpoint``, on ``--device``, in eval mode."""
    loaded = load_model(a.model, a.checkpoint, a.tag, tuple(a.plugins), a.dtype)
    if a.tokenizer_model:
        check_tokenizer(a.tokenizer_model, loaded.cfg)
        loaded.tokenizer_model = a.tokenizer_model
    loaded.module.to(a.device).eval()
    return loaded


def _documents_range(n_docs: int, split: str, split_string: str) -> tuple[int, int]:
    if split == "all":
        return 0, n_docs
    from tapered_megatron.data import split_ranges

    return split_ranges(split_string, n_docs)[SPLITS.index(split)]


def token_stream(
    a: argparse.Namespace, loaded: LoadedModel, max_tokens: int | None
) -> tuple[np.ndarray, str]:
    """The tokens of ``--data-path`` / ``--split`` (at most ``max_tokens``) as one int64 array,
    and the split used."""
    cfg = loaded.cfg
    split_string = a.data_split or cfg.data.split
    path = a.data_path
    if path is None:
        from tapered_megatron.data import prepare_sample_corpus

        path = prepare_sample_corpus(cfg.data.cache_dir, cfg.model.vocab_size)[1]
    text = bool(_TEXT_FILE.search(path))
    split = a.split or ("all" if text else "valid")
    if text:
        stream = _text_tokens(path, split, split_string, loaded, max_tokens)
    else:
        from tapered_megatron.data import IndexedDataset, IndexedDatasetError

        try:
            ds = IndexedDataset(path)
        except IndexedDatasetError as e:
            raise ExportError(f"--data-path: {e}") from None
        start, end = _documents_range(ds.num_documents, split, split_string)
        offsets, lengths = ds.document_offsets, ds.document_lengths
        total = int(lengths[start:end].sum())
        if max_tokens is not None:
            total = min(total, max_tokens)
        stream = np.asarray(ds.tokens(int(offsets[start]), total) if end > start else [])
    if stream.size < 2:
        raise ExportError(
            f"--data-path {path} --split {split}: fewer than 2 tokens; pick another split"
        )
    if int(stream.max()) >= cfg.model.vocab_size:
        raise ExportError(
            f"--data-path {path}: token id {int(stream.max())} is outside the model's vocabulary "
            f"({cfg.model.vocab_size}); was it tokenized with the model's tokenizer?"
        )
    return stream.astype(np.int64), split


def _text_tokens(
    path: str, split: str, split_string: str, loaded: LoadedModel, max_tokens: int | None
) -> np.ndarray:
    from tapered_megatron.data import load_tokenizer
    from tapered_megatron.data.preprocess import iter_texts

    if loaded.tokenizer_model is None:
        raise ExportError(
            f"--data-path {path}: a text file needs the model's tokenizer; pass --tokenizer-model"
        )
    tok = load_tokenizer(loaded.tokenizer_model)
    texts = list(iter_texts([path]))
    start, end = _documents_range(len(texts), split, split_string)
    out: list[int] = []
    for text in texts[start:end]:
        out += [*tok.encode(text), tok.eod_id]
        if max_tokens is not None and len(out) >= max_tokens:
            break
    return np.asarray(out[:max_tokens] if max_tokens is not None else out)


def windows(stream: np.ndarray | torch.Tensor, seq_len: int, batch_size: int, device: str = "cpu"):
    """``(inputs, labels)`` batches covering ``stream`` once: windows of ``seq_len`` inputs whose
    labels are the next tokens (consecutive windows share one token, like training samples), so
    every token but the first is predicted exactly once; a shorter last window comes alone."""
    t = torch.as_tensor(stream, dtype=torch.int64)
    n_full = (t.numel() - 1) // seq_len
    full = t[: n_full * seq_len + 1]
    starts = torch.arange(n_full) * seq_len
    for i in range(0, n_full, batch_size):
        idx = starts[i : i + batch_size, None] + torch.arange(seq_len + 1)
        w = full[idx].to(device)
        yield w[:, :-1], w[:, 1:]
    rest = t[n_full * seq_len :]
    if rest.numel() > 1:
        w = rest[None].to(device)
        yield w[:, :-1], w[:, 1:]


def emit_json(obj: dict[str, Any]) -> None:
    """Print ``obj`` as the last line of stdout (the machine-readable contract)."""
    print(json.dumps(obj), flush=True)


def fail(e: Exception) -> int:
    """Report a bad-input error in one line; the exit status of a tool given bad input."""
    import sys

    print(f"error: {e}", file=sys.stderr)
    return 2
