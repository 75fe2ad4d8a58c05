"""Hand-written Gemma 3 / Gemma 4 text models for the custom_torch backend."""

from .attention_context import AttentionContext, ContiguousKVContext, build_attention_mask, eager_attention
from .config import GemmaTextConfig, RopeParams
from .gemma import GemmaForCausalLM

__all__ = [
    "AttentionContext",
    "ContiguousKVContext",
    "GemmaForCausalLM",
    "GemmaTextConfig",
    "RopeParams",
    "build_attention_mask",
    "eager_attention",
]
