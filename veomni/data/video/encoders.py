"""The frozen encoders of the video DiT's data: a diffusers VAE (clip -> normalised latent) and a
transformers text encoder (caption -> states of its real tokens).

Why one module: the latent precompute (``data/build_video_latents.py``) and the ``video_clips``
dataset kind (``veomni.data.video.clips``, encoding on the fly) must turn a clip into exactly the
same latent and text states, so both call this one implementation. The VAE is either

- ``AutoencoderKL`` (per frame): a clip's frames are encoded as a batch of images and stacked on
  F; latent = ``(mean - shift_factor) * scaling_factor`` from its config (no shift when unset);
  spatial factor ``2 ** (len(block_out_channels) - 1)``, no temporal compression;
- ``AutoencoderKLWan`` (whole clip, causal in time: F frames -> 1 + (F - 1) / 4 latent frames):
  clips as [B, 3, F, H, W]; latent = ``(mean - latents_mean) / latents_std`` per channel (how Wan
  normalises), spatial factor ``2 ** len(temperal_downsample)``, temporal ``2 ** sum(...)``.

Pixels are scaled to [-1, 1]; the latent is the posterior mean. Text states are the encoder's
last hidden states of the caption's real tokens (words and the closing ``[EOS]``, no padding).
A VAE's geometry (factors, latent channels) and an encoder's width are read from their
``config.json`` alone (``vae_geometry``, ``text_encoder_width``), so launch checks import neither
library; diffusers and transformers are imported only when a model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from veomni.data.video.clip_format import Clip
from veomni.errors import BadData

VAE_CLASSES = ("AutoencoderKL", "AutoencoderKLWan")


class EncoderError(BadData):
    """A folder that is not the encoder it should be, or a clip or caption it cannot encode."""


@dataclass(frozen=True)
class VaeGeometry:
    """What a VAE makes of a clip's shape."""

    class_name: str
    spatial_factor: int
    temporal_factor: int
    latent_channels: int

    @property
    def whole_clip(self) -> bool:
        """Whether the VAE encodes a clip at once (Wan) rather than frame by frame."""
        return self.class_name == "AutoencoderKLWan"

    def latent_shape(self, frames: int, height: int, width: int) -> list[int]:
        """``[C, F', H', W']`` of a clip of ``frames x height x width``; EncoderError when the
        VAE cannot encode that shape."""
        spatial, temporal = self.spatial_factor, self.temporal_factor
        if height % spatial or width % spatial or (frames - 1) % temporal:
            frames_too = f" and F - 1 by {temporal}" if temporal > 1 else ""
            raise EncoderError(f"a {frames}x{height}x{width} (FxHxW) clip does not fit the {self.class_name}: it needs "
                               f"H and W divisible by {spatial}{frames_too}")
        return [self.latent_channels, 1 + (frames - 1) // temporal, height // spatial, width // spatial]


def vae_geometry(config: Mapping[str, Any], path: Path) -> VaeGeometry:
    """The geometry a diffusers VAE config (``config.json`` as a mapping) describes."""
    name = config.get("_class_name")
    if name not in VAE_CLASSES:
        raise EncoderError(f"{path} holds a {name}; the video encoders read {' or '.join(VAE_CLASSES)}")
    if name == "AutoencoderKLWan":
        downsample = config["temperal_downsample"]
        return VaeGeometry(name, 2 ** len(downsample), 2 ** sum(downsample), config["z_dim"])
    return VaeGeometry(name, 2 ** (len(config["block_out_channels"]) - 1), 1, config["latent_channels"])


def read_config(path: Path, what: str) -> dict[str, Any]:
    """``path/config.json``; EncoderError naming ``what`` the folder should be."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise EncoderError(f"{path} is not {what} (no readable config.json: {error})") from None


def read_vae_geometry(path: Path) -> VaeGeometry:
    config = read_config(path, "a diffusers VAE folder")
    try:
        return vae_geometry(config, path)
    except KeyError as error:
        raise EncoderError(f"{path}/config.json lacks {error}; save the VAE with save_pretrained") from None


def text_encoder_width(path: Path) -> int:
    """The text states' width (``d_model``) of a transformers encoder folder."""
    config = read_config(path, "a transformers text-encoder folder")
    if "d_model" not in config:
        raise EncoderError(f"{path}/config.json has no d_model; the video encoders read a T5-family encoder "
                           "(UMT5EncoderModel, data/build_text_encoder.py)")
    return config["d_model"]


@dataclass
class LatentEncoder:
    """A frozen VAE and how its posterior mean is normalised: ``(mean - shift) * scaling``."""

    vae: Any
    """diffusers ``AutoencoderKL`` or ``AutoencoderKLWan``."""
    path: Path
    geometry: VaeGeometry
    shift: torch.Tensor
    """[C, 1, 1, 1] (or [1, 1, 1, 1])."""
    scaling: torch.Tensor

    def batch_key(self, clip: Clip) -> tuple[int, ...]:
        """Clips with equal keys are encoded in one batch."""
        frames, height, width, _ = clip.frames.shape
        return (frames, height, width) if self.geometry.whole_clip else (height, width)

    def check(self, clip: Clip) -> list[int]:
        """The clip's latent shape; EncoderError naming the clip when the VAE cannot encode it."""
        try:
            return self.geometry.latent_shape(*clip.frames.shape[:3])
        except EncoderError as error:
            raise EncoderError(f"clip {clip.key}: {error} (the VAE at {self.path})") from None

    @torch.no_grad()
    def encode(self, clips: list[Clip], batch_frames: int, first_frame_only: bool = False) -> list[torch.Tensor]:
        """Normalised latents [C, F', H', W'] of clips of one batch key, ``batch_frames`` frames per call.
        ``first_frame_only``: of each clip's first frame followed by zero frames (0 in [-1, 1]: the
        image-to-video condition latent, as diffusers' ``WanImageToVideoPipeline`` encodes it)."""
        device = next(self.vae.parameters()).device  # a sampler's VAE may sit on the GPU
        pixels = [torch.from_numpy(c.frames).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1
                  for c in clips]  # [F, 3, H, W]
        if first_frame_only:
            pixels = [torch.cat([p[:1], torch.zeros_like(p[1:])]) for p in pixels]
        if self.geometry.whole_clip:
            per_batch = max(1, batch_frames // pixels[0].shape[0])
            means = [self.vae.encode(torch.stack(pixels[i:i + per_batch]).transpose(1, 2)).latent_dist.mean
                     for i in range(0, len(pixels), per_batch)]
            latents = list(torch.cat(means).unbind(0))
        else:
            frames = torch.cat(pixels)
            means = torch.cat([self.vae.encode(frames[i:i + batch_frames]).latent_dist.mean
                               for i in range(0, frames.shape[0], batch_frames)])
            latents = [m.transpose(0, 1) for m in means.split([p.shape[0] for p in pixels])]
        return [((z.cpu() - self.shift) * self.scaling).contiguous() for z in latents]

    def describe(self) -> dict:
        """The latent manifest's ``vae`` entry (factors as the config states them, not rounded to float32)."""
        config = self.vae.config
        if self.geometry.whole_clip:
            scaling, shift = [1 / std for std in config.latents_std], list(config.latents_mean)
        else:
            scaling, shift = config.scaling_factor, config.shift_factor or 0.0
        return {"path": str(self.path), "class": self.geometry.class_name, "scaling_factor": scaling,
                "shift_factor": shift, "spatial_factor": self.geometry.spatial_factor,
                "temporal_factor": self.geometry.temporal_factor}


def load_vae(path: Path) -> LatentEncoder:
    """The frozen VAE of a diffusers folder (eval mode) with its normalisation."""
    import diffusers

    geometry = read_vae_geometry(path)
    vae = getattr(diffusers, geometry.class_name).from_pretrained(path).eval().requires_grad_(False)
    config = vae.config
    if geometry.whole_clip:
        shift = torch.tensor(config.latents_mean, dtype=torch.float32)
        scaling = 1 / torch.tensor(config.latents_std, dtype=torch.float32)
        if shift.numel() != config.z_dim or scaling.numel() != config.z_dim:
            raise EncoderError(f"{path}: latents_mean/latents_std need z_dim = {config.z_dim} values")
    else:
        shift = torch.tensor([config.shift_factor or 0.0])
        scaling = torch.tensor([config.scaling_factor])
    return LatentEncoder(vae, Path(path), geometry, shift.view(-1, 1, 1, 1), scaling.view(-1, 1, 1, 1))


@dataclass
class TextEncoder:
    """A frozen transformers text encoder and its tokenizer (one folder)."""

    tokenizer: Any
    encoder: Any
    path: Path

    @torch.no_grad()
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        """The last hidden states [L, text_dim] of each caption's real tokens."""
        batch = self.tokenizer(captions, padding=True, return_tensors="pt")
        lengths = batch["attention_mask"].sum(1)
        for caption, ids, length in zip(captions, batch["input_ids"], lengths.tolist()):  # ints: umT5 gives 1e30
            if length > self.tokenizer.model_max_length or self.tokenizer.unk_token_id in ids.tolist():
                raise EncoderError(f"caption {caption!r} has unknown words or over {self.tokenizer.model_max_length} "
                                   f"tokens for the tokenizer at {self.path}; rebuild it from these captions "
                                   "(data/build_text_encoder.py)")
        states = self.encoder(**batch).last_hidden_state
        return [s[:n].contiguous() for s, n in zip(states, lengths.tolist())]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")


def load_text_encoder(path: Path) -> TextEncoder:
    """The frozen ``UMT5EncoderModel`` (Wan's text-encoder family) and tokenizer of a folder."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    text_encoder_width(path)  # a clear error for a folder that is not an encoder
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise EncoderError(f"{path} has an encoder but no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save "
                           "the tokenizer beside the model (a diffusers Wan folder keeps it in tokenizer/; copy "
                           "its files into the text-encoder folder)")
    encoder = UMT5EncoderModel.from_pretrained(path).eval().requires_grad_(False)
    return TextEncoder(AutoTokenizer.from_pretrained(path), encoder, Path(path))


@dataclass
class ImageEncoder:
    """A frozen transformers ``CLIPVisionModel`` and its image processor (one folder): the first
    frame's image states of an image-to-video model, as Wan2.1 I2V takes them (the penultimate
    layer's hidden states, class token and patches)."""

    processor: Any
    encoder: Any
    path: Path

    @torch.no_grad()
    def encode(self, frames: list[Any]) -> list[torch.Tensor]:
        """uint8 [H, W, 3] frames -> [L, hidden_size] states each."""
        pixels = self.processor(images=list(frames), return_tensors="pt")["pixel_values"].to(self.encoder.device)
        states = self.encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        return [s.float().cpu().contiguous() for s in states]


def image_encoder_width(path: Path) -> int:
    """The image states' width (``hidden_size``) of a transformers ``CLIPVisionModel`` folder."""
    config = read_config(path, "a transformers CLIPVisionModel folder")
    if "hidden_size" not in config:
        raise EncoderError(f"{path}/config.json has no hidden_size; the image states come from a CLIPVisionModel "
                           "(save_pretrained of transformers.CLIPVisionModel)")
    return config["hidden_size"]


def load_image_encoder(path: Path) -> ImageEncoder:
    """The frozen ``CLIPVisionModel`` and ``CLIPImageProcessor`` of a local folder (nothing downloads)."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    image_encoder_width(path)  # a clear error for a folder that is not one
    if not (Path(path) / "preprocessor_config.json").is_file():
        raise EncoderError(f"{path} has no preprocessor_config.json: save the CLIPImageProcessor beside the model "
                           "(processor.save_pretrained(folder))")
    encoder = CLIPVisionModel.from_pretrained(path).eval().requires_grad_(False)
    return ImageEncoder(CLIPImageProcessor.from_pretrained(path), encoder, Path(path))
