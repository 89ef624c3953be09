"""Wan2.1 image-to-video conditioning channels, as diffusers' ``WanImageToVideoPipeline`` builds them.

An I2V Wan (``in_channels`` 36 = 16 + 4 + 16) reads, per latent position, the noisy latent, then
a frame mask, then the condition latent: the VAE latent of the clip whose first frame is the
given image and whose other frames are zero. The mask has one channel per pixel frame a latent
frame covers (the VAE's temporal factor, 4): the first latent frame stands for the first pixel
frame repeated, so all its mask channels are 1; every later latent frame's are 0.
"""

from __future__ import annotations

import torch


def wan_i2v_condition(condition_latent: torch.Tensor, mask_channels: int = 4) -> torch.Tensor:
    """``[mask_channels + C, F, H, W]``: the frame mask (ones on latent frame 0) and ``condition_latent``
    [C, F, H, W] concatenated on channels (the pipeline's ``concat([mask_lat_size, latent_condition])``)."""
    _, frames, height, width = condition_latent.shape
    mask = condition_latent.new_zeros(mask_channels, frames, height, width)
    mask[:, 0] = 1
    return torch.cat([mask, condition_latent])
