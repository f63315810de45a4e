#!/usr/bin/env python
"""Cut exactly N tokens of documents from a dataset (quick experiments, held-out sets).

    python data_tools/sample_dataset.py --input data/corpus_text_document --tokens 10M \
        --output-prefix data/small_text_document [--seed 1 --rest-prefix data/rest_text_document]
"""

import os
import sys

# Run as a script, this folder heads sys.path and tokenize.py would shadow the standard library's
# ``tokenize`` (imported by linecache/inspect): drop the folder before importing anything else.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from tapered_megatron.data.cli import sample_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(sample_main())
