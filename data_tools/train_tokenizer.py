#!/usr/bin/env python
"""Train a sentencepiece tokenizer (BPE or unigram) from jsonl / json / txt files (.gz allowed).

    python data_tools/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --output tok

writes tok.model and tok.vocab. Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOD), 3 <pad>; byte fallback
on by default, so any UTF-8 text encodes without <unk>."""

import os
import sys

# Run as a script, this folder heads sys.path and tokenize.py would shadow the standard library's
# ``tokenize`` (imported by linecache/inspect): drop the folder before importing anything else.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from tapered_megatron.data.cli import train_tokenizer_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_tokenizer_main())
