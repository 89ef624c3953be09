"""Omni-modal composition: modality encoders spliced into an LLM. Registered as "omni"."""

from models.registry import ModelSpec, register_model

from . import modalities  # noqa: F401  (registers the modalities)
from .config import OmniConfig
from .model import OmniModel
from .registry import MediaItem, Modality, get_modality, register_modality

register_model(ModelSpec("omni", OmniConfig, OmniModel))

__all__ = ["MediaItem", "Modality", "OmniConfig", "OmniModel", "get_modality", "register_modality"]
