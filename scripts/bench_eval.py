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

from tapered_megatron.config import Config
from tapered_megatron.eval.common import windows
from tapered_megatron.eval.perplexity import perplexity_of
from tapered_megatron.export.load import load_export


def train_and_export(folder: Path, iters: int) -> Path:
    """Quickstart, uniform taper, ``iters`` iterations, exported to ``folder/export``."""
    save = folder / "ckpt"
    cmd = [sys.executable, str(ROOT / "pretrain" / "main.py"), "--taper.schedule", "uniform",
           "--train.iters", str(iters), "--train.save_dir", str(save), "--eval.interval",
           str(iters), "--eval.iters", "2"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    from tapered_megatron.export.writer import export_checkpoint

    return export_checkpoint(save, folder / "export", log=lambda m: print(m, file=sys.stderr))


def to_llama(cfg: Config, state: dict[str, torch.Tensor]):
    """A ``LlamaForCausalLM`` holding the weights of a uniform-taper transformer export."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    if m.arch != "transformer" or len(set(cfg.taper_plan.widths)) != 1:
        raise SystemExit("the Llama comparison needs a uniform-taper transformer")
    hd, heads, v = m.head_dim, m.heads, m.vocab_size
    conf = LlamaConfig(
        vocab_size=v, hidden_size=m.d_model, intermediate_size=cfg.taper_plan.widths[0],
        num_hidden_layers=m.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    rotate_half = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    out = {
        "model.embed_tokens.weight": state["embedding.embed.weight"][:v],
        "model.norm.weight": state["head.norm.weight"],
        "lm_head.weight": state["head.proj.weight"][:v],
    }
    for i in range(m.layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        qkv = state[p + "mixer.qkv.weight"].view(heads, 3, hd, m.d_model)
        out[q + "self_attn.q_proj.weight"] = qkv[:, 0, rotate_half].reshape(-1, m.d_model)
        out[q + "self_attn.k_proj.weight"] = qkv[:, 1, rotate_half].reshape(-1, m.d_model)
        out[q + "self_attn.v_proj.weight"] = qkv[:, 2].reshape(-1, m.d_model)
        out[q + "self_attn.o_proj.weight"] = state[p + "mixer.out.weight"]
        gate, up = state[p + "mlp.w13.weight"].chunk(2, dim=0)
        out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
        out[q + "mlp.down_proj.weight"] = state[p + "mlp.w2.weight"]
        out[q + "input_layernorm.weight"] = state[p + "mixer_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "mlp_norm.weight"]
    llama = LlamaForCausalLM(conf).eval()
    llama.load_state_dict({k: t.contiguous() for k, t in out.items()}, strict=True)
    return llama


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
    llama = to_llama(cfg, state)
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
