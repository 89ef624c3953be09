"""Sampling the Wan2.1 image-to-video form (``in_channels`` > ``out_channels``) from a first frame.

Such a model reads, beside the noisy latent, conditioning channels (the frame mask and the
latent of the first frame followed by zero frames) and, with ``image_dim``, the image encoder's
states of the frame. The sampler must give it exactly what training gave it, so both are built
here with the latent precompute's own code (``models/dit/conditioning.py::first_frame_conditions``
on the run's VAE, ``veomni.data.video.encoders.ImageEncoder`` on the image-encoder folder the
latent manifest records), as diffusers' ``WanImageToVideoPipeline`` builds them. Validation
samples take the same tensors from the held-out cache instead (``ConditionInputs`` either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.dit.conditioning import first_frame_conditions
from models.dit.latent_manifest import resolve_folder
from veomni.data.video.clip_format import Clip
from veomni.data.video.encoders import ImageEncoder, LatentEncoder, image_encoder_width, load_image_encoder


@dataclass(frozen=True)
class ConditionInputs:
    """What a conditioning-channel model reads per sample beside its noisy latent."""

    condition: torch.Tensor
    """[B, Q, F', H', W']: concatenated after the noisy latent's channels."""
    image: torch.Tensor | None = None
    """[B, L, image_dim]: the image encoder's states (None: a model without an image branch)."""

    def select(self, members: list[int], device: torch.device) -> ConditionInputs:
        image = None if self.image is None else self.image[members].to(device, torch.float32)
        return ConditionInputs(self.condition[members].to(device, torch.float32), image)


@dataclass
class FirstFrameConditioner:
    """uint8 first frames -> the ``ConditionInputs`` the latent precompute would store for clips starting
    with them."""

    vae: LatentEncoder
    image_encoder: ImageEncoder | None

    @torch.no_grad()
    def __call__(self, frames: np.ndarray, num_frames: int) -> ConditionInputs:
        """``frames`` uint8 [B, H, W, 3] -> inputs for clips of ``num_frames`` frames at that size."""
        clips = [Clip(f"--image {i}", np.repeat(frame[None], num_frames, axis=0), {})
                 for i, frame in enumerate(frames)]
        for clip in clips:
            self.vae.check(clip)
        condition = torch.stack(first_frame_conditions(self.vae, clips, batch_frames=num_frames * len(clips)))
        image = None if self.image_encoder is None else torch.stack(self.image_encoder.encode(list(frames)))
        return ConditionInputs(condition, image)


def first_frame_conditioner(manifest: dict[str, Any], folder: Path, vae: LatentEncoder, image_dim: int | None,
                            device: torch.device) -> FirstFrameConditioner:
    """The conditioner of a model reading ``image_dim``-wide image states (None: none) on the latent split
    at ``folder``; FileNotFoundError naming the fix when the manifest's image encoder is missing."""
    if image_dim is None:
        return FirstFrameConditioner(vae, None)
    entry = manifest.get("image_encoder")
    if not entry:
        raise FileNotFoundError(f"the model reads image states (model.image_dim {image_dim}) but the latent manifest "
                                f"of {folder} names no image encoder: rebuild the latents with "
                                "data/build_video_latents.py --condition --image-encoder CLIP_VISION_FOLDER")
    path = resolve_folder(entry["path"], folder, fix="put the CLIPVisionModel folder the latents were built with "
                          "(data/build_video_latents.py --image-encoder) there")
    if image_encoder_width(path) != image_dim:
        raise ValueError(f"the image encoder at {path} gives states {image_encoder_width(path)} wide; the model reads "
                         f"model.image_dim {image_dim}")
    encoder = load_image_encoder(path)
    encoder.encoder.to(device)
    return FirstFrameConditioner(vae, encoder)
