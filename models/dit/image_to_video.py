"""Sampling the Wan2.1 image-to-video form (``in_channels`` > ``out_channels``) from a first frame.

Such a model reads, beside the noisy latent, conditioning channels (the frame mask and the
latent of the first frame followed by zero frames) and, with ``image_dim``, the image encoder's
states of the frame: ``ConditionInputs``. The sampler must give it exactly what training gave
it, so from an image they are built with the latent precompute's own code
(``models/dit/conditioning.py::first_frame_conditions`` on the run's VAE and the image-encoder
folder the latent manifest records); the zoo cannot load the engine's encoders, so the entry
point builds that ``FirstFrameConditioner`` (``scripts/sample.py``) and hands it in, as it hands
in the checkpoint reader. Validation samples take the tensors from the held-out cache instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


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


class FirstFrameConditioner(Protocol):
    """uint8 first frames [B, H, W, 3] and the clip's frame count -> the ``ConditionInputs`` the latent
    precompute would store for clips starting with them."""

    def __call__(self, frames: np.ndarray, num_frames: int) -> ConditionInputs: ...


def is_conditioned(model_config: Any) -> bool:
    """Whether the model reads conditioning channels (Wan2.1 image-to-video)."""
    return model_config.in_channels > model_config.out_channels
