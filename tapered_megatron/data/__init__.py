"""Data pipeline: tokenizer, Megatron MMIDIDX datasets, GPT sample indices, blending, sampler.

text (jsonl/json/txt, .gz/.zst, Parquet, ``datasets`` folders) -> ``load_tokenizer`` /
``data_tools/tokenize.py`` -> ``IndexedDataset`` (.bin/.idx; ``merge_datasets``,
``sample_dataset``) -> ``build_gpt_datasets`` (sample indices, blends, splits) ->
``PretrainingSampler`` -> batches.
"""

from .blended import BlendedDataset, build_gpt_datasets, parse_blend
from .dataset_tools import merge_datasets, sample_dataset
from .gpt_dataset import GPTDataset, split_ranges
from .indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    error_line,
    token_dtype,
    write_indexed_dataset,
)
from .sample_corpus import prepare_sample_corpus
from .sampler import PretrainingSampler
from .tokenizer import SentencePieceTokenizer, load_tokenizer, train_sentencepiece

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "PretrainingSampler",
    "SentencePieceTokenizer",
    "build_gpt_datasets",
    "error_line",
    "load_tokenizer",
    "merge_datasets",
    "parse_blend",
    "prepare_sample_corpus",
    "sample_dataset",
    "split_ranges",
    "token_dtype",
    "train_sentencepiece",
    "write_indexed_dataset",
]
