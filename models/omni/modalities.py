"""The registered modalities. Adding one is one ``register_modality`` entry here (see
docs/adding_a_modality.md); nothing under ``veomni/`` changes."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping

import torch
from PIL import Image

from models.audio.config import AudioEncoderConfig
from models.audio.model import AudioEncoder
from models.audio.processing import wav_to_features
from models.vit.config import ViTConfig
from models.vit.model import NativeResolutionViT
from models.vit.processing import image_to_patches, smart_resize

from .modality_registry import MediaItem, Modality, register_modality


def process_image(raw: bytes, cfg: ViTConfig, resize=smart_resize) -> MediaItem:
    """Encoded image bytes -> patches at native resolution (within the config's pixel budget, by the
    sizing rule ``resize``), repeated over the tower's temporal patch (Qwen-VL: 2 frames).

    PIL errors on a corrupt file propagate: the data pipeline skips and counts the sample.
    """
    with Image.open(io.BytesIO(raw)) as image:
        image.load()
        patches, grid = image_to_patches(image, cfg.patch_size, cfg.merge_size, cfg.min_pixels, cfg.max_pixels,
                                         cfg.image_mean, cfg.image_std, cfg.temporal_patch_size, resize)
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


def split_images(inputs: Mapping[str, torch.Tensor], cfg: ViTConfig) -> list[MediaItem]:
    """Collated ``patches`` / ``grid_thw`` -> one item per ``grid_thw`` row (its ``t*h*w`` patch rows)."""
    grid = inputs["grid_thw"]
    sizes = grid.prod(dim=1).tolist()
    return [MediaItem(inputs={"patches": patches, "grid_thw": grid[i:i + 1]},
                      num_tokens=patches.shape[0] // cfg.merge_size**2, cost=patches.shape[0])
            for i, patches in enumerate(inputs["patches"].split(sizes))]


register_modality(Modality(
    name="image",
    config_cls=ViTConfig,
    encoder_cls=NativeResolutionViT,
    processor=process_image,
    dummy_inputs=image_dummy_inputs,
    flops=image_flops,
    split=split_images,
    placeholder="<image>",
    fields=("png", "jpg", "jpeg", "webp"),
    adapter="merger",
))


def process_audio(raw: bytes, cfg: AudioEncoderConfig) -> MediaItem:
    """WAV bytes -> log-mel features; the encoder's rate and ``max_frames`` limits raise (and
    the data pipeline skips and counts the sample). Cost: its tokens, the transformer's length
    (as an image costs its patches)."""
    features, frames = wav_to_features(raw, cfg)
    tokens = cfg.conv_output_length(frames)
    return MediaItem(inputs={"features": features, "lengths": torch.tensor([frames], dtype=torch.long)},
                     num_tokens=tokens, cost=tokens)


def audio_dummy_inputs(cfg: AudioEncoderConfig, largest: bool = False) -> dict[str, torch.Tensor]:
    """One frame of silence; ``largest``: a clip of ``max_frames``."""
    frames = cfg.max_frames if largest else 1
    return {"features": torch.zeros(frames, cfg.n_mels), "lengths": torch.tensor([frames], dtype=torch.long)}


def audio_flops(encoder: AudioEncoder, inputs: Mapping[str, torch.Tensor]) -> float:
    return encoder.training_flops(inputs["lengths"])


def split_audio(inputs: Mapping[str, torch.Tensor], cfg: AudioEncoderConfig) -> list[MediaItem]:
    """Collated ``features`` / ``lengths`` -> one item per clip (its ``lengths[i]`` frame rows)."""
    lengths = inputs["lengths"]
    items = []
    for i, features in enumerate(inputs["features"].split(lengths.tolist())):
        tokens = cfg.conv_output_length(features.shape[0])
        items.append(MediaItem(inputs={"features": features, "lengths": lengths[i:i + 1]},
                               num_tokens=tokens, cost=tokens))
    return items


register_modality(Modality(
    name="audio",
    config_cls=AudioEncoderConfig,
    encoder_cls=AudioEncoder,
    processor=process_audio,
    dummy_inputs=audio_dummy_inputs,
    flops=audio_flops,
    split=split_audio,
    placeholder="<audio>",
    fields=("wav",),
    adapter="proj",
))
