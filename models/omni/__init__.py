"""Omni-modal composition: modality encoders spliced into an LLM. Registered as "omni": trains
with the VLM answer loss on chat samples with media; and as "qwen2_5_vl", the same composition
configured as Hugging Face's Qwen2-VL / Qwen2.5-VL, with their whole-folder adapter."""

from models.llm.cost import LMCost
from veomni.contract import ModelSpec, register_model
from veomni.tasks import VLMTask

from . import (
    modalities,  # noqa: F401  (registers the modalities)
    qwen_vl_adapter,
)
from .config import OmniConfig
from .modality_registry import MediaItem, Modality, get_modality, register_modality
from .model import OmniModel
from .qwen_vl import QwenVLConfig


class OmniCost(LMCost):
    """The LLM's cost on the text rows plus each encoder's on the micro-batch's media."""

    def batch_flops(self, model: OmniModel, batch) -> float:
        return model.micro_batch_flops(batch)

    def report_lines(self, model: OmniModel, units: int) -> list[str]:
        return model.report_lines(units)


register_model(ModelSpec(name="omni", config_cls=OmniConfig, build=OmniModel, task=lambda config: VLMTask(),
                         dataset="chat_media", cost=OmniCost(), blocks_option="llm.num_layers"))
register_model(ModelSpec(name="qwen2_5_vl", config_cls=QwenVLConfig, build=OmniModel, task=lambda config: VLMTask(),
                         dataset="chat_media", cost=OmniCost(), blocks_option="llm.num_layers",
                         hf_adapter=qwen_vl_adapter))

__all__ = ["MediaItem", "Modality", "OmniConfig", "OmniModel", "QwenVLConfig", "get_modality", "register_modality"]
