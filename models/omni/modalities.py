"""The registered modalities. Adding one is one ``register_modality`` entry here (see
docs/adding_a_modality.md); nothing under ``veomni/`` changes."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping

import torch
from PIL import Image

from models.vit.config import ViTConfig
from models.vit.model import NativeResolutionViT
from models.vit.processing import image_to_patches, smart_resize

from .registry import MediaItem, Modality, register_modality


def process_image(raw: bytes, cfg: ViTConfig) -> MediaItem:
    """Encoded image bytes -> patches at native resolution (within the config's pixel budget).

    PIL errors on a corrupt file propagate: the data pipeline skips and counts the sample.
    """
    with Image.open(io.BytesIO(raw)) as image:
        image.load()
        patches, grid = image_to_patches(image, cfg.patch_size, cfg.merge_size, cfg.min_pixels, cfg.max_pixels,
                                         cfg.image_mean, cfg.image_std)
    return MediaItem(inputs={"patches": patches, "grid_thw": torch.tensor([grid], dtype=torch.long)},
                     num_tokens=patches.shape[0] // cfg.merge_size**2, cost=patches.shape[0])


def image_dummy_inputs(cfg: ViTConfig, largest: bool = False) -> dict[str, torch.Tensor]:
    """One merge group of zero patches; ``largest``: a square image at ``max_pixels``."""
    side = cfg.merge_size
    if largest:
        edge = math.isqrt(cfg.max_pixels)
        h, w = smart_resize(edge, edge, cfg.resize_factor, cfg.min_pixels, cfg.max_pixels)
        grid = (1, h // cfg.patch_size, w // cfg.patch_size)
    else:
        grid = (1, side, side)
    return {"patches": torch.zeros(grid[1] * grid[2], cfg.patch_dim),
            "grid_thw": torch.tensor([grid], dtype=torch.long)}


def image_flops(encoder: NativeResolutionViT, inputs: Mapping[str, torch.Tensor]) -> float:
    return encoder.training_flops(inputs["grid_thw"])


register_modality(Modality(
    name="image",
    config_cls=ViTConfig,
    encoder_cls=NativeResolutionViT,
    processor=process_image,
    dummy_inputs=image_dummy_inputs,
    flops=image_flops,
    placeholder="<image>",
    fields=("png", "jpg", "jpeg", "webp"),
    adapter="merger",
))
