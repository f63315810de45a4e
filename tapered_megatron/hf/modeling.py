"""``TaperedForCausalLM``: our language model behind the Hugging Face ``PreTrainedModel`` API.

The module holds the units of :func:`tapered_megatron.models.build_model` directly, so its
parameter names are the exported names (``embedding.embed.weight``,
``layers.N.{mixer_norm,mixer,mlp_norm,mlp}.*``, ``head.norm.weight``, ``head.proj.weight``) and
its uncached forward is exactly our module's. Logits are returned over the real vocabulary
(``config.vocab_size``); the padding rows of the LM head never produce a logit.

Generation: an architecture whose record says ``kv_cache`` (``transformer``,
``gated_attention``: an ``Attention`` mixer) keeps a key/value cache (a ``DynamicCache``,
``model.kv_heads`` heads per layer: grouped-query attention shrinks it) and runs one new token
per step; the others (``titans`` and ``hope_attention`` update memories inside the sequence)
recompute the whole prefix each step (correct, slower). Padding: a causal
model is unaffected by padding on the right, which is all batched scoring needs; left padding
(batched generation of prompts of unequal length) is rejected with a message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from tapered_megatron.architectures import resolve_architecture
from tapered_megatron.checkpoint.manifest import EXPORT_MANIFEST, manifest_problem
from tapered_megatron.hf.configuration import TaperedConfig
from tapered_megatron.models import LanguageModel, blocks, build_model
from tapered_megatron.models.attention import Attention
from tapered_megatron.models.layers import RotaryEmbedding, rope_tables


def _rotation(rope: RotaryEmbedding, start: int, length: int) -> torch.Tensor:
    """Complex RoPE factors ``[length, 1, head_dim / 2]`` of positions ``start ..``."""
    end = start + length
    if end > rope.cos.shape[0]:  # grow the tables (longer than training), with headroom
        cos, sin = rope_tables(rope.head_dim, 2 * end, rope.theta)
        rope.cos, rope.sin = cos.to(rope.cos.device), sin.to(rope.sin.device)
    return torch.complex(rope.cos[start:end, None, :].float(), rope.sin[start:end, None, :].float())


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x[b, s, heads, head_dim]`` (adjacent pairs, as the model's own rotation)."""
    xc = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * rot).flatten(-2).type_as(x)


def _cached_attention(
    attn: Attention, x: torch.Tensor, cache: DynamicCache, layer: int, rot: torch.Tensor
) -> torch.Tensor:
    """``attn(x)`` for new positions ``x`` after the ones already in ``cache`` (updated);
    ``rot`` are the RoPE factors of the new positions."""
    b, s, _ = x.shape
    start = cache.get_seq_length(layer)
    q, g, k, v = attn.project(x)
    q, k = _rotate(q, rot), _rotate(k, rot)
    k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer)  # kv_heads heads
    mask = None
    if s > 1 and start > 0:  # a chunk after a prefix: causal within the chunk, sees the prefix
        mask = torch.ones(s, start + s, dtype=torch.bool, device=x.device).tril(start)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and s > 1,
        enable_gqa=attn.grouped,
    ).transpose(1, 2)
    return attn.out(attn.gate(o, g).reshape(b, s, attn.heads * attn.head_dim))


class TaperedForCausalLM(PreTrainedModel, GenerationMixin):
    """A tapered-megatron model (any architecture) as a Hugging Face causal LM."""

    config_class = TaperedConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _supports_sdpa = True

    def __init__(self, config: TaperedConfig) -> None:
        super().__init__(config)
        cfg = config.run_config()
        self.arch, self.cfg = cfg.model.arch, cfg
        # e.g. Hope's teach signal: a pass of the whole model before the real one
        self._first_pass = blocks(cfg.model.arch).first_pass
        lm = build_model(cfg)  # random init from the run's seed; from_pretrained loads over it
        self.embedding, self.layers, self.head = lm.embedding, lm.layers, lm.head
        self.post_init()

    @classmethod
    def from_language_model(cls, lm: LanguageModel, **config_kwargs: Any) -> TaperedForCausalLM:
        """Wrap an existing :class:`LanguageModel` (its modules are shared, not copied)."""
        config = TaperedConfig.from_run_config(lm.cfg, **config_kwargs)
        with torch.device("meta"):
            model = cls(config)
        model.embedding, model.layers, model.head = lm.embedding, lm.layers, lm.head
        return model.train(lm.training)

    @property
    def supports_kv_cache(self) -> bool:
        """Whether generation keeps a key/value cache (the record's ``kv_cache``)."""
        return resolve_architecture(self.arch).kv_cache

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Only the RoPE tables need computing: every parameter comes from the checkpoint (or
        from our own layout-invariant init when the model is built directly)."""
        if isinstance(module, RotaryEmbedding):
            cos, sin = rope_tables(module.head_dim, module.cos.shape[0], module.theta)
            module.cos, module.sin = cos.to(module.cos.device), sin.to(module.sin.device)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face's ``from_pretrained``, after checking a local export directory against
        its ``manifest.json`` (a changed, added or missing file is refused in one line naming
        it); a directory without one (Hugging Face's own ``save_pretrained``) is not checked."""
        folder = Path(str(pretrained_model_name_or_path))
        ours = folder.is_dir() and (folder / EXPORT_MANIFEST).exists()
        why = manifest_problem(folder, record=EXPORT_MANIFEST) if ours else None
        if why is not None:
            raise ValueError(f"{why}; refused")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embedding.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head.proj

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits ``[b, s, vocab_size]`` (of the last ``logits_to_keep`` positions if > 0);
        with ``labels`` (HF convention: unshifted, -100 ignored) also the mean next-token loss.
        ``use_cache`` returns/extends ``cache``."""
        _check_padding(attention_mask)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        use_cache = use_cache and self.supports_kv_cache and labels is None
        h = self.embedding(input_ids)
        if use_cache:
            cache = cache if cache is not None else DynamicCache()
            rot = _rotation(self.layers[0].mixer.rope, cache.get_seq_length(), h.shape[1])
            for i, block in enumerate(self.layers):
                z = h + _cached_attention(block.mixer, block.mixer_norm(h), cache, i, rot)
                h = z + block.mlp(block.mlp_norm(z))
        else:
            cache = None
            if self._first_pass is not None:
                self._first_pass(self, input_ids)
            for block in self.layers:
                h = block(h)
        if logits_to_keep > 0 and labels is None:
            h = h[:, -logits_to_keep:]
        logits = self.head(h).logits()[..., : self.config.vocab_size]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Only the tokens the cache has not seen (all of them without a cache)."""
        if not self.supports_kv_cache or use_cache is False:
            cache = None
        if cache is not None and cache.get_seq_length() > 0:
            input_ids = input_ids[:, cache.get_seq_length() :]
        return {
            "input_ids": input_ids,
            "cache": cache,
            "attention_mask": attention_mask,
            "use_cache": use_cache,
            "logits_to_keep": kwargs.get("logits_to_keep", 0),
        }


def _check_padding(mask: torch.Tensor | None) -> None:
    """Reject left padding: a causal model without position offsets needs prompts that start at
    position 0 (padding after the last real token is harmless)."""
    if mask is None or mask.dim() != 2 or bool(mask.all()):
        return
    m = mask.bool()
    # every row must be ones then zeros: no one after a zero
    if bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError(
            "TaperedForCausalLM does not support left padding (attention_mask with zeros before "
            "real tokens); pad on the right (tokenizer.padding_side = 'right') or run prompts "
            "one at a time"
        )
