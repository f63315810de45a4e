"""Tiny exported models for the evaluation tests: a small sentencepiece tokenizer trained on the
shipped sample corpus and random-init models of each architecture written as exports."""

from __future__ import annotations

from pathlib import Path

from arch_args import for_arch

from tapered_megatron.config import Config, load_config
from tapered_megatron.data import train_sentencepiece
from tapered_megatron.data.sample_corpus import sample_corpus_docs
from tapered_megatron.export.writer import Provenance, write_export
from tapered_megatron.models import LanguageModel, build_model

VOCAB = 1024  # a multiple of 128: no vocabulary padding, logits of both forms directly comparable
ARCHS = ("transformer", "gated_attention", "titans", "hope_attention")


def tiny_tokenizer(folder: Path) -> str:
    """A 1024-piece BPE tokenizer (our training options) from 150 sample-corpus documents."""
    return train_sentencepiece(iter(sample_corpus_docs(150)), folder / "tok", vocab_size=VOCAB)


def tiny_config(arch: str, tokenizer: str | None = None, *overrides: str) -> Config:
    """A 2-layer tapered model of ``arch`` with sequences of 128 tokens."""
    return load_config(
        "quickstart",
        for_arch(arch, [
            "--model.d_model", "64", "--model.heads", "4",
            "--model.layers", "2", "--model.d_ff", "128", "--model.vocab_size", str(VOCAB),
            "--model.seq_len", "128", "--model.titans.chunk_size", "16",
            "--model.titans.window", "32", "--model.hope.levels", "2",
            "--model.hope.periods", "0", "8", "--data.path", "unused",
            "--data.tokenizer_model", tokenizer or "", "--train.seed", "7", *overrides,
        ]),
    )  # fmt: skip


def tiny_export(
    out: Path, arch: str, tokenizer: str | None, *overrides: str
) -> tuple[Path, LanguageModel]:
    """A random-init model of ``arch`` (config ``overrides``) written as an export; returns
    (export dir, module)."""
    cfg = tiny_config(arch, tokenizer, *overrides)
    model = build_model(cfg).eval()
    write_export(out, cfg, dict(model.state_dict()), Provenance("tests"), tokenizer)
    return out, model
