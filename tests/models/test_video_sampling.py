"""Video sampling: the samplers against velocity / noise fields known in closed form, the VAE
decoding against diffusers, determinism by seed, the files written, EMA weights preferred."""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from diffusers import AutoencoderKL, DDPMScheduler
from PIL import Image
from torch import nn

from models.dit.sample import SampleSettings, write_samples
from models.dit.text_to_video import LatentFormat, VideoPipeline, ddim_scheduler
from models.dit.validation import validation_writer
from tests.video_utils import StandInConfig, WanStandIn, build_latent_split
from veomni.checkpoint.export import load_run_weights
from veomni.checkpoint.manager import COMPLETE_MARKER
from veomni.tasks.flow import DiffusionTask

PROMPT = "a red circle moves left"


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Path:
    return build_latent_split(tmp_path_factory.mktemp("video"))


class AnalyticField(nn.Module):
    """The exact prediction for data that is a constant: ``conditional`` when the text is not all
    zero, ``unconditional`` otherwise. Flow: ``v = (x - x0) / t`` (from ``x_t = (1-t) x0 + t ε``);
    DDPM: ``ε = (x - sqrt(ā_k) x0) / sqrt(1 - ā_k)``. Records every timestep it is given."""

    def __init__(self, conditional: float, unconditional: float, alphas_cumprod: torch.Tensor | None = None):
        super().__init__()
        self.targets = (conditional, unconditional)
        self.alphas_cumprod = alphas_cumprod
        self.timesteps: list[torch.Tensor] = []

    def forward_video(self, latents, timestep, encoder_hidden_states):
        self.timesteps.append(timestep.clone())
        x0 = self.targets[1] if bool((encoder_hidden_states == 0).all()) else self.targets[0]
        if self.alphas_cumprod is None:
            return (latents - x0) / (timestep / 1000).view(-1, 1, 1, 1, 1)
        alpha_bar = self.alphas_cumprod[timestep.long()].float().view(-1, 1, 1, 1, 1)
        return (latents - alpha_bar.sqrt() * x0) / (1 - alpha_bar).sqrt()


def _pipeline(model, task, split) -> VideoPipeline:
    return VideoPipeline.from_latent_manifest(model, task, StandInConfig().patch_size, split)


def test_euler_flow_reaches_the_data_of_an_exact_velocity_field_on_the_shifted_schedule(split):
    model = AnalyticField(conditional=0.7, unconditional=0.0)
    task = DiffusionTask(shift=3.0, shift_base_tokens=20)
    latents = _pipeline(model, task, split).sample_latents([PROMPT], frames=5, height=32, width=32, steps=6,
                                                           guidance=1.0)
    assert latents.shape == (1, 4, 5, 8, 8)
    torch.testing.assert_close(latents, torch.full_like(latents, 0.7), atol=1e-5, rtol=0)
    # 5 x 8 x 8 latents in (1, 2, 2) patches: 80 tokens, so the shift is 3 sqrt(80 / 20) = 6.
    t = torch.linspace(1, 0, 7, dtype=torch.float64)[:-1]
    expected = 1000 * 6 * t / (1 + 5 * t)
    torch.testing.assert_close(torch.cat(model.timesteps).double(), expected, atol=1e-3, rtol=0)


def test_guidance_extrapolates_from_the_unconditional_to_the_conditional_prediction(split):
    model = AnalyticField(conditional=0.5, unconditional=-0.25)
    latents = _pipeline(model, DiffusionTask(), split).sample_latents([PROMPT], 1, 16, 16, steps=4, guidance=4.0)
    # u + g (c - u) with the exact fields: -0.25 + 4 * 0.75.
    torch.testing.assert_close(latents, torch.full_like(latents, 2.75), atol=1e-4, rtol=0)
    assert len(model.timesteps) == 8  # a conditional and an unconditional call per step


def test_ddim_uses_the_tasks_noise_schedule_and_reaches_the_data_of_an_exact_noise_field(split):
    task = DiffusionTask(objective="ddpm")
    reference = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2").alphas_cumprod
    torch.testing.assert_close(ddim_scheduler(task).alphas_cumprod.double(), reference.double(), atol=1e-6, rtol=0)
    model = AnalyticField(conditional=-0.4, unconditional=0.0, alphas_cumprod=task.alphas_cumprod)
    latents = _pipeline(model, task, split).sample_latents([PROMPT], 1, 16, 16, steps=5, guidance=1.0)
    torch.testing.assert_close(latents, torch.full_like(latents, -0.4), atol=1e-4, rtol=0)
    steps = torch.cat(model.timesteps)
    # integer steps, spaced like Stable Diffusion's DDIM (leading, offset 1): 1000 // 5 apart from 801
    assert steps.tolist() == [801, 601, 401, 201, 1]


