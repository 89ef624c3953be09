"""Native-resolution ViT (Seed-ViT style) with a 2x2 merge adapter to the LLM width.

Not a top-level training architecture: omni models build it as an image/video encoder.
"""

from .config import ViTConfig
from .model import NativeResolutionViT
from .processing import image_to_patches, patch_positions, smart_resize, video_to_patches

__all__ = [
    "NativeResolutionViT",
    "ViTConfig",
    "image_to_patches",
    "patch_positions",
    "smart_resize",
    "video_to_patches",
]
