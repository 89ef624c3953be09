"""Image-to-video conditioning in the latent cache: what a sample carries besides its latent and
caption, read and checked against the model.

Why here and not in the zoo: the dataset kind and its launch check read it, and the engine never
imports the zoo, so the cache stores the conditioning channels finished (the latent precompute,
``data/build_video_latents.py``, builds them with the family's own code): a sample's
``latent.safetensors`` may hold

- ``condition`` float32 [Q, F, H, W]: the channels an image-to-video model reads beside the noisy
  latent at every latent position (Wan2.1 I2V: a frame mask of the VAE's temporal factor channels,
  ones on latent frame 0, then the latent of the first frame followed by zero frames), so
  ``Q = model.in_channels - model.out_channels``; the row carries them as ``condition`` [T, Q x patch];
- ``image`` float32 [L, image_dim]: the image encoder's states of the first frame (Wan2.1: CLIP's
  penultimate layer), computed once like the text states; the row carries them as ``image_states``
  with ``image_cu_seqlens``.

The manifest records ``condition_channels`` and ``image_dim`` (0 and null when absent). The
launch check compares them with the model before any worker starts, naming a sample of the split;
a sample whose tensors disagree with the manifest is refused when it is read, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from veomni.errors import BadData


@dataclass(frozen=True)
class Conditioning:
    """What a model reads per sample besides the latent and caption."""

    channels: int
    """Conditioning channels per latent position (``in_channels - out_channels``; 0: none)."""
    image_dim: int | None
    """Width of the image encoder states it cross-attends to (None: no image branch)."""

    @classmethod
    def of(cls, model_config: Any) -> Conditioning:
        return cls(model_config.in_channels - model_config.out_channels, model_config.image_dim)


def decode_conditioning(tensors: dict[str, torch.Tensor], latent: torch.Tensor,
                        wanted: Conditioning) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(condition, image)`` of a sample's tensors as the model reads them; BadData saying what is
    missing or of the wrong shape (the caller names the sample)."""
    condition = image = None
    if wanted.channels:
        condition = tensors.get("condition")
        expected = [wanted.channels, *latent.shape[1:]]
        if condition is None:
            raise BadData(f"no 'condition' tensor: the model reads {wanted.channels} conditioning channels per latent "
                          "position (model.in_channels - model.out_channels); rebuild the latents with "
                          "data/build_video_latents.py --condition")
        if list(condition.shape) != expected:
            raise BadData(f"condition of shape {list(condition.shape)}, the model reads {expected} (its conditioning "
                          "channels at the latent's frames, height and width)")
        condition = condition.float()
    if wanted.image_dim is not None:
        image = tensors.get("image")
        if image is None:
            raise BadData(f"no 'image' tensor: the model cross-attends to image encoder states (model.image_dim="
                          f"{wanted.image_dim}); rebuild the latents with data/build_video_latents.py --image-encoder")
        if image.dim() != 2 or image.shape[1] != wanted.image_dim:
            raise BadData(f"image states of shape {list(image.shape)}, the model reads [L, {wanted.image_dim}] "
                          "(model.image_dim)")
        image = image.float()
    return condition, image


def conditioning_problems(name: str, source: str, manifest: dict[str, Any], example: str,
                          model_config: Any) -> list[str]:
    """The split's conditioning (its manifest's ``condition_channels`` / ``image_dim``) against the
    model's; ``example`` names a sample of the split (``"sample 'k'"``)."""
    wanted = Conditioning.of(model_config)
    channels, image_dim = int(manifest.get("condition_channels") or 0), manifest.get("image_dim")
    problems = []
    if wanted.channels != channels:
        held = f"hold {channels} conditioning channels" if channels else "hold no conditioning channels"
        fix = ("rebuild them with data/build_video_latents.py --condition" if not channels else
               f"set model.in_channels: {model_config.out_channels + channels}")
        problems.append(f"{name}: model.in_channels={model_config.in_channels} is out_channels="
                        f"{model_config.out_channels} plus {wanted.channels} conditioning channels per latent position "
                        f"(image-to-video), but the latents of {source} ({example} and every other) {held}; {fix}")
    if wanted.image_dim != image_dim:
        held = f"image states {image_dim} wide" if image_dim else "no image encoder states"
        fix = (f"set model.image_dim: {image_dim}" if image_dim and wanted.image_dim else
               "rebuild them with data/build_video_latents.py --image-encoder FOLDER" if wanted.image_dim else
               "set model.image_dim and model.added_kv_proj_dim, or rebuild the latents without --image-encoder")
        problems.append(f"{name}: model.image_dim={wanted.image_dim}, but the latents of {source} ({example} and "
                        f"every other) hold {held}; {fix}")
    return problems


NO_CONDITIONING = Conditioning(0, None)
"""A text-to-video model's: latent and caption only."""
