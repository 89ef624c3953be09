"""Our ViT against Hugging Face's Qwen2-VL vision tower built from config with random weights.

Qwen2-VL's tower has the same structure as ours with ``merge_mode="concat"``: native
resolution, merge-group-major patch order, axial 2D RoPE, per-frame attention segments,
LayerNorm + concat of 2x2 neighbours + 2-layer MLP. The two differences (its Conv3d patch
embedding over 2 identical frames, its merger names) are mapped by ``models/vit/hf_adapter.py``,
the adapter ``checkpoint.init.encoders.image`` reads a vision-tower folder with.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

from models.vit import NativeResolutionViT, ViTConfig, hf_adapter
from tests.parity_utils import assert_parity

GRIDS = [(1, 4, 4), (1, 2, 6), (1, 8, 2), (1, 2, 2)]
TEMPORAL = 2


@pytest.mark.parametrize("hidden_act", ["gelu", "quick_gelu"])
def test_matches_qwen2_vl_vision_tower(hidden_act) -> None:
    torch.manual_seed(0)
    hf_config = Qwen2VLVisionConfig(
        depth=2,
        embed_dim=32,
        hidden_size=24,
        num_heads=4,
        mlp_ratio=2,
        hidden_act=hidden_act,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=TEMPORAL,
        in_channels=3,
    )
    hf_config._attn_implementation = "eager"
    reference = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(
        hf_config
    )
    reference.eval()
    with torch.no_grad():  # HF's init leaves LayerNorms at 1/0 and biases at 0: randomise everything
        for param in reference.parameters():
            param.normal_(0.0, 0.2)

    cfg = ViTConfig(
        patch_size=4,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        hidden_act=hidden_act,
        merge_mode="concat",
        out_hidden_size=24,
        rope_theta=10000.0,
        min_pixels=64,
        max_pixels=4096,
    )
    read = hf_adapter.config_from_hf(hf_config)
    for field in dataclasses.fields(cfg):
        if field.name not in hf_adapter.free_fields:
            assert getattr(read, field.name) == getattr(cfg, field.name), field.name
    ours = NativeResolutionViT(cfg)
    ours.load_state_dict(hf_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)

    gen = torch.Generator().manual_seed(1)
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, generator=gen)
    grid = torch.tensor(GRIDS)
    # Qwen2-VL's processor repeats a still image over the temporal kernel: [N, C, T, p, p]
    hf_pixels = patches.view(-1, 3, 1, 4, 4).expand(-1, 3, TEMPORAL, 4, 4).reshape(patches.shape[0], -1)
    with torch.no_grad():
        want = reference(hf_pixels, grid_thw=grid).pooler_output
        got = ours(patches, grid)
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 24)
    assert_parity(got, want, "got")

    exported_config = hf_adapter.config_to_hf(cfg)  # and back: our weights in a tower of HF's
    exported_config._attn_implementation = "eager"
    exported = transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(
        exported_config
    )
    exported.load_state_dict(hf_adapter.state_dict_to_hf(ours.state_dict(), cfg), strict=True)
    with torch.no_grad():
        assert_parity(exported.eval()(hf_pixels, grid_thw=grid).pooler_output, want, "exported pooler output")


# Windows of 2x2 merged tokens (patch 4, merge 2, window 16 px): the 6x10 and 10x6 grids leave
# partial windows at their right and bottom edges, the video has two temporal patches.
WINDOW_GRIDS = [(1, 6, 10), (2, 4, 4), (1, 10, 6), (1, 2, 2)]


def test_matches_qwen2_5_vl_windowed_vision_tower() -> None:
    """RMSNorm, gated SiLU MLP, window attention with full attention on layer 1, the window
    reordering and its inverse, and 2-frame temporal patches fed as HF's ``pixel_values``."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    hf_config = Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=40, num_heads=4,
                                       out_hidden_size=24, patch_size=4, spatial_merge_size=2,
                                       temporal_patch_size=TEMPORAL, window_size=16, fullatt_block_indexes=[1])
    reference = Qwen2_5_VisionTransformerPretrainedModel(hf_config).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.2)
    cfg = hf_adapter.config_from_hf(hf_config, per_frame=False)
    assert (cfg.norm, cfg.mlp, cfg.window_size, cfg.full_attention_layers, cfg.temporal_patch_size) == (
        "rmsnorm", "gated", 16, (1,), TEMPORAL)
    ours = NativeResolutionViT(cfg).eval()
    ours.load_state_dict(hf_adapter.state_dict_from_hf(reference.state_dict(), cfg), strict=True)

    rows = sum(t * h * w for t, h, w in WINDOW_GRIDS)
    pixels = torch.randn(rows, cfg.patch_dim, generator=torch.Generator().manual_seed(1))
    grid = torch.tensor(WINDOW_GRIDS)
    with torch.no_grad():
        want = reference(pixels, grid_thw=grid).pooler_output
        got = ours(pixels, grid)
    assert_parity(got, want, "windowed tower")

    exported = Qwen2_5_VisionTransformerPretrainedModel(hf_adapter.config_to_hf(cfg)).eval()
    exported.load_state_dict(hf_adapter.state_dict_to_hf(ours.state_dict(), cfg), strict=True)
    with torch.no_grad():
        assert_parity(exported(pixels, grid_thw=grid).pooler_output, want, "exported windowed tower")
    # FLOPs count the windowed layers' pairs within windows: fewer than three full-frame layers.
    full = dataclasses.replace(cfg, window_size=0, full_attention_layers=())
    assert ours.training_flops(grid) < NativeResolutionViT(full).training_flops(grid)
