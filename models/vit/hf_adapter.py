"""Mapping between ``NativeResolutionViT`` and Hugging Face's Qwen2-VL and Qwen2.5-VL vision towers
(``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel``, model_type
``qwen2_vl_vision`` / ``qwen2_5_vl_vision``): what ``checkpoint.init.encoders.image`` reads, and
the vision half of the whole Qwen-VL adapter (``models/omni/qwen_vl_adapter.py``).

Pure functions over configs and state dicts, no file IO. The towers have our structure with
``merge_mode="concat"``: native resolution, merge-group-major patch order, axial 2D RoPE, per-frame
attention, pre-norm blocks named alike, norm + concatenation of the 2x2 neighbours + 2-layer MLP.
Qwen2-VL's blocks are LayerNorm + plain MLP; Qwen2.5-VL's are RMSNorm + gated MLP with window
attention (``norm``, ``mlp``, ``window_size``, ``full_attention_layers`` of ``ViTConfig``). Names:

    patch_embed.weight [d, C*T*p*p] <-> patch_embed.proj.weight [d, C, T', p, p]  (Conv3d over T' frames)
    merger.norm / fc1 / fc2         <-> merger.ln_q / mlp.0 / mlp.2
    blocks.i.*                      <-> blocks.i.*   (mlp.fc1/fc2 or mlp.gate_proj/up_proj/down_proj)

The patch embedding: with ``temporal_patch_size == T'`` (what ``config_from_hf(..., per_frame=False)``
gives, the whole Qwen-VL models) it is the same weight, reshaped: patches are HF's ``pixel_values``.
A stand-alone tower read for ``checkpoint.init.encoders.image`` gets ``temporal_patch_size=1``
(``per_frame=True``, the default): Qwen2-VL repeats a still image over its temporal kernel, so our
per-frame weight is the sum over T': exact for images; a video's frames are embedded one by one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from .config import ViTConfig

hf_model_types = ("qwen2_vl_vision", "qwen2_5_vl_vision")
# Input budgets and normalisation live in HF's preprocessor config, not in the tower's config.json.
free_fields = ("init_std", "min_pixels", "max_pixels", "image_mean", "image_std")

HF_NORM_EPS = 1e-6  # the towers' norms hard-code it
TEMPORAL_PATCH_SIZE = 2  # Qwen2-VL's, written on export of a per-frame tower
_PATCH_EMBED = ("patch_embed.weight", "patch_embed.proj.weight")
_MERGER = (("merger.norm.", "merger.ln_q."), ("merger.fc1.", "merger.mlp.0."),
           ("merger.fc2.", "merger.mlp.2."))
_BLOCK = re.compile(r"blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.(?:fc1|fc2|gate_proj|up_proj|down_proj))"
                    r"\.(weight|bias)")


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def config_from_hf(hf_config: Any, per_frame: bool = True) -> ViTConfig:
    """``ViTConfig`` (concat merge) from a Qwen2-VL / Qwen2.5-VL vision config or its dict.
    ``per_frame``: one frame per patch (module docstring); else HF's ``temporal_patch_size``."""
    model_type = _get(hf_config, "model_type")
    if model_type not in hf_model_types:
        raise ValueError(f"HF model_type {model_type!r} is not one of {hf_model_types}")
    patch_size = _get(hf_config, "patch_size", 14)
    temporal = _get(hf_config, "temporal_patch_size", TEMPORAL_PATCH_SIZE)
    if not isinstance(patch_size, int) or not isinstance(temporal, int):
        raise ValueError(f"only cubic patches are supported, got patch_size={patch_size!r}, "
                         f"temporal_patch_size={temporal!r}")
    rope = _get(hf_config, "rope_parameters") or {}
    common = dict(
        patch_size=patch_size,
        in_channels=_get(hf_config, "in_channels", 3),
        num_layers=_get(hf_config, "depth"),
        num_heads=_get(hf_config, "num_heads"),
        merge_size=_get(hf_config, "spatial_merge_size", 2),
        merge_mode="concat",
        temporal_patch_size=1 if per_frame else temporal,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_eps=HF_NORM_EPS,
        init_std=_get(hf_config, "initializer_range", 0.02),
    )
    if model_type == "qwen2_vl_vision":
        embed_dim = _get(hf_config, "embed_dim")
        cfg = ViTConfig(**common, hidden_size=embed_dim,
                        intermediate_size=int(embed_dim * _get(hf_config, "mlp_ratio", 4)),
                        hidden_act=_get(hf_config, "hidden_act", "quick_gelu"),
                        out_hidden_size=_get(hf_config, "hidden_size"))
    else:
        cfg = ViTConfig(**common, hidden_size=_get(hf_config, "hidden_size"),
                        intermediate_size=_get(hf_config, "intermediate_size"),
                        hidden_act=_get(hf_config, "hidden_act", "silu"),
                        out_hidden_size=_get(hf_config, "out_hidden_size"), norm="rmsnorm", mlp="gated",
                        window_size=_get(hf_config, "window_size", 112),
                        full_attention_layers=tuple(_get(hf_config, "fullatt_block_indexes", ())))
    cfg.validate()
    return cfg


