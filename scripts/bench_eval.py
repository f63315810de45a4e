"""Evaluation throughput of an export against the same weights in Hugging Face's LlamaForCausalLM.

    pip install -e .[eval] && python scripts/bench_eval.py [--model OUT] [--rounds 5]

Without ``--model`` it trains the quickstart with a uniform taper for ``--train-iters``
iterations (``pretrain/main.py``) and exports it. A uniform model has exactly Llama's shapes:
its weights are copied into a ``LlamaForCausalLM`` (q/k rows permuted per head from our
adjacent-pair RoPE to Hugging Face's rotate-half form, ``w13`` split into gate and up), checked
to give the same logits and the same greedy tokens, then both are timed side by side,
interleaved round by round on the same inputs:

* perplexity: our ``eval.perplexity`` path (``perplexity_of`` over ``windows`` of the training
  sequence length, the fused chunked LM-head loss) against Llama's logits + cross-entropy;
* greedy generation with the key/value cache through ``generate`` (batch 1, a prompt of
  ``--prompt-tokens`` from the validation split, exactly ``--new-tokens`` new tokens).

Prints one JSON line: tokens/s per side (median of rounds; wall clock and process CPU time) and
ours / Llama ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import ROOT, emit, interleaved, stamp

from tapered_megatron.eval.common import windows
from tapered_megatron.eval.perplexity import perplexity_of
from tapered_megatron.export.load import load_export
from tapered_megatron.hf.llama import to_llama


def train_and_export(folder: Path, iters: int) -> Path:
    """Quickstart, uniform taper, ``iters`` iterations, exported to ``folder/export``."""
    save = folder / "ckpt"
    cmd = [sys.executable, str(ROOT / "pretrain" / "main.py"), "--taper.schedule", "uniform",
           "--train.iters", str(iters), "--train.save_dir", str(save), "--eval.interval",
           str(iters), "--eval.iters", "2"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    from tapered_megatron.export.writer import export_checkpoint

    return export_checkpoint(save, folder / "export", log=lambda m: print(m, file=sys.stderr))


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a uniform-taper transformer export")
    ap.add_argument("--train-iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per perplexity pass")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from safetensors.torch import load_file

    from tapered_megatron.data import IndexedDataset, prepare_sample_corpus
    from tapered_megatron.hf.modeling import TaperedForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.model) if a.model else train_and_export(Path(tmp), a.train_iters)
        loaded = load_export(out)
        state = load_file(str(out / "model.safetensors"))
    cfg, ours = loaded.cfg, loaded.module
    try:
        llama = to_llama(cfg, state)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    prefix = prepare_sample_corpus(cfg.data.cache_dir, cfg.model.vocab_size)[1]
    stream = torch.as_tensor(IndexedDataset(prefix).tokens(0, a.tokens + 1).astype("int64"))
    seq, v = cfg.model.seq_len, cfg.model.vocab_size

    def llama_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(llama(x).logits.flatten(0, 1).float(), y.flatten())

    prompt = stream[None, : a.prompt_tokens]
    wrapped = TaperedForCausalLM.from_language_model(ours).eval()
    gen = {"max_new_tokens": a.new_tokens, "min_new_tokens": a.new_tokens, "do_sample": False}
    with torch.no_grad():
        diff = (ours(stream[None, :seq])[..., :v] - llama(stream[None, :seq]).logits).abs().max()
        same_tokens = (
            wrapped.generate(prompt, **gen).tolist() == llama.generate(prompt, **gen).tolist()
        )
        losses = {}

        def ppl(name: str, model) -> None:
            losses[name] = perplexity_of(model, windows(stream, seq, a.batch_size)).loss

        steps = {
            "ppl_ours": lambda: ppl("ours", ours),
            "ppl_llama": lambda: ppl("llama", llama_loss),
            "gen_ours": lambda: wrapped.generate(prompt, **gen),
            "gen_llama": lambda: llama.generate(prompt, **gen),
        }
        clocks = {"wall": time.perf_counter, "cpu": time.process_time}
        times = interleaved(steps, a.rounds, clocks=clocks)
    n_ppl = stream.numel() - 1
    rate = {}
    for key in steps:
        n = n_ppl if key.startswith("ppl") else a.new_tokens
        rate[key] = {clock: n / statistics.median(times[clock][key]) for clock in clocks}
    result = {
        "bench": "eval",
        "model": str(out) if a.model else f"quickstart uniform, {a.train_iters} iterations",
        "arch": cfg.model.arch,
        "params": sum(p.numel() for p in ours.parameters()),
        "seq_len": seq,
        "rounds": a.rounds,
        "max_abs_logit_diff": diff.item(),
        "greedy_tokens_identical": same_tokens,
        "loss": losses,
        "tokens_per_s": rate,
        "ratio_ours_over_llama": {
            kind: {t: rate[f"{kind}_ours"][t] / rate[f"{kind}_llama"][t] for t in ("wall", "cpu")}
            for kind in ("ppl", "gen")
        },
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **stamp(),
    }
    import transformers

    result["transformers"] = transformers.__version__
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
