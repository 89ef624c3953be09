"""Mapping between ``DiTModel`` and diffusers' ``WanTransformer3DModel`` folders.

Pure functions over configs and state dicts (``veomni.checkpoint.hf_io`` does the file IO). A
diffusers ``config.json`` is a flat dict of the init arguments plus ``_class_name``; ours mirror
them, so configs map field by field. Parameter names are diffusers' except these renames, and
two tensors change layout:

    blocks.i.attn{1,2}.to_out   <-> blocks.i.attn{1,2}.to_out.0
    blocks.i.ffn.fc_in          <-> blocks.i.ffn.net.0.proj
    blocks.i.ffn.fc_out         <-> blocks.i.ffn.net.2
    condition_embedder.image_embedder.ff.fc_{in,out} <-> ...ff.net.0.proj, ...ff.net.2 (I2V)
    patch_embedding.weight [D, C*pt*ph*pw]  <-> Conv3d weight [D, C, pt, ph, pw] (a reshape: a
        patch token flattens (c, pt, ph, pw), the order the convolution's kernel flattens in)
    proj_out.{weight,bias} rows (c, pt, ph, pw) <-> rows (pt, ph, pw, c) (Wan unpatchifies with
        the channel fastest; our output token uses the input token's layout)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from .config import ARCHITECTURE_FIELDS, TRAINING_FIELDS, DiTConfig

hf_model_types = ("WanTransformer3DModel",)
free_fields = TRAINING_FIELDS

_FEED_FORWARDS = r"(blocks\.\d+\.ffn|condition_embedder\.image_embedder\.ff)"
_RENAMES = (  # (ours, diffusers), regexes over whole parameter names
    (r"(blocks\.\d+\.attn[12])\.to_out\.", r"\1.to_out.0."),
    (_FEED_FORWARDS + r"\.fc_in\.", r"\1.net.0.proj."),
    (_FEED_FORWARDS + r"\.fc_out\.", r"\1.net.2."),
)
_INVERSE = (
    (r"(blocks\.\d+\.attn[12])\.to_out\.0\.", r"\1.to_out."),
    (_FEED_FORWARDS + r"\.net\.0\.proj\.", r"\1.fc_in."),
    (_FEED_FORWARDS + r"\.net\.2\.", r"\1.fc_out."),
)
# The Wan variant we do not build: first-last-frame (FLF2V) learned image position embeddings.
_UNSUPPORTED = ("pos_embed_seq_len",)
# Tensors of older diffusers I2V folders that diffusers itself ignores on load (its
# ``_keys_to_ignore_on_load_unexpected``): an unused q norm of the image branch.
_IGNORED_ON_IMPORT = re.compile(r"blocks\.\d+\.attn2\.norm_added_q\.")


def config_from_hf(hf_config: Mapping[str, Any]) -> DiTConfig:
    """``DiTConfig`` from a diffusers ``config.json`` dict (or a diffusers ``FrozenDict`` config)."""
    name = hf_config.get("_class_name")
    if name not in hf_model_types:
        raise ValueError(f"diffusers _class_name {name!r} is not one of {hf_model_types}")
    used = [key for key in _UNSUPPORTED if hf_config.get(key) is not None]
    if used:
        raise ValueError(f"WanTransformer3DModel with {', '.join(f'{k}={hf_config[k]!r}' for k in used)} "
                         "(first-last-frame conditioning) is not supported; text- and image-to-video Wan load")
    defaults = DiTConfig()
    options = {key: hf_config.get(key, getattr(defaults, key)) for key in ARCHITECTURE_FIELDS}
    options["out_channels"] = options["out_channels"] or options["in_channels"]
    # diffusers' Wan attention normalises q and k across heads whatever qk_norm says (null included)
    options["qk_norm"] = options["qk_norm"] or defaults.qk_norm
    config = DiTConfig(**options)
    config.validate()
    return config


def config_to_hf(cfg: DiTConfig) -> dict[str, Any]:
    """The ``config.json`` dict of a diffusers folder describing the same model."""
    import diffusers

    cfg.validate()
    options = {key: getattr(cfg, key) for key in ARCHITECTURE_FIELDS}
    options["patch_size"] = list(cfg.patch_size)
    return {"_class_name": hf_model_types[0], "_diffusers_version": diffusers.__version__,
            **dict.fromkeys(_UNSUPPORTED), **options}


def _rename(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, template in rules:
        if re.match(pattern, name):
            return re.sub(pattern, template, name, count=1)
    return name


def _output_rows(tensor: torch.Tensor, cfg: DiTConfig, to_hf: bool) -> torch.Tensor:
    """Reorder ``proj_out``'s output rows between (c, patch) and (patch, c) order."""
    patch, channels = math.prod(cfg.patch_size), cfg.out_channels
    shape = (channels, patch) if to_hf else (patch, channels)
    return tensor.reshape(*shape, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: DiTConfig) -> dict[str, torch.Tensor]:
    sd = {_rename(name, _INVERSE): tensor for name, tensor in hf_sd.items() if not _IGNORED_ON_IMPORT.match(name)}
    sd["patch_embedding.weight"] = sd["patch_embedding.weight"].reshape(cfg.hidden_size, cfg.patch_dim)
    for name in ("proj_out.weight", "proj_out.bias"):
        sd[name] = _output_rows(sd[name], cfg, to_hf=False)
    return sd


def loaded_name(name: str) -> str:
    """A folder's names are the loaded model's (``HFAdapter.loaded_name``)."""
    return name


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: DiTConfig) -> dict[str, torch.Tensor]:
    out = {_rename(name, _RENAMES): tensor for name, tensor in sd.items()}
    out["patch_embedding.weight"] = out["patch_embedding.weight"].reshape(
        cfg.hidden_size, cfg.in_channels, *cfg.patch_size)
    for name in ("proj_out.weight", "proj_out.bias"):
        out[name] = _output_rows(out[name], cfg, to_hf=True)
    return out
