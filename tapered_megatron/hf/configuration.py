"""``TaperedConfig``: the Hugging Face config of an exported tapered-megatron model.

``config.json`` of an export holds the run's whole configuration (``tapered_config``, the
``config.yaml`` of the checkpoint), the per-layer MLP widths of its taper plan
(``taper_widths``) and the usual Hugging Face fields, all derived from those two:
``vocab_size`` (the tokenizer's vocabulary, ``model.vocab_size``; logits are returned over it),
``padded_vocab_size`` (rows of the embedding and LM-head weights as trained, padded Megatron
style; the extra rows are kept in ``model.safetensors`` and never produce logits),
``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``
(``model.kv_heads``: fewer than the attention heads under grouped-query attention),
``intermediate_size`` (the
uniform baseline ``d_ff`` the taper redistributes) and ``max_position_embeddings`` (the
training sequence length).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import PreTrainedConfig

if TYPE_CHECKING:
    from tapered_megatron.config import Config

MODEL_TYPE = "tapered_lm"


class TaperedConfig(PreTrainedConfig):
    """Hugging Face config wrapping a tapered-megatron :class:`~tapered_megatron.config.Config`."""

    model_type = MODEL_TYPE

    tapered_config: dict | None = None
    taper_widths: list[int] | None = None
    vocab_size: int = 0
    padded_vocab_size: int = 0
    hidden_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    max_position_embeddings: int = 0
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = 3

    def __post_init__(self, **kwargs: Any) -> None:
        model = (self.tapered_config or {}).get("model", {})
        self.vocab_size = int(model.get("vocab_size", self.vocab_size))
        self.hidden_size = int(model.get("d_model", self.hidden_size))
        self.num_hidden_layers = int(model.get("layers", self.num_hidden_layers))
        self.num_attention_heads = int(model.get("heads", self.num_attention_heads))
        kv = int(model.get("kv_heads", self.num_key_value_heads))
        self.num_key_value_heads = kv or self.num_attention_heads  # 0: one per attention head
        self.intermediate_size = int(model.get("d_ff", self.intermediate_size))
        self.max_position_embeddings = int(model.get("seq_len", self.max_position_embeddings))
        super().__post_init__(**kwargs)

    @classmethod
    def from_run_config(cls, cfg: Config, dtype: str = "float32", **kwargs: Any) -> TaperedConfig:
        """The config of a model trained with ``cfg`` (widths and padding as ``cfg`` gives them)
        whose weights are stored in ``dtype``."""
        return cls(
            tapered_config=cfg.to_dict(),
            taper_widths=list(cfg.taper_plan.widths),
            padded_vocab_size=cfg.padded_vocab_size,
            architectures=["TaperedForCausalLM"],
            auto_map={
                "AutoConfig": "configuration_tapered.TaperedConfig",
                "AutoModelForCausalLM": "modeling_tapered.TaperedForCausalLM",
            },
            dtype=dtype,
            **kwargs,
        )

    def run_config(self) -> Config:
        """The tapered-megatron config, checked to give the recorded widths and vocabulary."""
        from tapered_megatron.config import config_from_dict

        cfg = config_from_dict(self.tapered_config or {}, fix="import {} before from_pretrained")
        widths = list(cfg.taper_plan.widths)
        if self.taper_widths and widths != list(self.taper_widths):
            raise ValueError(
                f"config.json records taper widths {list(self.taper_widths)} but this version of "
                f"tapered_megatron plans {widths} for its configuration; use the tapered_megatron "
                "version that exported it"
            )
        if self.padded_vocab_size and cfg.padded_vocab_size != self.padded_vocab_size:
            raise ValueError(
                f"config.json records padded_vocab_size {self.padded_vocab_size} but this version "
                f"of tapered_megatron pads to {cfg.padded_vocab_size}; use the version that "
                "exported it"
            )
        return cfg
