"""Our DiT against diffusers' ``WanTransformer3DModel`` built from config with random weights, both
ways: diffusers weights imported into our model, and our export loaded by ``from_pretrained``;
text-to-video configs and Wan2.1 image-to-video ones (``image_dim``, ``added_kv_proj_dim``,
conditioning channels in ``in_channels``; the I2V-only checks are ``test_dit_i2v.py``'s)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from models.dit import hf_adapter
from models.dit.config import ARCHITECTURE_FIELDS, DiTConfig
from models.dit.model import DiTModel
from tests.parity_utils import assert_parity
from veomni.checkpoint.component_init import load_components
from veomni.checkpoint.hf_io import load_hf_pretrained, read_hf_config, save_hf_pretrained

CONFIGS = {
    # Wan's own patch, cross-attention norm on
    "patch-1x2x2": DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=3,
                             out_channels=5, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2),
    # non-cubic patch with a temporal extent (proj_out's row order is then visible), no cross-attention norm
    "patch-2x2x1": DiTConfig(patch_size=(2, 2, 1), num_attention_heads=3, attention_head_dim=12, in_channels=4,
                             out_channels=4, text_dim=16, freq_dim=16, ffn_dim=48, num_layers=2,
                             cross_attn_norm=False),
    # image-to-video: in_channels = noisy latent + 4 mask channels + condition latent (Wan: 16 + 4 + 16)
    "i2v-patch-1x2x2": DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                 in_channels=10, out_channels=3, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2,
                                 image_dim=20, added_kv_proj_dim=32),
    "i2v-patch-2x1x2": DiTConfig(patch_size=(2, 1, 2), num_attention_heads=3, attention_head_dim=8, in_channels=8,
                                 out_channels=2, text_dim=16, freq_dim=16, ffn_dim=40, num_layers=2, image_dim=12,
                                 added_kv_proj_dim=24, cross_attn_norm=False),
}
I2V_TEXT_LEN = 512  # diffusers' Wan attention splits image from text states by a hard-coded 512 text tokens


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight random, incl. zero biases and unit norms, so no mapping hides. Norm weights
    near 1 and wide linears: with norms near 0.1 the q/k norms make every attention near uniform,
    and the keys (the image branch's ``norm_added_k`` among them) would hardly change the output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.3)
            else:
                param.normal_(0.0, 0.3 if param.dim() == 2 else 0.1)
    return model.eval()


def diffusers_model(cfg: DiTConfig) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return randomise(WanTransformer3DModel(**{key: getattr(cfg, key) for key in ARCHITECTURE_FIELDS}))


def inputs_of(cfg: DiTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Latents, timesteps, text states and (image-to-video) image states of two samples."""
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, cfg.in_channels, 4, 6, 8, generator=generator)
    text = torch.randn(2, 7 if cfg.image_dim is None else I2V_TEXT_LEN, cfg.text_dim, generator=generator)
    image = None if cfg.image_dim is None else torch.randn(2, 5, cfg.image_dim, generator=generator)
    return latents, torch.tensor([37.0, 912.5]), text, image


def diffusers_output(model: WanTransformer3DModel, inputs) -> torch.Tensor:
    latents, timestep, text, image = inputs
    with torch.no_grad():
        return model(latents, timestep, text, encoder_hidden_states_image=image).sample


@pytest.mark.parametrize("name", list(CONFIGS))
def test_imported_weights_match_diffusers(name):
    cfg = CONFIGS[name]
    reference = diffusers_model(cfg)
    ours = DiTModel(cfg).eval()
    ours.load_state_dict(hf_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)
    inputs = inputs_of(cfg)
    with torch.no_grad():
        out = ours.forward_video(*inputs)
    expected = diffusers_output(reference, inputs)
    assert out.shape == expected.shape == (2, cfg.out_channels, 4, 6, 8)
    assert_parity(out, expected, "out")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_loads_in_diffusers_with_same_outputs(name, tmp_path):
    cfg = CONFIGS[name]
    torch.manual_seed(2)
    ours = randomise(DiTModel(cfg))
    folder = save_hf_pretrained("dit", cfg, ours.state_dict(), tmp_path / "wan")

    assert json.loads((folder / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    reloaded = WanTransformer3DModel.from_pretrained(folder).eval()
    inputs = inputs_of(cfg)
    with torch.no_grad():
        expected = ours.forward_video(*inputs)
    assert_parity(diffusers_output(reloaded, inputs), expected, "diffusers_output(reloaded, inputs)")

    arch, config, state_dict = load_hf_pretrained(folder)
    assert arch == "dit" and config == cfg
    for key, tensor in ours.state_dict().items():
        assert torch.equal(state_dict[key], tensor), key


def test_training_fields_are_free_and_folder_config_reads_back(tmp_path):
    cfg = CONFIGS["patch-1x2x2"]
    folder = save_hf_pretrained("dit", cfg, DiTModel(cfg).state_dict(), tmp_path / "wan")
    adapter, config = read_hf_config(folder)
    assert adapter is hf_adapter and config == cfg
    assert set(adapter.free_fields).isdisjoint(ARCHITECTURE_FIELDS)


def test_a_null_qk_norm_reads_as_wan_default():
    """diffusers' Wan attention normalises q and k across heads whatever ``qk_norm`` says, so a
    folder with ``qk_norm: null`` is the same model, not a refusal."""
    cfg = CONFIGS["patch-1x2x2"]
    assert hf_adapter.config_from_hf({**hf_adapter.config_to_hf(cfg), "qk_norm": None}) == cfg


def test_init_from_hf_loads_a_diffusers_saved_folder_and_refuses_another_architecture(tmp_path):
    cfg = CONFIGS["patch-2x2x1"]
    reference = diffusers_model(cfg)
    reference.save_pretrained(tmp_path / "wan")
    ours = DiTModel(dataclasses.replace(cfg, init_std=0.5, text_dropout=0.0)).eval()  # free fields may differ
    load_components(ours, {"": str(tmp_path / "wan")})
    inputs = inputs_of(cfg)
    with torch.no_grad():
        assert_parity(ours.forward_video(*inputs), diffusers_output(reference, inputs), "ours.forward_video(*inputs)")
    other = DiTModel(dataclasses.replace(cfg, ffn_dim=32))
    with pytest.raises(ValueError, match="ffn_dim"):
        load_components(other, {"": str(tmp_path / "wan")})
