"""Mapping between ``NativeResolutionViT`` and a Hugging Face Qwen2-VL vision tower
(``Qwen2VisionTransformerPretrainedModel`` with its ``Qwen2VLVisionConfig``, model_type
``qwen2_vl_vision``): what ``checkpoint.init.encoders.image`` reads.

Pure functions over configs and state dicts, no file IO. The two towers have the same structure
when ours has ``merge_mode="concat"``: native resolution, merge-group-major patch order, axial 2D
RoPE, per-frame attention, pre-norm LayerNorm blocks named alike, LayerNorm + concatenation of the
2x2 neighbours + 2-layer MLP. Two differences are mapped:

    patch_embed.weight [d, C*p*p]  <-> patch_embed.proj.weight [d, C, T, p, p]  (Conv3d over T frames)
    merger.norm / fc1 / fc2        <-> merger.ln_q / mlp.0 / mlp.2
    blocks.i.*                     <-> blocks.i.*

Qwen2-VL repeats a still image over its temporal kernel (T = 2), so our per-frame weight is the
sum over T: exact for images; a video's frames are embedded one by one here instead of T at a time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from .config import ViTConfig

hf_model_types = ("qwen2_vl_vision",)
# Input budgets and normalisation live in HF's preprocessor config, not in the tower's config.json.
free_fields = ("init_std", "min_pixels", "max_pixels", "image_mean", "image_std")

HF_NORM_EPS = 1e-6  # Qwen2-VL's vision LayerNorms hard-code it
TEMPORAL_PATCH_SIZE = 2  # Qwen2-VL's, written on export
_PATCH_EMBED = ("patch_embed.weight", "patch_embed.proj.weight")
_MERGER = (("merger.norm.", "merger.ln_q."), ("merger.fc1.", "merger.mlp.0."),
           ("merger.fc2.", "merger.mlp.2."))
_BLOCK = re.compile(r"blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)")


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def config_from_hf(hf_config: Any) -> ViTConfig:
    """``ViTConfig`` (concat merge) from a ``Qwen2VLVisionConfig`` or its ``config.json`` dict."""
    model_type = _get(hf_config, "model_type")
    if model_type not in hf_model_types:
        raise ValueError(f"HF model_type {model_type!r} is not one of {hf_model_types}")
    patch_size = _get(hf_config, "patch_size", 14)
    if not isinstance(patch_size, int):
        raise ValueError(f"only square patches are supported, got patch_size={patch_size!r}")
    embed_dim = _get(hf_config, "embed_dim")
    rope = _get(hf_config, "rope_parameters") or {}
    cfg = ViTConfig(
        patch_size=patch_size,
        in_channels=_get(hf_config, "in_channels", 3),
        hidden_size=embed_dim,
        num_layers=_get(hf_config, "depth"),
        num_heads=_get(hf_config, "num_heads"),
        intermediate_size=int(embed_dim * _get(hf_config, "mlp_ratio", 4)),
        hidden_act=_get(hf_config, "hidden_act", "quick_gelu"),
        merge_size=_get(hf_config, "spatial_merge_size", 2),
        merge_mode="concat",
        out_hidden_size=_get(hf_config, "hidden_size"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_eps=HF_NORM_EPS,
        init_std=_get(hf_config, "initializer_range", 0.02),
    )
    cfg.validate()
    return cfg


def config_to_hf(cfg: ViTConfig) -> Any:
    """The ``Qwen2VLVisionConfig`` describing the same tower; ValueError for what it cannot express."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    cfg.validate()
    needed = {
        "merge_mode": (cfg.merge_mode, "concat"),
        "adapter_hidden_size": (cfg.adapter_width, cfg.merged_dim),
        "norm_eps": (cfg.norm_eps, HF_NORM_EPS),
        "intermediate_size % hidden_size": (cfg.intermediate_size % cfg.hidden_size, 0),
    }
    for name, (value, want) in needed.items():
        if value != want:
            raise ValueError(f"{name}={value!r} cannot be expressed by a Qwen2-VL vision tower "
                             f"(needs {want!r})")
    return Qwen2VLVisionConfig(
        depth=cfg.num_layers,
        embed_dim=cfg.hidden_size,
        hidden_size=cfg.out_hidden_size,
        hidden_act=cfg.hidden_act,
        mlp_ratio=cfg.intermediate_size // cfg.hidden_size,
        num_heads=cfg.num_heads,
        in_channels=cfg.in_channels,
        patch_size=cfg.patch_size,
        spatial_merge_size=cfg.merge_size,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        initializer_range=cfg.init_std,
        rope_parameters={"rope_type": "axial", "rope_theta": cfg.rope_theta},
    )


def _rename(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for source, target in pairs:
        if name.startswith(source):
            return target + name[len(source):]
    if _BLOCK.fullmatch(name):
        return name
    raise KeyError(f"no Qwen2-VL vision mapping for parameter {name!r}")


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from the tower's; the Conv3d patch embedding summed over its temporal kernel."""
    ours, theirs = _PATCH_EMBED
    inverse = tuple((hf, our) for our, hf in _MERGER)
    sd = {_rename(name, inverse): tensor for name, tensor in hf_sd.items() if name != theirs}
    if theirs not in hf_sd:
        raise KeyError(f"the HF state dict has no {theirs}")
    sd[ours] = hf_sd[theirs].sum(dim=2).reshape(cfg.hidden_size, cfg.patch_dim)
    return sd


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """The tower's state dict of ours: the patch embedding spread evenly over the temporal kernel
    (so that a still image, repeated over it, gives our features)."""
    ours, theirs = _PATCH_EMBED
    out = {_rename(name, _MERGER): tensor for name, tensor in sd.items() if name != ours}
    per_frame = sd[ours].reshape(cfg.hidden_size, cfg.in_channels, 1, cfg.patch_size, cfg.patch_size)
    out[theirs] = (per_frame / TEMPORAL_PATCH_SIZE).expand(-1, -1, TEMPORAL_PATCH_SIZE, -1, -1).contiguous()
    return out
