"""Wan2.1 image-to-video conditioning channels, as diffusers' ``WanImageToVideoPipeline`` builds them.

An I2V Wan (``in_channels`` 36 = 16 + 4 + 16) reads, per latent position, the noisy latent, then
a frame mask, then the condition latent: the VAE latent of the clip whose first frame is the
given image and whose other frames are zero. The mask has one channel per pixel frame a latent
frame covers (the VAE's temporal factor, 4): the first latent frame stands for the first pixel
frame repeated, so all its mask channels are 1; every later latent frame's are 0.

``first_frame_conditions`` is the one place that turns clips into those channels: the latent
precompute (``data/build_video_latents.py --condition``) and the sampler (``scripts/sample.sh
--image``, ``models/dit/image_to_video.py``) both call it, so a model samples from exactly what it
was trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class FirstFrameLatents(Protocol):
    """What ``first_frame_conditions`` needs of a VAE: ``veomni.data.video.encoders.LatentEncoder``."""

    geometry: Any
    """Its ``VaeGeometry`` (``temporal_factor``: the mask channels)."""

    def encode(self, clips: Sequence[Any], batch_frames: int, first_frame_only: bool = False) -> list[torch.Tensor]:
        ...


def wan_i2v_condition(condition_latent: torch.Tensor, mask_channels: int = 4) -> torch.Tensor:
    """``[mask_channels + C, F, H, W]``: the frame mask (ones on latent frame 0) and ``condition_latent``
    [C, F, H, W] concatenated on channels (the pipeline's ``concat([mask_lat_size, latent_condition])``)."""
    _, frames, height, width = condition_latent.shape
    mask = condition_latent.new_zeros(mask_channels, frames, height, width)
    mask[:, 0] = 1
    return torch.cat([mask, condition_latent])


def first_frame_conditions(vae: FirstFrameLatents, clips: Sequence[Any], batch_frames: int) -> list[torch.Tensor]:
    """Each clip's ``condition`` [T + C, F', H', W']: ``wan_i2v_condition`` of the normalised latent of
    its first frame followed by zero frames (``veomni.data.video.clip_format.Clip`` of one ``vae.batch_key``;
    T the VAE's temporal factor)."""
    return [wan_i2v_condition(latent, vae.geometry.temporal_factor)
            for latent in vae.encode(clips, batch_frames, first_frame_only=True)]
