"""Decoder LM, dense or MoE, weight-compatible with HF Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE.
Registered as "llm"."""

from models.registry import ModelSpec, register_model

from . import hf_adapter
from .config import LLMConfig
from .model import DecoderLM

register_model(ModelSpec("llm", LLMConfig, DecoderLM, hf_adapter))

__all__ = ["DecoderLM", "LLMConfig"]
