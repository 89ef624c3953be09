"""Native-resolution ViT (Seed-ViT style) with a 2x2 merge adapter to the LLM width.

Not a top-level training architecture: omni models build it as an image/video encoder. Its HF
adapter (a Qwen2-VL vision tower, ``hf_adapter.py``) is registered for ``checkpoint.init``.
"""

from veomni.contract import register_hf_adapter

from . import hf_adapter
from .config import ViTConfig
from .model import NativeResolutionViT
from .processing import image_to_patches, patch_positions, smart_resize, video_to_patches

register_hf_adapter(hf_adapter)

__all__ = [
    "NativeResolutionViT",
    "ViTConfig",
    "image_to_patches",
    "patch_positions",
    "smart_resize",
    "video_to_patches",
]
