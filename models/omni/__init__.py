"""Omni-modal composition: modality encoders spliced into an LLM. Registered as "omni": trains
with the VLM answer loss on chat samples with media."""

from models.llm.cost import LMCost
from veomni.contract import ModelSpec, register_model
from veomni.tasks import VLMTask

from . import modalities  # noqa: F401  (registers the modalities)
from .config import OmniConfig
from .modality_registry import MediaItem, Modality, get_modality, register_modality
from .model import OmniModel


class OmniCost(LMCost):
    """The LLM's cost on the text rows plus each encoder's on the micro-batch's media."""

    def batch_flops(self, model: OmniModel, batch) -> float:
        return model.micro_batch_flops(batch)

    def report_lines(self, model: OmniModel, units: int) -> list[str]:
        return model.report_lines(units)


register_model(ModelSpec(name="omni", config_cls=OmniConfig, build=OmniModel, task=lambda config: VLMTask(),
                         dataset="chat_media", cost=OmniCost(), blocks_option="llm.num_layers"))

__all__ = ["MediaItem", "Modality", "OmniConfig", "OmniModel", "get_modality", "register_modality"]
