"""The latent precompute's image-to-video data: each clip's ``condition`` equals the frame mask and
the latent diffusers' VAE gives the first frame followed by zero frames (as ``WanImageToVideoPipeline``
encodes its condition), and its ``image`` equals a transformers ``CLIPVisionModel``'s penultimate
states of the first frame (both built here from config with random weights, loaded from folders)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from models.dit.conditioning import wan_i2v_condition
from veomni.data.builders import load_script
from veomni.data.video.clip_format import Clip
from veomni.data.video.encoders import EncoderError, load_image_encoder, load_vae

DATA = Path(__file__).resolve().parents[2] / "data"


class Captions:
    """A stand-in text encoder: the precompute only asks it for states per caption."""

    def encode(self, captions):
        return [torch.zeros(2, 3) for _ in captions]


def _clips(frames: int) -> list[Clip]:
    rng = np.random.default_rng(0)
    return [Clip(f"clip{i}", rng.integers(0, 256, (frames, 16, 16, 3), dtype=np.uint8), {"caption": "a"})
            for i in range(2)]


@pytest.fixture(scope="module")
def image_encoder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=16, patch_size=8)).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["kl", pytest.param("wan", marks=pytest.mark.full)])  # Wan's VAE: ~15 s
def test_condition_is_the_mask_and_the_first_frame_latent_before_zero_frames(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "kl":
        vae = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                            scaling_factor=0.7, shift_factor=0.1)
        mask_channels, frames = 1, 3
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                               latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
        mask_channels, frames = 2, 5
    vae.save_pretrained(tmp_path / "vae")
    encoder = load_vae(tmp_path / "vae")
    builder = load_script(DATA / "build_video_latents.py")
    clips = _clips(frames)
    out = builder.encode_buffer(clips, builder.Encoders(encoder, Captions(), condition=True), batch_frames=8)
    assert builder.channels_of(encoder) == mask_channels + 4
    for clip, tensors in out:
        pixels = torch.from_numpy(clip.frames).permute(3, 0, 1, 2).float() / 127.5 - 1  # [3, F, H, W]
        pixels[:, 1:] = 0  # the pipeline's video_condition: the image, then zeros
        with torch.no_grad():
            if kind == "kl":
                mean = vae.encode(pixels.transpose(0, 1)).latent_dist.mean.transpose(0, 1)
                latent = (mean - 0.1) * 0.7
            else:
                mean = vae.encode(pixels[None]).latent_dist.mean[0]
                latent = (mean - torch.tensor([0.1, -0.2, 0.3, 0.0]).view(4, 1, 1, 1)) / torch.tensor(
                    [1.5, 0.5, 2.0, 1.0]).view(4, 1, 1, 1)
        expected = wan_i2v_condition(latent, mask_channels)
        assert tensors["condition"].shape == (mask_channels + 4, *tensors["latent"].shape[1:])
        torch.testing.assert_close(tensors["condition"], expected, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(tensors["condition"][mask_channels:], tensors["latent"], atol=1e-2)


def test_image_states_are_the_clip_vision_models_penultimate_states_of_the_first_frame(tmp_path, image_encoder):
    vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4)
    vae.save_pretrained(tmp_path / "vae")
    builder = load_script(DATA / "build_video_latents.py")
    clips = _clips(3)
    encoders = builder.Encoders(load_vae(tmp_path / "vae"), Captions(), image=load_image_encoder(image_encoder))
    out = builder.encode_buffer(clips, encoders, batch_frames=8)
    model, processor = CLIPVisionModel.from_pretrained(image_encoder), CLIPImageProcessor.from_pretrained(image_encoder)
    for clip, tensors in out:
        assert "condition" not in tensors
        with torch.no_grad():
            pixels = processor(images=clip.frames[0], return_tensors="pt")["pixel_values"]
            expected = model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][0]
        assert tensors["image"].shape == (5, 24)  # the class token and 2 x 2 patches, hidden_size 24
        torch.testing.assert_close(tensors["image"], expected, atol=1e-5, rtol=1e-5)
        other = processor(images=clip.frames[1], return_tensors="pt")["pixel_values"]
        assert not torch.allclose(tensors["image"], model(pixel_values=other, output_hidden_states=True)
                                  .hidden_states[-2][0], atol=1e-3)


def test_an_image_encoder_folder_without_its_processor_is_refused(tmp_path, image_encoder):
    CLIPVisionModel.from_pretrained(image_encoder).save_pretrained(tmp_path / "bare")
    with pytest.raises(EncoderError, match="no preprocessor_config.json"):
        load_image_encoder(tmp_path / "bare")
