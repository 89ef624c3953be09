"""Our ViT against Hugging Face's Qwen2-VL vision tower built from config with random weights.

Qwen2-VL's tower has the same structure as ours with ``merge_mode="concat"``: native
resolution, merge-group-major patch order, axial 2D RoPE, per-frame attention segments,
LayerNorm + concat of 2x2 neighbours + 2-layer MLP. Two differences are mapped exactly for
still images: its Conv3d patch embedding spans 2 identical frames (so our per-frame weight is
the sum over its temporal kernel) and its merger names (``ln_q``, ``mlp.0``, ``mlp.2``).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

from models.vit import NativeResolutionViT, ViTConfig

GRIDS = [(1, 4, 4), (1, 2, 6), (1, 8, 2), (1, 2, 2)]
TEMPORAL = 2
MERGER_NAMES = {
    "merger.ln_q.": "merger.norm.",
    "merger.mlp.0.": "merger.fc1.",
    "merger.mlp.2.": "merger.fc2.",
}


def _state_dict_from_qwen(hf_sd: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in hf_sd.items():
        if name == "patch_embed.proj.weight":  # [d, C, T, p, p] on T identical frames
            out["patch_embed.weight"] = value.sum(dim=2).reshape(hidden, -1)
            continue
        for old, new in MERGER_NAMES.items():
            name = name.replace(old, new)
        out[name] = value
    return out


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
    ours = NativeResolutionViT(cfg)
    ours.load_state_dict(_state_dict_from_qwen(reference.state_dict(), cfg.hidden_size), strict=True)

    gen = torch.Generator().manual_seed(1)
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), cfg.patch_dim, generator=gen)
    grid = torch.tensor(GRIDS)
    # Qwen2-VL's processor repeats a still image over the temporal kernel: [N, C, T, p, p]
    hf_pixels = patches.view(-1, 3, 1, 4, 4).expand(-1, 3, TEMPORAL, 4, 4).reshape(patches.shape[0], -1)
    with torch.no_grad():
        want = reference(hf_pixels, grid_thw=grid).pooler_output
        got = ours(patches, grid)
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 24)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
