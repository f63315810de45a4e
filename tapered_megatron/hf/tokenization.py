"""A Hugging Face fast tokenizer (``tokenizer.json``) encoding exactly as our sentencepiece model.

Transformers' own sentencepiece conversion treats the newline piece our tokenizers train with
(``user_defined_symbols=["\\n"]``) as an added token, so every line after the first gets a
spurious word-start marker. Here the newline (and any other user-defined piece) is a pre-token
split instead, the word-start marker is prepended once to the whole text (sentencepiece's dummy
prefix), and BPE merges are ranked by the score of the merged piece, which is the order
sentencepiece's BPE applies them. :func:`write_hf_tokenizer` checks the result against
sentencepiece on real text and reports every string on which the two disagree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
EDGE_CASES = (
    "",
    " ",
    "  two  spaces",
    "\n\nleading newlines",
    "trailing newline\n",
    "a \n b\t\tc",
    "digits 1234567 and 3.14",
    "naïve – “quotes” and 😀 bytes",
)


def _merges(pieces: list[tuple[str, float]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges ranked by the merged piece's score (best first), ties by the parts' ids."""
    ranked = []
    for piece, score in pieces:
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_fast_tokenizer(sp_model: str | Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the sentencepiece model (BPE or unigram)."""
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(Path(sp_model).read_bytes())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    unk = next((p.piece for p in proto.pieces if p.type == _UNKNOWN), None)
    if spec.model_type == sp_pb2.TrainerSpec.BPE:
        normal = [(p.piece, p.score) for p in proto.pieces if p.type in (_NORMAL, _USER_DEFINED)]
        model = models.BPE(
            vocab, _merges(normal, vocab), unk_token=unk, byte_fallback=spec.byte_fallback,
            fuse_unk=True,
        )  # fmt: skip
    elif spec.model_type == sp_pb2.TrainerSpec.UNIGRAM:
        unk_id = vocab[unk] if unk is not None else None
        model = models.Unigram(pieces, unk_id, byte_fallback=spec.byte_fallback)
    else:
        raise ValueError(f"{sp_model}: sentencepiece model type {spec.model_type} is not supported")
    tok = Tokenizer(model)
    steps = []
    if norm.name not in ("identity", ""):
        steps.append(normalizers.NFKC())
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", SPACE))
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    user = [p.piece for p in proto.pieces if p.type == _USER_DEFINED]
    if user:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(u, behavior="isolated") for u in user]
        )
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    tok.add_special_tokens([p.piece for p in proto.pieces if p.type in (_UNKNOWN, _CONTROL)])
    return tok


def mismatches(tok: Tokenizer, sp_model: str | Path, texts: Iterable[str]) -> list[str]:
    """The texts that ``tok`` encodes or decodes differently from sentencepiece."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    bad = []
    for text in texts:
        ids = sp.encode(text)
        if tok.encode(text, add_special_tokens=False).ids != ids or tok.decode(ids) != sp.decode(
            ids
        ):
            bad.append(text)
    return bad


def write_hf_tokenizer(
    sp_model: str | Path, out_dir: str | Path, model_max_length: int, texts: Iterable[str]
) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and a copy of the sentencepiece model
    into ``out_dir``; return the check texts (plus edge cases) on which the fast tokenizer and
    sentencepiece disagree (empty: identical)."""
    out = Path(out_dir)
    tok = build_fast_tokenizer(sp_model)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if i >= 0 else None

    eos = piece(sp.eos_id())
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": piece(sp.bos_id()),
        "eos_token": eos,
        "unk_token": piece(sp.unk_id()),
        "pad_token": piece(sp.pad_id()) or eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "tokenizer.model").write_bytes(Path(sp_model).read_bytes())
    return mismatches(tok, sp_model, [*EDGE_CASES, *texts])
