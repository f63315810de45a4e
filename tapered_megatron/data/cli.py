"""Command-line tools of the data pipeline (``data_tools/*.py`` are thin launchers of these)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time

from .indexed import IndexedDatasetError
from .preprocess import InputError, iter_texts, paragraphs, state_path, tokenize_files
from .sources import FORMATS_HELP
from .tokenizer import train_sentencepiece

TRAIN_TOKENIZER_DOC = """Train a sentencepiece tokenizer (BPE or unigram) from tokenize.py's inputs.

    python data_tools/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --output tok

writes tok.model and tok.vocab. Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOD), 3 <pad>; byte fallback
on by default, so any UTF-8 text encodes without <unk>.
"""


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


TOKENIZE_DOC = """Tokenize text corpora into Megatron MMIDIDX datasets.

    python data_tools/tokenize.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-model tok.model --workers 16 --append-eod
    # -> data/corpus_text_document.bin / .idx (uint16 tokens below 65,500 vocab, else int32)
    python data_tools/tokenize.py --input 'fineweb/*.parquet' 'pile/*.jsonl.zst' hf_saved/train \\
        --output-prefix data/mix --tokenizer-model tok.model --workers 16 --append-eod --resume

Inputs (files, globs, folders; mixed freely): .jsonl / .json / .txt, each optionally .gz or .zst;
.parquet (read in record batches); a Hugging Face datasets folder saved with save_to_disk.
Documents stream through a process pool in input order in bounded memory; outputs grow under
.partial names and appear only when complete. With --resume, a killed run continues from its
last checkpoint (every --checkpoint-seconds, and at input ends) and gives the same bytes.
"""


def train_tokenizer_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=TRAIN_TOKENIZER_DOC, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--input", nargs="+", required=True, help=f"files, globs, folders ({FORMATS_HELP})"
    )
    ap.add_argument("--json-keys", nargs="+", default=["text"])
    ap.add_argument(
        "--output", required=True, help="output prefix: writes PREFIX.model, PREFIX.vocab"
    )
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    ap.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false")
    ap.add_argument("--character-coverage", type=float, default=0.9999)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-sentences", type=int, default=0, help="sample this many (0: all)")
    ap.add_argument("--max-documents", type=int, default=0, help="read at most this many (0: all)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    texts = iter_texts(args.input, args.json_keys)
    if args.max_documents:
        texts = itertools.islice(texts, args.max_documents)
    model = train_sentencepiece(
        paragraphs(texts),
        args.output,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        byte_fallback=args.byte_fallback,
        character_coverage=args.character_coverage,
        num_threads=args.threads,
        input_sentence_size=args.max_sentences,
        verbose=args.verbose,
    )
    elapsed = round(time.perf_counter() - t0, 2)
    print(json.dumps({"model": model, "vocab_size": args.vocab_size, "seconds": elapsed}))
    return 0


def tokenize_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=TOKENIZE_DOC, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--input", nargs="+", required=True, help=f"files, globs, folders ({FORMATS_HELP})"
    )
    ap.add_argument(
        "--json-keys", nargs="+", default=["text"], help="one output dataset per key (or column)"
    )
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--tokenizer-model", required=True, help="sentencepiece .model")
    ap.add_argument("--append-eod", action="store_true", help="end every document with </s>")
    ap.add_argument("--workers", type=int, default=1, help="encoder processes (order preserved)")
    ap.add_argument("--log-interval", type=int, default=10000, help="log every N documents")
    ap.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) bad lines")
    ap.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no tqdm bar"
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run from its last checkpoint; keep progress if interrupted",
    )
    ap.add_argument(
        "--checkpoint-seconds", type=float, default=30.0, help="checkpoint at least this often"
    )
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed job cleans up like Ctrl-C
    try:
        summary = tokenize_files(
            args.input,
            args.output_prefix,
            args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            skip_bad_lines=args.skip_bad_lines,
            log_interval=args.log_interval,
            progress=args.progress,
            resume=args.resume,
            checkpoint_seconds=args.checkpoint_seconds,
        )
    except (InputError, IndexedDatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        if args.resume and os.path.exists(state_path(args.output_prefix)):
            print(
                f"progress kept in {args.output_prefix}*.partial: rerun with --resume",
                file=sys.stderr,
            )
        return 1
    except KeyboardInterrupt:
        if args.resume:
            print(
                "interrupted: progress kept at the last checkpoint; rerun with --resume",
                file=sys.stderr,
            )
        else:
            print("interrupted: no output written", file=sys.stderr)
        return 130
    s = summary.as_dict()
    for key in args.json_keys:
        print(
            f"{key}: {s['documents'][key]} documents, {s['tokens'][key]} tokens, "
            f"{s['skipped_empty'][key]} empty skipped",
            file=sys.stderr,
        )
    resumed = s["resumed_from_source"]
    resumed = f" (resumed at input {resumed + 1})" if resumed is not None else ""
    print(
        f"{s['sources']} inputs{resumed}, {s['input_bytes'] / 1e6:.1f} MB in {s['seconds']:.2f} s "
        f"({s['docs_per_s']:.0f} docs/s, "
        f"{s['mb_per_s']:.2f} MB/s, {s['tok_per_s']:.0f} tok/s); {s['skipped_bad_lines']} bad "
        f"lines skipped, {s['invalid_utf8']} lines with invalid UTF-8 (replaced)",
        file=sys.stderr,
    )
    print(json.dumps(s))
    return 0


INSPECT_DOC = """Inspect an MMIDIDX dataset: validate, count, histogram lengths, decode documents.

    python data_tools/inspect_dataset.py data/corpus_text_document
    python data_tools/inspect_dataset.py data/corpus_text_document --tokenizer-model tok.model \\
        --doc 0 --doc 17 --vocab-size 32000
