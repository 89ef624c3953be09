"""Wan2.1 image-to-video in our DiT beyond the output parity both ways (``test_dit_hf.py`` runs its
two I2V configs): diffusers I2V folders through ``checkpoint.init_from_hf`` (a mismatched one
refused by field), the conditioning channels against ``WanImageToVideoPipeline``, a packed row of
text- and image-to-video samples against each sample alone, gradients, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models.dit import diffusion_task, hf_adapter
from models.dit.batch import pack_latents, unpack_tokens
from models.dit.conditioning import wan_i2v_condition
from models.dit.config import DiTConfig
from models.dit.cost import DiTCost, forward_flops
from models.dit.model import DiTModel
from tests.models.test_dit_hf import CONFIGS as HF_CONFIGS
from tests.models.test_dit_hf import diffusers_model, diffusers_output, inputs_of, randomise
from tests.parity_utils import assert_parity
from veomni.checkpoint.component_init import load_components
from veomni.ops.cost_probes import saved_bytes

CONFIGS = {name.removeprefix("i2v-"): cfg for name, cfg in HF_CONFIGS.items() if cfg.image_dim is not None}


def _random_ours(cfg: DiTConfig, seed: int = 2) -> DiTModel:
    torch.manual_seed(seed)
    return randomise(DiTModel(cfg))


def test_init_from_hf_loads_a_diffusers_i2v_folder_and_refuses_a_mismatched_one_by_field(tmp_path):
    cfg = CONFIGS["patch-2x1x2"]
    reference = diffusers_model(cfg)
    reference.save_pretrained(tmp_path / "wan")
    ours = DiTModel(dataclasses.replace(cfg, text_dropout=0.0)).eval()
    load_components(ours, {"": str(tmp_path / "wan")})
    inputs = inputs_of(cfg)
    with torch.no_grad():
        assert_parity(ours.forward_video(*inputs), diffusers_output(reference, inputs), "ours.forward_video")
    with pytest.raises(ValueError, match="image_dim"):
        load_components(DiTModel(dataclasses.replace(cfg, image_dim=10)), {"": str(tmp_path / "wan")})
    text_to_video = dataclasses.replace(cfg, image_dim=None, added_kv_proj_dim=None)
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        load_components(DiTModel(text_to_video), {"": str(tmp_path / "wan")})


def test_first_last_frame_wan_is_still_refused():
    config = {**hf_adapter.config_to_hf(CONFIGS["patch-1x2x2"]), "pos_embed_seq_len": 514}
    with pytest.raises(ValueError, match="pos_embed_seq_len=514"):
        hf_adapter.config_from_hf(config)


@pytest.mark.parametrize("change, field", [
    (dict(added_kv_proj_dim=None), "added_kv_proj_dim=None"),
    (dict(image_dim=None), "image_dim=None"),
    (dict(added_kv_proj_dim=16), "must equal the model width"),
    (dict(image_dim=0), "image_dim must be a positive int"),
])
def test_an_inconsistent_image_branch_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CONFIGS["patch-1x2x2"], **change).validate()


def test_condition_channels_equal_the_i2v_pipelines():
    """The pipeline's ``prepare_latents`` with a tiny random Wan VAE: its condition must be our
    frame mask followed by the normalised latent of the first frame with zero frames after it."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0],
                           scale_factor_spatial=4, scale_factor_temporal=4).eval()
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler())
    image = torch.rand(1, 3, 16, 12, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        _, condition = pipe.prepare_latents(image, 1, 4, 16, 12, 9, torch.float32, torch.device("cpu"),
                                            torch.Generator().manual_seed(4))
        video = torch.cat([image[:, :, None], image.new_zeros(1, 3, 8, 16, 12)], dim=2)
        mean = vae.encode(video).latent_dist.mean[0]
    stats = [torch.tensor(values).view(-1, 1, 1, 1) for values in (vae.config.latents_mean, vae.config.latents_std)]
    latent = (mean - stats[0]) / stats[1]
    assert condition.shape == (1, 8, 3, 4, 3)
    assert_parity(wan_i2v_condition(latent), condition[0], "wan_i2v_condition(latent)")


def test_packed_row_of_text_and_image_to_video_samples_equals_each_alone():
    """A text-to-video sample in an I2V model's row has zero image states (and zero condition
    channels); every sample must compute what it computes alone, padding included."""
    cfg = CONFIGS["patch-1x2x2"]
    model = _random_ours(cfg)
    generator = torch.Generator().manual_seed(5)
    latents = [torch.randn(cfg.in_channels, *shape, generator=generator) for shape in ((2, 4, 6), (1, 6, 4), (3, 2, 4))]
    latents[1][cfg.out_channels:] = 0  # the text-to-video sample
    texts = [torch.randn(n, cfg.text_dim, generator=generator) for n in (3, 6, 2)]
    images = [torch.randn(n, cfg.image_dim, generator=generator) for n in (4, 0, 7)]
    timesteps = torch.tensor([15.0, 400.0, 870.0])
    batch = pack_latents(latents, texts, timesteps, cfg.patch_size, images)
    with torch.no_grad():
        packed = unpack_tokens(model(batch["latents"], batch), batch, cfg.patch_size)
        for latent, text, image, t, out in zip(latents, texts, images, timesteps, packed):
            alone = model.forward_video(latent[None], t[None], text[None], image[None])[0]
            assert_parity(out, alone, "out")
        without_image = model.forward_video(latents[0][None], timesteps[:1], texts[0][None], images[0][None, :0])
    assert not torch.allclose(packed[0], without_image[0], atol=1e-3), "the image states must reach the output"


def test_gradients_reach_every_weight_of_the_image_branch():
    cfg = CONFIGS["patch-2x1x2"]
    model = _random_ours(cfg).train()
    latents, timestep, text, image = inputs_of(cfg)
    model.forward_video(latents, timestep, text[:, :4], image).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name


def test_a_row_without_image_states_or_condition_channels_is_refused():
    cfg = CONFIGS["patch-1x2x2"]
    model = _random_ours(cfg)
    latent, text = torch.randn(cfg.in_channels, 1, 2, 2), torch.randn(3, cfg.text_dim)
    batch = pack_latents([latent], [text], torch.tensor([5.0]), cfg.patch_size)
    with pytest.raises(ValueError, match="image_states"):
        model(batch["latents"], batch)
    batch = pack_latents([latent[:cfg.out_channels]], [text], torch.tensor([5.0]), cfg.patch_size,
                         [torch.randn(2, cfg.image_dim)])
    with pytest.raises(ValueError, match="condition"):
        model(batch["latents"], batch)


def test_the_task_appends_the_condition_tokens_to_the_noisy_ones_and_keeps_the_target():
    """``DiffusionTask.prepare`` on a row with ``condition`` draws the same noise as without it, gives
    the model [noisy | condition] per token (zero on padding) and the loss the plain target."""
    task = diffusion_task(CONFIGS["patch-1x2x2"])
    generator = torch.Generator().manual_seed(6)
    row = {"latents": torch.randn(7, 12, generator=generator), "sample_index": torch.tensor([0, 0, 0, 1, 1, -1, -1]),
           "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32), "text_states": torch.randn(4, 24),
           "text_cu_seqlens": torch.tensor([0, 2, 4], dtype=torch.int32)}
    condition = torch.randn(7, 28, generator=generator)
    plain = task.prepare(row, torch.Generator().manual_seed(7))
    conditioned = task.prepare({**row, "condition": condition}, torch.Generator().manual_seed(7))
    assert "condition" not in conditioned
    assert torch.equal(conditioned["noisy"][:, :12], plain["noisy"])
    assert torch.equal(conditioned["target"], plain["target"])
    assert torch.equal(conditioned["noisy"][:5, 12:], condition[:5])
    assert torch.equal(conditioned["noisy"][5:], torch.zeros(2, 40))


def test_cost_model_counts_the_matmuls_of_an_image_to_video_forward():
    """``forward_flops`` with image tokens against torch's FLOP counter on a real forward (SDPA's
    math backend, one sample per row); a packed row of an I2V and a T2V sample costs their sum."""
    cfg = CONFIGS["patch-1x2x2"]
    model = _random_ours(cfg)
    generator = torch.Generator().manual_seed(8)
    latents = [torch.randn(cfg.in_channels, 2, 4, 6, generator=generator) for _ in range(2)]
    texts = [torch.randn(n, cfg.text_dim, generator=generator) for n in (3, 5)]
    images = [torch.randn(n, cfg.image_dim, generator=generator) for n in (6, 0)]
    counted = []
    for latent, text, image in zip(latents, texts, images):
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
            model.forward_video(latent[None], torch.tensor([9.0]), text[None], image[None])
        counted.append(counter.get_total_flops())
        assert forward_flops(cfg, [12], [len(text)], [len(image)]) == counted[-1]
    batch = pack_latents(latents, texts, torch.tensor([9.0, 9.0]), cfg.patch_size, images)
    assert DiTCost().batch_flops(model, batch) == 3 * sum(counted)


def _block_bytes(cfg: DiTConfig, frames: int, image_tokens: int = 5) -> int:
    """Bytes autograd keeps for one block (two blocks minus one) on one sample of ``frames`` x 8 x 8
    latents (``frames`` x 16 patch tokens)."""
    kept = []
    for layers in (1, 2):
        model = _random_ours(dataclasses.replace(cfg, num_layers=layers))
        generator = torch.Generator().manual_seed(4)
        latent = torch.randn(cfg.in_channels, frames, 8, 8, generator=generator)
        text = torch.randn(6, cfg.text_dim, generator=generator)
        images = None if cfg.image_dim is None else [torch.randn(image_tokens, cfg.image_dim, generator=generator)]
        batch = pack_latents([latent], [text], torch.tensor([500.0]), cfg.patch_size, images)
        kept.append(saved_bytes(lambda model=model, batch=batch: model(batch["latents"], batch).pow(2).sum(),
                                list(model.parameters())))
    return kept[1] - kept[0]


def test_the_image_branch_keeps_what_the_cost_model_adds_per_patch_token():
    """Measured, not assumed: an image branch raises the bytes a block keeps per patch token (the
    slope between 32 and 64 tokens, so the per-image-token keys and values cancel) by what
    ``activation_bytes_per_unit`` adds, its attention output; on top of it this CPU attention keeps
    the image mask (a boolean per image token) and a logsumexp (fp32 per head), which a GPU's
    varlen kernel does not."""
    i2v = CONFIGS["patch-1x2x2"]
    t2v = dataclasses.replace(i2v, image_dim=None, added_kv_proj_dim=None)
    image_tokens = 5

    def slope(cfg: DiTConfig) -> float:
        return (_block_bytes(cfg, 4) - _block_bytes(cfg, 2)) / 32

    measured = slope(i2v) - slope(t2v)
    cost = DiTCost()
    modelled = (cost.activation_bytes_per_unit(_random_ours(i2v), 4, "none")
                - cost.activation_bytes_per_unit(_random_ours(t2v), 4, "none")) / i2v.num_layers
    assert modelled <= measured <= modelled + image_tokens + 4 * i2v.num_attention_heads, (measured, modelled)
