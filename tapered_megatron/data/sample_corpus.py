"""The sample corpus shipped in the repo, turned into a tokenizer + dataset on first use."""

from __future__ import annotations

import os
from pathlib import Path

from ..resources import resource
from .cache import build_once, digest
from .preprocess import iter_texts, paragraphs, tokenize_files
from .tokenizer import train_sentencepiece

SAMPLE_VOCAB_SIZE = 8192  # the quickstart preset's model.vocab_size
CORPUS_ENV = "TAPERED_MEGATRON_SAMPLE_CORPUS"


def sample_corpus_path() -> Path:
    """The shipped ``data/sample/corpus.jsonl.gz`` (override: $TAPERED_MEGATRON_SAMPLE_CORPUS)."""
    env = os.environ.get(CORPUS_ENV)
    path = Path(env) if env else resource("sample_corpus")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: sample corpus not found (reinstall the package, or set {CORPUS_ENV})"
        )
    return path


def prepare_sample_corpus(
    cache_dir: str | os.PathLike, vocab_size: int = SAMPLE_VOCAB_SIZE
) -> tuple[str, str]:
    """Train the sample tokenizer and tokenize the shipped corpus into ``cache_dir`` once.

    Returns ``(tokenizer_model_path, data_prefix)``. Idempotent; concurrent callers (ranks,
    processes) serialise on a file lock and only the first builds. Takes a few seconds.
    """
    corpus = sample_corpus_path()
    key = digest("sample-v1", corpus.read_bytes(), str(vocab_size), length=12)
    target = Path(cache_dir) / "sample_corpus" / key

    def build(tmp: Path) -> None:
        model = train_sentencepiece(
            paragraphs(iter_texts([str(corpus)])),
            tmp / "tokenizer",
            vocab_size=vocab_size,
            num_threads=min(2, os.cpu_count() or 1),
        )
        summary = tokenize_files(
            [str(corpus)], str(tmp / "corpus"), model, append_eod=True, workers=1, progress=False
        )
        (tmp / "meta.json").write_text(
            f'{{"documents": {summary.documents["text"]}, "tokens": {summary.tokens["text"]}}}'
        )

    build_once(target, build, barrier=False)
    return str(target / "tokenizer.model"), str(target / "corpus_text_document")


def sample_corpus_docs(limit: int | None = None) -> list[str]:
    """The shipped corpus' documents as strings (the first ``limit`` of them)."""
    import itertools

    return list(itertools.islice(iter_texts([str(sample_corpus_path())]), limit))
