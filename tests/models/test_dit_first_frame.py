"""First-frame conditioning without an image encoder (Wan2.2 TI2V style): the clean first-frame
tokens take timestep 0 exactly as diffusers' ``WanTransformer3DModel`` computes per-token
timesteps (its pipeline's ``expand_timesteps``), a packed row of conditioned and unconditioned
samples equals each alone, and the task keeps the first frame clean and out of the loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.dit import diffusion_task, hf_adapter
from models.dit.batch import pack_latents, unpack_tokens
from models.dit.config import DiTConfig
from models.dit.model import DiTModel
from tests.models.test_dit_hf import CONFIGS, diffusers_model, inputs_of, randomise
from tests.parity_utils import assert_parity, assert_scalar_parity


def _first_frame_tokens(batch: dict) -> torch.Tensor:
    return batch["positions"][:, 0] == 0


@pytest.mark.parametrize("name", ["patch-1x2x2", "i2v-patch-1x2x2"])
def test_clean_first_frame_tokens_take_timestep_zero_as_diffusers_per_token_timesteps(name):
    """diffusers' Wan pipeline with ``expand_timesteps`` passes timestep [B, tokens]: 0 on the
    first latent frame's tokens, t on the others; our model gets the per-sample t and ``clean``."""
    cfg = dataclasses.replace(CONFIGS[name], first_frame_probability=0.5)
    reference = diffusers_model(cfg)
    ours = DiTModel(cfg).eval()
    ours.load_state_dict(hf_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)
    latents, timestep, text, image = inputs_of(cfg)
    images = None if image is None else list(image)
    batch = pack_latents(list(latents), list(text), timestep, cfg.patch_size, images)
    batch["clean"] = _first_frame_tokens(batch)
    with torch.no_grad():
        out = torch.stack(unpack_tokens(ours(batch["latents"], batch), batch, cfg.patch_size))
        per_token = torch.where(batch["clean"], 0.0, timestep[batch["sample_index"]]).view(len(timestep), -1)
        expected = reference(latents, per_token, text, encoder_hidden_states_image=image).sample
        plain = reference(latents, timestep, text, encoder_hidden_states_image=image).sample
    assert_parity(out, expected, "out")
    assert not torch.allclose(expected[:, :, 0], plain[:, :, 0], atol=1e-3), "timestep 0 must change frame 0"


def test_a_row_of_conditioned_and_unconditioned_samples_equals_each_alone():
    cfg = dataclasses.replace(CONFIGS["patch-1x2x2"], first_frame_probability=0.5)
    torch.manual_seed(3)
    model = randomise(DiTModel(cfg))
    generator = torch.Generator().manual_seed(4)
    latents = [torch.randn(cfg.in_channels, *shape, generator=generator) for shape in ((3, 4, 2), (2, 2, 4), (1, 4, 4))]
    texts = [torch.randn(n, cfg.text_dim, generator=generator) for n in (2, 5, 3)]
    timesteps = torch.tensor([300.0, 720.0, 55.0])
    conditioned = [True, False, True]

    def row(samples):
        batch = pack_latents([latents[i] for i in samples], [texts[i] for i in samples], timesteps[samples],
                             cfg.patch_size)
        first = torch.tensor([conditioned[i] for i in samples])[batch["sample_index"]]
        return {**batch, "clean": _first_frame_tokens(batch) & first}

    packed = row([0, 1, 2])
    with torch.no_grad():
        outputs = unpack_tokens(model(packed["latents"], packed), packed, cfg.patch_size)
        for i, out in enumerate(outputs):
            alone = row([i])
            assert_parity(out, unpack_tokens(model(alone["latents"], alone), alone, cfg.patch_size)[0], "out")


def _row(cfg: DiTConfig, shapes, seed: int = 5) -> dict:
    generator = torch.Generator().manual_seed(seed)
    latents = [torch.randn(cfg.out_channels, *shape, generator=generator) for shape in shapes]
    texts = [torch.randn(3, cfg.text_dim, generator=generator) for _ in shapes]
    batch = pack_latents(latents, texts, torch.zeros(len(shapes)), cfg.patch_size)
    return {key: value for key, value in batch.items() if key != "timesteps"}


def test_the_task_keeps_first_frames_clean_and_out_of_the_loss():
    cfg = dataclasses.replace(CONFIGS["patch-1x2x2"], in_channels=5, first_frame_probability=1.0, text_dropout=0.0)
    task = diffusion_task(cfg)
    batch = _row(cfg, [(3, 4, 4), (1, 4, 2), (2, 2, 4)])
    prepared = task.prepare(batch, torch.Generator().manual_seed(6))
    first = _first_frame_tokens(batch) & (batch["sample_index"] != 1)  # a one-frame sample is never conditioned
    assert torch.equal(prepared["clean"], first)
    assert torch.equal(prepared["noisy"][first], batch["latents"][first])
    assert not torch.equal(prepared["noisy"][~first], batch["latents"][~first])
    assert torch.equal(prepared["target"][first], torch.zeros_like(prepared["target"][first]))
    assert task.count_loss_units(prepared) == int((~first).sum())
    plain = diffusion_task(dataclasses.replace(cfg, first_frame_probability=0.0))
    unconditioned = plain.prepare(batch, torch.Generator().manual_seed(6))
    assert not unconditioned["clean"].any()
    assert torch.equal(unconditioned["noisy"][~first], prepared["noisy"][~first]), "same noise either way"

    torch.manual_seed(7)
    model = randomise(DiTModel(cfg))
    with torch.no_grad():
        loss = task(model, prepared)
        prediction = model(prepared["noisy"], prepared)
    expected = ((prediction - prepared["target"])[~first] ** 2).sum() / prediction.shape[1]
    assert loss.loss_units == int((~first).sum())
    assert_scalar_parity(float(loss.loss_sum), float(expected), "loss over the noisy tokens")


def test_first_frame_conditioning_needs_a_temporal_patch_of_one():
    with pytest.raises(ValueError, match=r"patch_size\[0\] == 1"):
        dataclasses.replace(CONFIGS["patch-2x2x1"], first_frame_probability=0.5).validate()
