"""Generate text from an export or a training checkpoint.

    python -m tapered_megatron.generate --model OUT|--checkpoint DIR --prompt TEXT \\
        [--max-new-tokens 64] [--temperature 1.0] [--top-p 1.0] [--seed 0]

Sampling runs through Hugging Face's ``generate`` on :class:`~tapered_megatron.hf.modeling.
TaperedForCausalLM` (key/value cache for the attention architectures); ``--temperature 0`` is
greedy decoding. Text is encoded and decoded with the model's own sentencepiece tokenizer, and
generation stops at the end-of-document token. Prints the prompt followed by the continuation.
"""

from __future__ import annotations

import argparse
import sys

import torch

from tapered_megatron.eval.common import add_model_args, fail, load_from_args
from tapered_megatron.export.load import ExportError


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m tapered_megatron.generate", description="Sample a continuation."
    )
    add_model_args(ap)
    ap.add_argument("--prompt", required=True, help="text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cache", action="store_true", help="recompute the prefix every step")
    a = ap.parse_args(argv)
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.max_new_tokens < 1:
        return fail(ValueError("need --temperature >= 0, 0 < --top-p <= 1, --max-new-tokens >= 1"))
    try:
        loaded = load_from_args(a)
        if loaded.tokenizer_model is None:
            raise ExportError("the model has no tokenizer recorded; pass --tokenizer-model")
    except (ExportError, FileNotFoundError) as e:
        return fail(e)
    from tapered_megatron.data import load_tokenizer
    from tapered_megatron.hf.modeling import TaperedForCausalLM

    tok = load_tokenizer(loaded.tokenizer_model)
    model = TaperedForCausalLM.from_language_model(loaded.module).eval()
    ids = torch.tensor([tok.encode(a.prompt)], device=a.device)
    if ids.numel() == 0:
        return fail(ValueError("--prompt encodes to no tokens"))
    torch.manual_seed(a.seed)
    sample = a.temperature > 0
    extra = {"temperature": a.temperature, "top_p": a.top_p} if sample else {}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=a.max_new_tokens,
            do_sample=sample,
            eos_token_id=tok.eod_id,
            pad_token_id=tok.pad_id,
            use_cache=not a.no_cache,
            **extra,
        )
    print(a.prompt + tok.decode(out[0, ids.shape[1] :].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
