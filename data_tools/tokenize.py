#!/usr/bin/env python
"""Tokenize jsonl / json / txt files (globs, .gz) into Megatron MMIDIDX datasets.

    python data_tools/tokenize.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model tok.model --workers 16 --append-eod
    # -> data/corpus_text_document.bin / .idx (uint16 tokens below 65,500 vocab, else int32)

Documents stream through a process pool in input order; outputs appear only when complete."""

import os
import sys

# Run as a script, this folder heads sys.path and tokenize.py would shadow the standard library's
# ``tokenize`` (imported by linecache/inspect): drop the folder before importing anything else.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from tapered_megatron.data.cli import tokenize_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(tokenize_main())
