"""Entry point of ``scripts/sample.sh``: the zoo's sampler (``models/dit/sample.py``) with the
engine's checkpoint reader and, for a conditioning-channel (Wan2.1 image-to-video) model, the
first-frame conditioner on the engine's encoders, which the zoo may not import itself.

The conditioner builds from an image what the latent precompute stored for training, with its
code: ``first_frame_conditions`` on the run's VAE (the latent manifest's) for the condition
channels, and, for a model with ``image_dim``, the ``CLIPVisionModel`` folder the manifest records
(``image_encoder.path``) for the image states; a manifest without that folder is refused naming the fix.
"""

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.dit.conditioning import first_frame_conditions
from models.dit.image_to_video import ConditionInputs
from models.dit.latent_manifest import read_latent_manifest, resolve_folder
from models.dit.sample import main
from veomni.checkpoint.export import load_run_weights
from veomni.data.video.clip_format import Clip
from veomni.data.video.encoders import ImageEncoder, LatentEncoder, image_encoder_width, load_image_encoder, load_vae


@dataclass
class EncoderConditioner:
    """``models.dit.image_to_video.FirstFrameConditioner`` on the engine's encoders."""

    vae: LatentEncoder
    image_encoder: ImageEncoder | None

    @torch.no_grad()
    def __call__(self, frames: np.ndarray, num_frames: int) -> ConditionInputs:
        clips = [Clip(f"--image {i}", np.repeat(frame[None], num_frames, axis=0), {}) for i, frame in enumerate(frames)]
        for clip in clips:
            self.vae.check(clip)
        condition = torch.stack(first_frame_conditions(self.vae, clips, batch_frames=num_frames * len(clips)))
        image = None if self.image_encoder is None else torch.stack(self.image_encoder.encode(list(frames)))
        return ConditionInputs(condition, image)


def load_conditioner(train_path: str, model_config: Any, device: str) -> EncoderConditioner:
    """The conditioner of the latent split at ``train_path`` for ``model_config``; FileNotFoundError
    naming the fix when the model reads image states the manifest's encoder folder cannot give."""
    manifest, folder = read_latent_manifest(train_path)
    vae = load_vae(resolve_folder(manifest["vae"]["path"], folder))
    vae.vae.to(device)
    image_dim = model_config.image_dim
    if image_dim is None:
        return EncoderConditioner(vae, None)
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
    return EncoderConditioner(vae, encoder)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], load_run_weights, load_conditioner))
