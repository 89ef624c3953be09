"""Decoder LM, dense or MoE, weight-compatible with HF Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE.
Registered as "llm": trains with language modelling on packed text."""

from veomni.contract import ModelSpec, register_model
from veomni.tasks import LanguageModelingTask

from . import hf_adapter
from .config import LLMConfig
from .cost import LMCost
from .model import DecoderLM

register_model(ModelSpec(
    name="llm",
    config_cls=LLMConfig,
    build=DecoderLM,
    task=lambda config: LanguageModelingTask(),
    dataset="packed_text",
    cost=LMCost(),
    hf_adapter=hf_adapter,
))

__all__ = ["DecoderLM", "LLMConfig"]
