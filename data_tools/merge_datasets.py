#!/usr/bin/env python
"""Merge MMIDIDX datasets in order: the same bytes as tokenizing their inputs in one run.

    python data_tools/merge_datasets.py --inputs data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document
"""

import os
import sys

# Run as a script, this folder heads sys.path and tokenize.py would shadow the standard library's
# ``tokenize`` (imported by linecache/inspect): drop the folder before importing anything else.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from tapered_megatron.data.cli import merge_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(merge_main())