def test_decoding_undoes_the_latent_normalisation_frame_by_frame(split):
    pipeline = _pipeline(WanStandIn(), DiffusionTask(), split)
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    pixels = pipeline.decode(latents)
    assert pixels.shape == (2, 3, 16, 16, 3) and pixels.dtype == np.uint8
    vae = AutoencoderKL.from_pretrained(split / "../../vae")
    with torch.no_grad():
        frame = vae.decode(latents[1, :, 2][None] / 1.5 + 0.1).sample[0]  # clip 1, frame 2
    expected = ((frame.clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy()
    assert np.abs(pixels[1, 2].astype(float) - expected).max() <= 1


def test_a_seed_fixes_the_sample_whatever_else_is_in_the_batch(split):
    torch.manual_seed(0)
    pipeline = _pipeline(WanStandIn(), DiffusionTask(shift=2.0), split)
    args = dict(frames=3, height=16, width=16, steps=3, guidance=3.0)
    pair = pipeline.sample_latents([PROMPT, "a blue square"], seed=5, **args)
    alone = pipeline.sample_latents([PROMPT], seed=5, **args)
    torch.testing.assert_close(pair[:1], alone, atol=1e-5, rtol=0)
    assert torch.equal(pipeline.sample_latents([PROMPT], seed=5, **args), alone)
    assert (pipeline.sample_latents([PROMPT], seed=6, **args) - alone).abs().max() > 1e-2


def test_samples_are_written_as_gifs_and_a_captioned_contact_sheet(split, tmp_path):
    pipeline = _pipeline(WanStandIn(), DiffusionTask(), split)
    prompts = [PROMPT, "a green triangle moves up quickly"]
    gifs, sheet, clips = write_samples(pipeline, prompts, SampleSettings(frames=5, height=16, width=24, steps=2),
                                       tmp_path)
    assert clips.shape == (2, 5, 16, 24, 3)
    for gif in gifs:
        with Image.open(gif) as image:
            assert image.n_frames == 5 and image.size == (24 * 4, 16 * 4)
    with Image.open(sheet) as image:
        assert image.width >= 5 * 24 * 2 and image.height >= 2 * 16 * 2
        top_left_frame = np.asarray(image.convert("RGB"))[4 + 14 : 4 + 14 + 32, 4 : 4 + 48]
    assert np.array_equal(top_left_frame, clips[0, 0].repeat(2, 0).repeat(2, 1))


def _eval_split(folder: Path, captions: list[tuple[str, int, int, int]]) -> Path:
    folder.mkdir(parents=True)
    with tarfile.open(folder / "shard-000000.tar", "w") as tar:
        for i, (caption, frames, height, width) in enumerate(captions):
            data = json.dumps({"caption": caption, "frames": frames, "height": height, "width": width}).encode()
            info = tarfile.TarInfo(f"{i:06d}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder


def test_validation_writer_samples_on_every_call_and_writes_only_when_asked(split, tmp_path):
    held_out = _eval_split(tmp_path / "eval", [(PROMPT, 5, 16, 16), (PROMPT, 5, 16, 16),
                                              ("a blue square", 1, 16, 24), ("a small circle", 5, 16, 16)])
    data = SimpleNamespace(train_path=str(split), eval_path=str(held_out))
    writer = validation_writer(StandInConfig(), data, count=2, settings=SampleSettings(steps=2),
                               task=DiffusionTask())
    model = WanStandIn()
    assert writer(model, 10, tmp_path / "samples", False) == {}
    assert not (tmp_path / "samples").exists()
    written = writer(model, 20, tmp_path / "samples", True)
    assert written == {"contact_sheet": tmp_path / "samples" / "samples_step_00000020.png"}
    with Image.open(written["contact_sheet"]) as sheet:
        assert sheet.height >= 2 * 16 * 2  # two distinct captions: two rows


def _write_checkpoint(run_dir: Path, model: nn.Module, ema: dict[str, torch.Tensor]) -> None:
    (run_dir / "config.yaml").write_text(
        "model:\n  arch: llm\n  vocab_size: 64\n  hidden_size: 16\n  intermediate_size: 32\n  num_layers: 1\n"
        "  num_heads: 2\n  num_kv_heads: 1\n  head_dim: 8\n  max_position_embeddings: 1024\n")
    step = run_dir / "checkpoints" / "step_00000004"
    dcp.save({"model": model.state_dict(), "app": {"step": 4, "ema": ema}}, checkpoint_id=str(step))
    (step / COMPLETE_MARKER).write_text(json.dumps({"step": 4}))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sampling_loads_the_ema_weights_of_the_newest_checkpoint(tmp_path):
    from veomni.contract import build_model

    _, model = build_model("llm", dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                                       num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=1024))
    name = next(n for n, p in model.named_parameters() if p.dim() == 2)
    ema = {name: torch.full_like(model.state_dict()[name], math.pi)}
    _write_checkpoint(tmp_path, model, ema)
    *_, weights, checkpoint = load_run_weights(tmp_path)
    assert checkpoint.name == "step_00000004"
    assert torch.equal(weights[name], ema[name])
    others = [n for n in weights if n != name]
    assert all(torch.equal(weights[n], model.state_dict()[n]) for n in others)
    *_, trained, _ = load_run_weights(tmp_path, prefer_ema=False)
    assert torch.equal(trained[name], model.state_dict()[name])


def test_per_channel_normalisation_of_a_wan_vae_is_undone_channel_by_channel():
    latents = LatentFormat(channels=2, scaling_factor=(2.0, 0.5), shift_factor=(1.0, -1.0), spatial_factor=8,
                           temporal_factor=4)
    stored = torch.ones(1, 2, 3, 4, 4)
    z = latents.denormalise(stored)
    assert torch.equal(z[:, 0], torch.full_like(z[:, 0], 1.5)) and torch.equal(z[:, 1], torch.ones_like(z[:, 1]))
    assert latents.latent_shape(frames=9, height=32, width=48) == (2, 3, 4, 6)
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4"):
        latents.latent_shape(frames=8, height=32, width=48)


def test_a_prompt_with_words_the_tokenizer_does_not_know_is_refused(split):
    with pytest.raises(ValueError, match="'a purple circle' has words"):
        _pipeline(WanStandIn(), DiffusionTask(), split).encode_prompts(["a purple circle"])