"""


def inspect_main(argv: list[str] | None = None) -> int:
    import numpy as np

    from .indexed import IndexedDataset

    ap = argparse.ArgumentParser(
        description=INSPECT_DOC, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("prefix", help="PREFIX (or PREFIX.bin / PREFIX.idx)")
    ap.add_argument("--tokenizer-model", help="sentencepiece .model, to decode documents")
    ap.add_argument("--doc", type=int, action="append", default=[], help="print document N")
    ap.add_argument("--max-chars", type=int, default=2000, help="truncate decoded text")
    ap.add_argument("--vocab-size", type=int, help="also check every token id < this")
    ap.add_argument("--bins", type=int, default=10, help="histogram bins")
    ap.add_argument("--json", action="store_true", help="print the statistics as one JSON line")
    args = ap.parse_args(argv)
    try:
        ds = IndexedDataset(args.prefix, vocab_size=args.vocab_size)
    except (IndexedDatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lengths = ds.document_lengths
    stats = {
        "prefix": ds.prefix,
        "dtype": ds.dtype.name,
        "documents": ds.num_documents,
        "sequences": len(ds),
        "tokens": ds.num_tokens,
        "empty_documents": int((lengths == 0).sum()),
        "min": int(lengths.min()) if lengths.size else 0,
        "mean": round(float(lengths.mean()), 1) if lengths.size else 0.0,
        "median": float(np.median(lengths)) if lengths.size else 0.0,
        "max": int(lengths.max()) if lengths.size else 0,
    }
    if args.json:
        print(json.dumps(stats))
    else:
        print(
            f"{stats['prefix']}: {stats['documents']} documents, {stats['sequences']} sequences, "
            f"{stats['tokens']} tokens ({stats['dtype']})"
        )
        print(
            f"document length: min {stats['min']}, mean {stats['mean']}, median "
            f"{stats['median']:.0f}, max {stats['max']}, empty {stats['empty_documents']}"
        )
        if lengths.size:
            counts, edges = np.histogram(lengths, bins=args.bins)
            width = max(counts.max(), 1)
            for c, lo, hi in zip(counts, edges[:-1], edges[1:]):
                print(f"  {lo:>10.0f} - {hi:<10.0f} {c:>9d} {'#' * round(40 * c / width)}")
    tok = None
    if args.tokenizer_model:
        from .tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer_model)
    for d in args.doc:
        if not 0 <= d < ds.num_documents:
            print(f"error: document {d} out of range [0, {ds.num_documents})", file=sys.stderr)
            return 1
        ids = ds.document(d)
        print(f"--- document {d}: {ids.size} tokens, {ds.doc_idx[d + 1] - ds.doc_idx[d]} sequences")
        print(tok.decode(ids)[: args.max_chars] if tok else ids[:200].tolist())
    return 0


MERGE_DOC = """Merge MMIDIDX datasets into one, in order (Megatron's merge_datasets):

    python data_tools/merge_datasets.py --inputs data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document

The result has the same bytes as tokenizing a's and b's inputs in one run.
"""


def merge_main(argv: list[str] | None = None) -> int:
    from .dataset_tools import merge_datasets

    ap = argparse.ArgumentParser(
        description=MERGE_DOC, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--inputs", nargs="+", required=True, help="dataset prefixes, in order")
    ap.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    args = ap.parse_args(argv)
    try:
        result = merge_datasets(args.inputs, args.output_prefix)
    except (IndexedDatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


SAMPLE_DOC = """Cut exactly N tokens of documents from a dataset (quick runs, held-out sets):

    python data_tools/sample_dataset.py --input data/corpus_text_document --tokens 10M \\
        --output-prefix data/small_text_document
    python data_tools/sample_dataset.py --input data/corpus_text_document --tokens 5M --seed 1 \\
        --output-prefix data/heldout_text_document --rest-prefix data/train_text_document

Documents come from the start, or in a seeded random order with --seed (written in their
original order); the last one is cut to make the count exact. --rest-prefix writes every
document not taken (the cut one excluded), so a held-out set shares no text with the rest.
"""


def _token_count(text: str) -> int:
    """``123``, ``10K``, ``5M``, ``2B`` (decimal multiples)."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a token count (e.g. 10M, 2B)") from None
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count is a positive whole number")
    return int(value)


def sample_main(argv: list[str] | None = None) -> int:
    from .dataset_tools import sample_dataset

    ap = argparse.ArgumentParser(
        description=SAMPLE_DOC, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--input", required=True, help="dataset prefix")
    ap.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    ap.add_argument("--tokens", type=_token_count, required=True, help="exact token count: 10M, 2B")
    ap.add_argument("--seed", type=int, help="random documents (default: from the start)")
    ap.add_argument("--rest-prefix", help="also write the documents not taken here")
    args = ap.parse_args(argv)
    try:
        result = sample_dataset(
            args.input, args.output_prefix, args.tokens, args.seed, args.rest_prefix
        )
    except (IndexedDatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0
