#!/usr/bin/env python
"""Inspect an MMIDIDX dataset: validate, count, histogram lengths, decode documents.

python data_tools/inspect_dataset.py data/corpus_text_document --tokenizer-model tok.model --doc 0
"""

import os
import sys

# Run as a script, this folder heads sys.path and tokenize.py would shadow the standard library's
# ``tokenize`` (imported by linecache/inspect): drop the folder before importing anything else.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from tapered_megatron.data.cli import inspect_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(inspect_main())
