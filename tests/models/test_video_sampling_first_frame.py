"""Sampling from a first frame (``scripts/sample.sh --image``, Wan2.2 TI2V style): latent frame 0 is
held to the given frame's latent in every model call and in the result, the loop equals diffusers'
Wan pipeline loop with ``expand_timesteps`` (``FlowMatchEulerDiscreteScheduler``, per-token
timesteps 0 on the first frame) on ``WanTransformer3DModel``, and the frame's latent is the VAE's
posterior mean of the frame, normalised as the latent precompute stores it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
from PIL import Image
from torch import nn

from models.dit import diffusion_task, hf_adapter
from models.dit.config import DiTConfig
from models.dit.model import DiTModel
from models.dit.sample import main as sample_main
from models.dit.sample import read_first_frames
from models.dit.text_to_video import VideoPipeline
from tests.models.test_dit_hf import diffusers_model
from tests.parity_utils import assert_parity
from tests.video_utils import LATENT_CHANNELS, TEXT_DIM, build_latent_split

PROMPT = "a red circle moves left"
FIRST_FRAME_DIT = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                            in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=32,
                            ffn_dim=64, num_layers=2, first_frame_probability=0.5, shift=2.0, shift_base_tokens=16)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Path:
    return build_latent_split(tmp_path_factory.mktemp("video"))


class RecordingField(nn.Module):
    """The exact velocity toward a constant clip ``x0`` (``(x - x0) / t``), recording each call's
    first latent frame and whether it was told the frame is clean."""

    def __init__(self, x0: float) -> None:
        super().__init__()
        self.x0 = x0
        self.calls: list[tuple[torch.Tensor, bool]] = []

    def forward_video(self, latents, timestep, encoder_hidden_states, clean_first_frame=False):
        self.calls.append((latents[:, :, 0].clone(), clean_first_frame))
        return (latents - self.x0) / (timestep / 1000).view(-1, 1, 1, 1, 1)


def test_every_model_call_and_the_result_hold_the_given_first_frame(split):
    model = RecordingField(x0=0.7)
    pipeline = VideoPipeline.from_latent_manifest(model, diffusion_task(FIRST_FRAME_DIT), (1, 2, 2), split)
    first = torch.randn(2, LATENT_CHANNELS, 1, 4, 6, generator=torch.Generator().manual_seed(3))
    latents = pipeline.sample_latents([PROMPT, "a blue square moves up"], frames=5, height=16, width=24, steps=4,
                                      guidance=3.0, first_frames=first)
    assert len(model.calls) == 2 * 4  # conditional and unconditional, every step
    for frame, clean in model.calls:
        assert clean and torch.equal(frame, first[:, :, 0])
    assert torch.equal(latents[:, :, :1], first)
    torch.testing.assert_close(latents[:, :, 1:], torch.full_like(latents[:, :, 1:], 0.7), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="one per prompt"):
        pipeline.sample_latents([PROMPT], frames=5, height=16, width=24, steps=2, first_frames=first)


def test_the_loop_equals_diffusers_wan_pipeline_with_expand_timesteps(split):
    """diffusers' ``WanPipeline`` (``expand_timesteps``): the input is ``(1 - mask) condition + mask x``,
    timestep [B, tokens] with 0 on frame 0's tokens, CFG ``u + g (c - u)``, the scheduler's step on x,
    and the mask applied once more at the end; the scheduler walks our shifted sigmas."""
    reference = diffusers_model(FIRST_FRAME_DIT)
    ours = DiTModel(FIRST_FRAME_DIT).eval()
    ours.load_state_dict(hf_adapter.state_dict_from_hf(reference.state_dict(), FIRST_FRAME_DIT), strict=True)
    pipeline = VideoPipeline.from_latent_manifest(ours, diffusion_task(FIRST_FRAME_DIT), (1, 2, 2), split)
    first = torch.randn(1, LATENT_CHANNELS, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    steps, guidance, seed = 2, 2.5, 7
    with torch.no_grad():
        latents = pipeline.sample_latents([PROMPT], 5, 16, 16, steps, guidance, seed, first_frames=first)
        noise = torch.randn(1, LATENT_CHANNELS, 5, 4, 4, generator=torch.Generator().manual_seed(seed))
        text = pipeline.encode_prompts([PROMPT])[0][None]
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        scheduler.set_timesteps(sigmas=pipeline.flow_sigmas((LATENT_CHANNELS, 5, 4, 4), steps)[:-1].tolist())
        mask = torch.ones_like(noise)
        mask[:, :, 0] = 0
        condition = torch.cat([first, torch.zeros_like(noise[:, :, 1:])], dim=2)
        x = noise
        for t in scheduler.timesteps:
            model_input = (1 - mask) * condition + mask * x
            timestep = (mask[0, 0, :, ::2, ::2] * t).flatten()[None]
            cond = reference(model_input, timestep, text).sample
            uncond = reference(model_input, timestep, torch.zeros(1, 1, TEXT_DIM)).sample
            x = scheduler.step(uncond + guidance * (cond - uncond), t, x).prev_sample
        expected = (1 - mask) * condition + mask * x
    assert_parity(latents, expected, "first-frame sampling")


def test_the_first_frame_latent_is_the_vaes_normalised_posterior_mean(split):
    pipeline = VideoPipeline.from_latent_manifest(RecordingField(0.0), diffusion_task(FIRST_FRAME_DIT), (1, 2, 2),
                                                  split)
    frames = np.random.default_rng(0).integers(0, 256, (2, 16, 24, 3), dtype=np.uint8)
    vae = AutoencoderKL.from_pretrained(split / "../../vae")
    with torch.no_grad():
        mean = vae.encode(torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1).latent_dist.mean
    expected = ((mean - 0.1) * 1.5)[:, :, None]  # the split's shift_factor 0.1, scaling_factor 1.5
    torch.testing.assert_close(pipeline.encode_frames(frames), expected, atol=1e-5, rtol=1e-5)


def test_a_model_trained_without_first_frames_refuses_them():
    model = DiTModel(dataclasses.replace(FIRST_FRAME_DIT, first_frame_probability=0.0))
    with pytest.raises(ValueError, match="first_frame_probability"):
        model.forward_video(torch.zeros(1, LATENT_CHANNELS, 3, 4, 4), torch.tensor([500.0]),
                            torch.zeros(1, 2, TEXT_DIM), clean_first_frame=True)


def test_image_files_give_one_first_frame_per_prompt_and_the_clip_size(tmp_path, split):
    for name, size in (("a.png", (24, 16)), ("b.png", (24, 16)), ("c.png", (16, 16))):
        Image.new("RGB", size, (200, 10, 10)).save(tmp_path / name)
    frames = read_first_frames([tmp_path / "a.png"], prompts=3)
    assert frames.shape == (3, 16, 24, 3) and frames.dtype == np.uint8 and (frames[..., 0] == 200).all()
    assert read_first_frames([tmp_path / "a.png", tmp_path / "b.png"], prompts=2).shape == (2, 16, 24, 3)
    with pytest.raises(ValueError, match="one per prompt"):
        read_first_frames([tmp_path / "a.png", tmp_path / "b.png"], prompts=3)
    with pytest.raises(ValueError, match="differ in size"):
        read_first_frames([tmp_path / "a.png", tmp_path / "c.png"], prompts=2)
    t2v = dataclasses.replace(FIRST_FRAME_DIT, first_frame_probability=0.0)
    state = DiTModel(t2v).state_dict()
    run = type("Run", (), {"model": type("M", (), {"arch": "dit"}), "data": type("D", (), {"train_path": str(split)})})

    def load_weights(run_dir, checkpoint, prefer_ema):
        return run, t2v, state, tmp_path / "step_1"

    code = sample_main([str(tmp_path), "--prompt", PROMPT, "--image", str(tmp_path / "a.png")], load_weights)
    assert code == 2  # refused before sampling: trained without first frames
    assert sample_main([str(tmp_path), "--prompt", PROMPT, "--image", str(tmp_path / "a.png"), "--height", "32"],
                       load_weights) == 2