def hf_model_type(cfg: ViTConfig) -> str:
    """The tower ``cfg`` exports to: Qwen2.5-VL's for RMSNorm + gated MLP, else Qwen2-VL's."""
    return "qwen2_5_vl_vision" if (cfg.norm, cfg.mlp) == ("rmsnorm", "gated") else "qwen2_vl_vision"


def config_to_hf(cfg: ViTConfig, per_frame: bool = True) -> Any:
    """The vision config describing the same tower; ValueError naming what neither tower expresses.
    ``per_frame``: a one-frame ``temporal_patch_size`` is a per-frame tower's (exported with
    Qwen2-VL's 2-frame kernel); else it is the folder's own and is written as it is (as
    ``config_from_hf(..., per_frame=False)`` read it)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    cfg.validate()
    qwen2_5 = hf_model_type(cfg) == "qwen2_5_vl_vision"
    needed = {
        "merge_mode": (cfg.merge_mode, "concat"),
        "adapter_hidden_size": (cfg.adapter_width, cfg.merged_dim),
        "norm_eps": (cfg.norm_eps, HF_NORM_EPS),
    }
    if not qwen2_5:
        needed.update({"(norm, mlp)": ((cfg.norm, cfg.mlp), ("layernorm", "plain")),
                       "window_size": (cfg.window_size, 0),
                       "intermediate_size % hidden_size": (cfg.intermediate_size % cfg.hidden_size, 0)})
    for name, (value, want) in needed.items():
        if value != want:
            raise ValueError(f"{name}={value!r} cannot be expressed by a Qwen2-VL vision tower, nor a Qwen2.5-VL one "
                             f"(RMSNorm + gated MLP) (needs {want!r})")
    common = dict(depth=cfg.num_layers, hidden_act=cfg.hidden_act, num_heads=cfg.num_heads,
                  in_channels=cfg.in_channels, patch_size=cfg.patch_size, spatial_merge_size=cfg.merge_size,
                  temporal_patch_size=_hf_temporal(cfg, per_frame), initializer_range=cfg.init_std,
                  rope_parameters={"rope_type": "axial", "rope_theta": cfg.rope_theta})
    if not qwen2_5:
        return Qwen2VLVisionConfig(**common, embed_dim=cfg.hidden_size, hidden_size=cfg.out_hidden_size,
                                   mlp_ratio=cfg.intermediate_size // cfg.hidden_size)
    # A tower without windows still needs a window size: one window as wide as max_pixels allows,
    # with every layer listed as full attention, computes the same.
    windowless = not cfg.window_size
    return Qwen2_5_VLVisionConfig(
        **common, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        out_hidden_size=cfg.out_hidden_size, window_size=cfg.window_size or cfg.resize_factor,
        fullatt_block_indexes=list(range(cfg.num_layers)) if windowless else list(cfg.full_attention_layers))


def _hf_temporal(cfg: ViTConfig, per_frame: bool) -> int:
    return TEMPORAL_PATCH_SIZE if per_frame and cfg.temporal_patch_size == 1 else cfg.temporal_patch_size


def _rename(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for source, target in pairs:
        if name.startswith(source):
            return target + name[len(source):]
    if _BLOCK.fullmatch(name):
        return name
    raise KeyError(f"no Qwen-VL vision mapping for parameter {name!r}")


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from the tower's: the Conv3d patch embedding flattened (or summed over its
    temporal kernel for a per-frame tower)."""
    ours, theirs = _PATCH_EMBED
    inverse = tuple((hf, our) for our, hf in _MERGER)
    sd = {_rename(name, inverse): tensor for name, tensor in hf_sd.items() if name != theirs}
    if theirs not in hf_sd:
        raise KeyError(f"the HF state dict has no {theirs}")
    weight = hf_sd[theirs]
    if cfg.temporal_patch_size == 1:
        weight = weight.sum(dim=2)
    elif weight.shape[2] != cfg.temporal_patch_size:
        raise ValueError(f"temporal_patch_size={cfg.temporal_patch_size} but the HF patch embedding spans "
                         f"{weight.shape[2]} frames")
    sd[ours] = weight.reshape(cfg.hidden_size, cfg.patch_dim)
    return sd


def loaded_name(name: str) -> str:
    """A folder's names are the loaded model's (``HFAdapter.loaded_name``)."""
    return name


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: ViTConfig, per_frame: bool = True
                     ) -> dict[str, torch.Tensor]:
    """The tower's state dict of ours: a per-frame patch embedding spread evenly over the temporal
    kernel (so that a still image, repeated over it, gives our features), else reshaped (and
    always reshaped with ``per_frame=False``: see ``config_to_hf``)."""
    ours, theirs = _PATCH_EMBED
    out = {_rename(name, _MERGER): tensor for name, tensor in sd.items() if name != ours}
    p, frames = cfg.patch_size, cfg.temporal_patch_size
    weight = sd[ours].reshape(cfg.hidden_size, cfg.in_channels, frames, p, p)
    if per_frame and frames == 1:
        weight = (weight / TEMPORAL_PATCH_SIZE).expand(-1, -1, TEMPORAL_PATCH_SIZE, -1, -1)
    out[theirs] = weight.contiguous()
    return out
