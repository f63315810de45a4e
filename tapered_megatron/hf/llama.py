"""Our uniform-taper transformer as Hugging Face's ``LlamaForCausalLM`` (same weights).

A uniform taper gives every layer the same SwiGLU width, so the transformer has exactly Llama's
shapes: q/k rows are permuted per head from our adjacent-pair RoPE to Hugging Face's
rotate-half form, ``w13`` splits into gate and up, and the padded vocabulary rows are dropped.
Used by the tests (same logits) and by ``scripts/bench_eval.py`` (speed side by side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import LlamaConfig, LlamaForCausalLM

if TYPE_CHECKING:
    from tapered_megatron.config import Config


def to_llama(cfg: Config, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding ``state`` (single-process names, as an export holds them)
    of a uniform-taper transformer ``cfg``; raises :class:`ValueError` for any other model."""
    m = cfg.model
    if m.arch != "transformer" or len(set(cfg.taper_plan.widths)) != 1:
        raise ValueError(
            f"only a uniform-taper transformer has Llama's shapes ({m.arch}, widths "
            f"{sorted(set(cfg.taper_plan.widths))}); use --taper.schedule uniform"
        )
    hd, heads, kv, v = m.head_dim, m.heads, m.kv_heads, m.vocab_size
    conf = LlamaConfig(
        vocab_size=v, hidden_size=m.d_model, intermediate_size=cfg.taper_plan.widths[0],
        num_hidden_layers=m.layers, num_attention_heads=heads, num_key_value_heads=kv,
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
        if kv == heads:  # fused head-major [q | k | v]
            qkv = state[p + "mixer.qkv.weight"].view(heads, 3, hd, m.d_model)
            wq, wk, wv = qkv.unbind(1)
        else:  # [q] per query head, [k | v] per key/value head
            wq = state[p + "mixer.q.weight"].view(heads, hd, m.d_model)
            wk, wv = state[p + "mixer.kv.weight"].view(kv, 2, hd, m.d_model).unbind(1)
        out[q + "self_attn.q_proj.weight"] = wq[:, rotate_half].reshape(-1, m.d_model)
        out[q + "self_attn.k_proj.weight"] = wk[:, rotate_half].reshape(-1, m.d_model)
        out[q + "self_attn.v_proj.weight"] = wv.reshape(-1, m.d_model)
        out[q + "self_attn.o_proj.weight"] = state[p + "mixer.out.weight"]
        gate, up = state[p + "mlp.w13.weight"].chunk(2, dim=0)
        out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
        out[q + "mlp.down_proj.weight"] = state[p + "mlp.w2.weight"]
        out[q + "input_layernorm.weight"] = state[p + "mixer_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "mlp_norm.weight"]
    llama = LlamaForCausalLM(conf).eval()
    llama.load_state_dict({k: t.contiguous() for k, t in out.items()}, strict=True)
    return llama
