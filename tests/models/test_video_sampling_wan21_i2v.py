"""Sampling the Wan2.1 image-to-video form (``scripts/sample.sh --image`` for a model with
``in_channels`` > ``out_channels`` and ``image_dim``) against diffusers' ``WanImageToVideoPipeline``:
the same tiny random model behind both loops, the pipeline building its own condition channels
(its VAE), image states (its ``CLIPVisionModel``), scheduler steps and guidance; every model call's
inputs and the result must agree. A manifest without its image encoder is refused naming the fix.
Validation samples of such a model start from the held-out cache's first-frame tensors."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from PIL import Image
from safetensors.torch import save
from torch import nn
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from models.dit import diffusion_task
from models.dit.config import DiTConfig
from models.dit.model import DiTModel
from models.dit.sample import SampleSettings
from models.dit.sample import main as sample_main
from models.dit.text_to_video import VideoPipeline
from models.dit.validation import validation_writer
from scripts.sample import load_conditioner
from tests.models.test_dit_hf import randomise
from tests.parity_utils import assert_parity
from tests.video_utils import LATENT_CHANNELS, TEXT_DIM, build_latent_split

PROMPT = "a red circle moves left"
MEAN, STD = [0.1, -0.2, 0.3, 0.0], [1.5, 0.5, 2.0, 1.0]
IMAGE_DIM = 24
# a Wan VAE (temporal factor 4): 4 noisy + 4 mask + 4 condition channels
WAN21_I2V = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12,
                      out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
                      image_dim=IMAGE_DIM, added_kv_proj_dim=32, shift=2.0, shift_base_tokens=16)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Path:
    """A latent split whose manifest names a tiny Wan VAE and a CLIPVisionModel folder, as
    ``data/build_video_latents.py --condition --image-encoder`` writes it."""
    root = tmp_path_factory.mktemp("wan21_i2v")
    split = build_latent_split(root)
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
                     temperal_downsample=[True, True], latents_mean=MEAN, latents_std=STD, scale_factor_spatial=4,
                     scale_factor_temporal=4).save_pretrained(root / "wan")
    CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, image_size=16, patch_size=8)).save_pretrained(root / "clip")
    CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(root / "clip")
    manifest = json.loads((split / "manifest.json").read_text())
    manifest.update(vae={"path": "../../wan", "class": "AutoencoderKLWan", "scaling_factor": [1 / s for s in STD],
                         "shift_factor": MEAN, "spatial_factor": 4, "temporal_factor": 4},
                    condition_channels=8, image_dim=IMAGE_DIM, image_encoder={"path": "../../clip"})
    (split / "manifest.json").write_text(json.dumps(manifest))
    return split


class OursRecorded(nn.Module):
    """Our DiT behind our sampler's call, recording every call's inputs."""

    def __init__(self, model: DiTModel) -> None:
        super().__init__()
        self.model, self.calls = model, []

    def forward_video(self, latents, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
        self.calls.append((latents, timestep, encoder_hidden_states, encoder_hidden_states_image))
        return self.model.forward_video(latents, timestep, encoder_hidden_states, encoder_hidden_states_image)


class DiffusersRecorded(nn.Module):
    """The same DiT behind the call ``WanImageToVideoPipeline`` makes of its transformer."""

    def __init__(self, model: DiTModel) -> None:
        super().__init__()
        self.model, self.calls = model, []
        self.config = SimpleNamespace(patch_size=model.config.patch_size, image_dim=model.config.image_dim)
        self.dtype, self.device = torch.float32, torch.device("cpu")

    def cache_context(self, name):
        return contextlib.nullcontext()

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image, attention_kwargs,
                return_dict):
        self.calls.append((hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image))
        return (self.model.forward_video(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image),)


def _pipeline(model: nn.Module, split: Path) -> VideoPipeline:
    """The sampling pipeline ``scripts/sample.sh`` builds: with the conditioner ``scripts/sample.py`` loads."""
    return VideoPipeline.from_latent_manifest(model, diffusion_task(WAN21_I2V), WAN21_I2V.patch_size, split,
                                              conditioner=load_conditioner(str(split), WAN21_I2V, "cpu"))


def test_sampling_from_an_image_equals_diffusers_wan_image_to_video_pipeline(split):
    torch.manual_seed(4)
    model = randomise(DiTModel(WAN21_I2V))
    ours = OursRecorded(model)
    pipeline = _pipeline(ours, split)
    sampled = []
    pipeline.decode = lambda latents: sampled.append(latents) or np.zeros(1)  # the loop's result, before the VAE
    frame = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    steps, guidance, seed = 2, 3.0, 7
    pipeline.generate([PROMPT], 9, 16, 16, steps, guidance, seed, first_frames=frame[None])

    reference = DiffusersRecorded(model)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    sigmas = pipeline.flow_sigmas((LATENT_CHANNELS, 3, 4, 4), steps)[:-1].tolist()
    set_timesteps = scheduler.set_timesteps
    scheduler.set_timesteps = lambda steps, device=None: set_timesteps(sigmas=sigmas, device=device)  # our schedule
    clip = split / "../../clip"
    vae = AutoencoderKLWan.from_pretrained(split / "../../wan")
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler,
                                   image_processor=CLIPImageProcessor.from_pretrained(clip),
                                   image_encoder=CLIPVisionModel.from_pretrained(clip), transformer=reference)
    with torch.no_grad():
        text = pipeline.encode_prompts([PROMPT])[0][None]
        noise = torch.randn(1, LATENT_CHANNELS, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        expected = pipe(image=Image.fromarray(frame), prompt_embeds=text,
                        negative_prompt_embeds=torch.zeros(1, 1, TEXT_DIM), height=16, width=16, num_frames=9,
                        num_inference_steps=steps, guidance_scale=guidance, latents=noise, output_type="latent",
                        return_dict=False)[0]
    assert len(ours.calls) == len(reference.calls) == 2 * steps  # both guidance branches, every step
    for i, (got, want) in enumerate(zip(ours.calls, reference.calls)):
        for name, a, b in zip(("latents + condition", "timestep", "text", "image states"), got, want):
            assert_parity(a, b.expand_as(a), f"call {i}: {name}")
    assert_parity(sampled[0], expected, "sampled latents")


def test_a_missing_image_encoder_is_refused_naming_the_fix(split, tmp_path):
    moved = tmp_path / "latents" / "train"
    shutil.copytree(split, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["vae"]["path"] = str((split / manifest["vae"]["path"]).resolve())
    manifest["text_encoder"]["path"] = str((split / manifest["text_encoder"]["path"]).resolve())
    (moved / "manifest.json").write_text(json.dumps(manifest))
    model = DiTModel(WAN21_I2V)
    with pytest.raises(FileNotFoundError, match=r"put the CLIPVisionModel folder .* --image-encoder"):
        _pipeline(model, moved)  # the folder "../../clip" is not beside the moved split
    (moved / "manifest.json").write_text(json.dumps({**manifest, "image_encoder": None}))
    with pytest.raises(FileNotFoundError, match="names no image encoder.*--image-encoder"):
        _pipeline(model, moved)


def test_sample_sh_writes_clips_from_an_image_and_needs_one(split, tmp_path):
    """``scripts/sample.py``'s path: the run's weights, its conditioner, an image file -> a GIF per prompt."""
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "f.png")
    run = SimpleNamespace(model=SimpleNamespace(arch="dit"), data=SimpleNamespace(train_path=str(split)))
    torch.manual_seed(4)
    state = randomise(DiTModel(WAN21_I2V)).state_dict()  # an untrained one predicts zero: one still frame

    def load_weights(run_dir, checkpoint, prefer_ema):
        return run, WAN21_I2V, state, tmp_path / "step_1"

    argv = [str(tmp_path), "--prompt", PROMPT, "--steps", "1"]
    assert sample_main(argv, load_weights, load_conditioner) == 2  # a conditioning-channel model needs --image
    assert sample_main([*argv, "--image", str(tmp_path / "f.png")], load_weights, load_conditioner) == 0
    with Image.open(tmp_path / "samples" / "step_1" / "sample_00.gif") as gif:
        assert gif.n_frames == 9


def _held_out_split(folder: Path, samples: list[tuple[str, dict[str, torch.Tensor]]]) -> Path:
    """A held-out latent split as the precompute writes it: ``KEY.json`` and ``KEY.latent.safetensors``."""
    folder.mkdir(parents=True)
    with tarfile.open(folder / "shard-000000.tar", "w") as tar:
        for i, (caption, tensors) in enumerate(samples):
            meta = json.dumps({"caption": caption, "frames": 9, "height": 16, "width": 16}).encode()
            for name, data in ((f"{i:06d}.json", meta), (f"{i:06d}.latent.safetensors", save(tensors))):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return folder


def test_validation_samples_start_from_the_held_out_first_frames_of_the_cache(split, tmp_path):
    """Each held-out caption is sampled from its own clip's cached condition channels and image
    states, in every model call (both guidance branches); a sample without them is refused by name."""
    generator = torch.Generator().manual_seed(9)

    def tensors(image_tokens: int) -> dict[str, torch.Tensor]:
        return {"latent": torch.randn(LATENT_CHANNELS, 3, 4, 4, generator=generator),
                "text": torch.randn(4, TEXT_DIM, generator=generator),
                "condition": torch.randn(8, 3, 4, 4, generator=generator),
                "image": torch.randn(image_tokens, IMAGE_DIM, generator=generator)}

    samples = [(PROMPT, tensors(5)), (PROMPT, tensors(5)), ("a blue square moves up", tensors(5))]
    held_out = _held_out_split(tmp_path / "eval", samples)
    data = SimpleNamespace(train_path=str(split), eval_path=str(held_out))
    writer = validation_writer(WAN21_I2V, data, count=2, settings=SampleSettings(steps=2))
    torch.manual_seed(4)
    model = OursRecorded(randomise(DiTModel(WAN21_I2V)))
    written = writer(model, 20, tmp_path / "samples", True)
    assert written["contact_sheet"].is_file()
    kept = [samples[0][1], samples[2][1]]  # the first clip of each distinct caption
    assert len(model.calls) == 2 * 2  # both captions in one batch (equal token counts): two steps, two branches
    for latents, _, _, image in model.calls:
        assert torch.equal(latents[:, LATENT_CHANNELS:], torch.stack([t["condition"] for t in kept]))
        assert torch.equal(image, torch.stack([t["image"] for t in kept]))
    del samples[0][1]["condition"]
    with pytest.raises(ValueError, match="held-out sample '000000'.*--condition"):
        validation_writer(WAN21_I2V, SimpleNamespace(train_path=str(split), eval_path=str(
            _held_out_split(tmp_path / "bad", samples))), count=2)
