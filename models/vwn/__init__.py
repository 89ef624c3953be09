"""Virtual Width Networks over the dense decoder. Registered as "vwn"."""

from models.registry import ModelSpec, register_model

from .config import VWNConfig
from .model import VWNLM

register_model(ModelSpec("vwn", VWNConfig, VWNLM))

__all__ = ["VWNLM", "VWNConfig"]
