"""Hugging Face ``transformers`` integration of exported models (the ``export`` extra).

Importing this package registers the ``tapered_lm`` model type with ``AutoConfig`` and
``AutoModelForCausalLM``, so exports load without ``trust_remote_code`` in a process that
imported it; elsewhere the export's ``auto_map`` (``trust_remote_code=True``) points at the same
classes. Training never imports this package.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from tapered_megatron.hf.configuration import MODEL_TYPE, TaperedConfig
from tapered_megatron.hf.modeling import TaperedForCausalLM

AutoConfig.register(MODEL_TYPE, TaperedConfig, exist_ok=True)
AutoModelForCausalLM.register(TaperedConfig, TaperedForCausalLM, exist_ok=True)

__all__ = ["TaperedConfig", "TaperedForCausalLM"]
