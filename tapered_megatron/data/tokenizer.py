"""SentencePiece tokenizer: training (BPE or unigram, byte fallback, EOD/pad/BOS) and loading."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator

import sentencepiece as spm

# Fixed special-token ids for models we train (Llama-style); models from elsewhere keep theirs.
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3


class SentencePieceTokenizer:
    """A loaded sentencepiece model with the Megatron-style surface the trainer uses."""

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = os.fspath(model_path)
        if not os.path.isfile(self.model_path):
            raise FileNotFoundError(f"{self.model_path}: tokenizer model not found")
        self.sp = spm.SentencePieceProcessor(model_file=self.model_path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        """End-of-document token appended by ``tokenize.py --append-eod`` (the model's ``</s>``)."""
        return self.sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def pad_id(self) -> int:
        pad = self.sp.pad_id()
        return pad if pad >= 0 else self.eod_id

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def splits_at_whitespace(tok: SentencePieceTokenizer) -> bool:
    """Whether the model never forms a token across a space between words (sentencepiece's
    default, ours and Llama's): then a long text may be encoded in pieces cut at spaces."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.sp.serialized_model_proto())
    spec = proto.trainer_spec
    return spec.split_by_whitespace and not spec.treat_whitespace_as_suffix


def load_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """Load a sentencepiece ``.model`` file (ours, Llama's, or any other)."""
    return SentencePieceTokenizer(path)


def train_sentencepiece(
    sentences: Iterator[str],
    output_prefix: str | os.PathLike,
    vocab_size: int = 32000,
    model_type: str = "bpe",
    byte_fallback: bool = True,
    character_coverage: float = 0.9999,
    num_threads: int = 2,
    input_sentence_size: int = 0,
    seed_sentencepiece_size: int = 1_000_000,
    verbose: bool = False,
) -> str:
    """Train a model from an iterator of sentences/paragraphs; writes ``PREFIX.model``/``.vocab``.

    Ids: 0 ``<unk>``, 1 ``<s>`` (BOS), 2 ``</s>`` (EOD), 3 ``<pad>``; newline is its own piece
    and text is not normalised, so decode(encode(text)) == text for every input. Returns the
    model path. Writes through temporary names, so a half-trained model never appears.
    """
    prefix = os.fspath(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_writer=model,
        model_type=model_type,
        vocab_size=vocab_size,
        byte_fallback=byte_fallback,
        character_coverage=character_coverage,
        num_threads=num_threads,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOD_ID,
        pad_id=PAD_ID,
        user_defined_symbols=["\n"],
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=1 << 16,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size,
        minloglevel=0 if verbose else 2,
    )
    proto = model.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tmp = f"{prefix}.model.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(proto)
    os.replace(tmp, f"{prefix}.model")
    tmp = f"{prefix}.vocab.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n")
    os.replace(tmp, f"{prefix}.vocab")
    return f"{prefix}.model"
