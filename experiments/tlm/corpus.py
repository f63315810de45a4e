"""The reproduction's second corpus, of another domain than the Shakespeare sample: the Python
documentation CPython ships with itself (``pydoc_data``'s topic pages, and the docstrings of the
top-level standard library modules), tokenized with its own tokenizer once per cache.

Nothing is downloaded: the text is what this Python installation carries, so the corpus (and
its cache key, a digest of the text) follows the Python version that built it.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from functools import cache
from pathlib import Path

# The name of the second corpus in run names and tables.
NAME = "pydocs"
LABEL = "Python documentation shipped with CPython"

# Docstrings shorter than this (one-line summaries, mostly) are left out.
_MIN_DOC_CHARS = 200


def python_docs() -> list[str]:
    """The corpus' documents: each ``pydoc_data`` topic page, then per standard library module
    (top-level ``*.py``, in name order) its docstrings of at least :data:`_MIN_DOC_CHARS`
    characters joined by blank lines."""
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        texts = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
        long = [t for t in texts if t and len(t) >= _MIN_DOC_CHARS]
        if long:
            docs.append("\n\n".join(long))
    return docs


@cache
def prepare_python_docs(cache_dir: str | os.PathLike, vocab_size: int) -> tuple[str, str]:
    """Train the corpus' tokenizer and tokenize it into ``cache_dir`` once (idempotent, safe
    for concurrent callers, remembered within a process); returns ``(tokenizer_model_path,
    data_prefix)``."""
    from tapered_megatron.data.cache import build_once, digest
    from tapered_megatron.data.preprocess import paragraphs, tokenize_files
    from tapered_megatron.data.tokenizer import train_sentencepiece

    docs = python_docs()
    text = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
    key = digest(f"{NAME}-v1", text.encode(), str(vocab_size), length=12)
    target = Path(cache_dir) / NAME / key

    def build(tmp: Path) -> None:
        source = tmp / "corpus.jsonl"
        source.write_text(text, encoding="utf-8")
        model = train_sentencepiece(
            paragraphs(iter(docs)),
            tmp / "tokenizer",
            vocab_size=vocab_size,
            num_threads=min(2, os.cpu_count() or 1),
        )
        tokenize_files(
            [str(source)], str(tmp / "corpus"), model, append_eod=True, workers=1, progress=False
        )
        source.unlink()

    build_once(target, build, barrier=False)
    return str(target / "tokenizer.model"), str(target / "corpus_text_document")
