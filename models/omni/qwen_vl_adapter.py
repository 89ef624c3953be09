"""Mapping between the ``qwen2_5_vl`` family (``QwenVLConfig`` / ``OmniModel``) and whole Hugging Face
``Qwen2_5_VLForConditionalGeneration`` / ``Qwen2VLForConditionalGeneration`` folders (model_type
``qwen2_5_vl`` / ``qwen2_vl``): what ``checkpoint.init_from_hf`` reads and the export writes.

Pure functions over configs and state dicts. The two halves are the LLM's and the vision tower's
own adapters (``models/llm/hf_adapter.py``, ``models/vit/hf_adapter.py``, the latter with the
folder's own temporal patches, exact both ways: ``per_frame=False``); this module routes names
between them:

    llm.*              <-> model.*, lm_head.*    (the LLM adapter's names; transformers 5 holds
                                                  them as model.language_model.* in memory and
                                                  writes them as model.* in a folder: both read)
    encoders.image.*   <-> visual.*              (the tower adapter's names; model.visual.* reads too)

The text config is a dense Qwen2 with ``rope_parameters.mrope_section`` (our ``llm.mrope_section``);
the folder's token ids and ``vision_config.tokens_per_second`` become ``QwenVLConfig`` fields.

Qwen3-VL folders (``qwen3_vl``, ``qwen3_vl_moe``) are read only to be refused with the reason: its
vision tower adds learned position embeddings and DeepStack mergers whose features are added to
the first LLM layers' hidden states, its M-RoPE interleaves the t/h/w frequencies, and videos are
split per frame with timestamp tokens: a different composition, not options of this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from models.llm import hf_adapter as llm_adapter
from models.vit import hf_adapter as vit_adapter

from .qwen_vl import QwenVLConfig

hf_model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# Options inside the blocks are named by dotted path (component_init compares them one by one).
free_fields = ("freeze", "video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels",
               "im_start_token_id", "im_end_token_id", *(f"llm.{name}" for name in llm_adapter.free_fields),
               *(f"encoders.image.{name}" for name in vit_adapter.free_fields))

_UNSUPPORTED = (
    "is not supported: its vision tower adds learned position embeddings and DeepStack mergers whose "
    "features are added to the hidden states of the first LLM layers, its M-RoPE interleaves the t/h/w "
    "frequencies, and its videos are split per frame with timestamp tokens. The zoo's Qwen-VL family "
    "(model.arch qwen2_5_vl) models Qwen2-VL and Qwen2.5-VL only"
)
_CLASSES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_VISION = ("visual.", "model.visual.")
_TEXT_IN_MEMORY = ("model.language_model.",)


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _as_dict(sub_config: Any) -> dict[str, Any]:
    return dict(sub_config) if isinstance(sub_config, Mapping) else sub_config.to_dict()


def config_from_hf(hf_config: Any) -> QwenVLConfig:
    """``QwenVLConfig`` from a whole Qwen2-VL / Qwen2.5-VL config (object or ``config.json`` dict)."""
    model_type = _get(hf_config, "model_type")
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        raise ValueError(f"Qwen3-VL (model_type {model_type!r}) {_UNSUPPORTED}")
    if model_type not in _CLASSES:
        raise ValueError(f"HF model_type {model_type!r} is not one of {tuple(_CLASSES)}")
    text, vision = _as_dict(_get(hf_config, "text_config")), _as_dict(_get(hf_config, "vision_config"))
    rope = dict(text.get("rope_parameters") or {})
    mrope_section = rope.pop("mrope_section", None)
    if mrope_section is None:
        raise ValueError(f"{model_type} text_config.rope_parameters has no mrope_section")
    if rope.get("rope_type", rope.get("type")) == "mrope":  # older folders name the default rope so
        rope["rope_type"] = "default"
    tied = bool(_get(hf_config, "tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
    llm = llm_adapter.config_from_hf({**text, "model_type": "qwen2", "rope_parameters": rope,
                                      "tie_word_embeddings": tied})
    tower = vit_adapter.config_from_hf(vision, per_frame=False)
    qwen2_5 = model_type == "qwen2_5_vl"
    cfg = QwenVLConfig(
        llm={**dataclasses.asdict(llm), "mrope_section": tuple(mrope_section)},
        encoders={"image": dataclasses.asdict(tower)},
        variant=model_type,
        tokens_per_second=int(vision.get("tokens_per_second", 4)) if qwen2_5 else None,
        **{name: _get(hf_config, name) for name in _TOKEN_FIELDS},
    )
    cfg.validate()
    return cfg


def config_to_hf(cfg: QwenVLConfig) -> Any:
    """The transformers config of the whole model; ValueError naming what it cannot express."""
    import transformers

    cfg.validate()
    llm = cfg.llm_config
    if llm.family != "qwen2" or llm.is_moe:
        raise ValueError(f"model.llm must be a dense qwen2 LLM to export as {cfg.variant} (got family "
                         f"{llm.family!r}{', MoE' if llm.is_moe else ''})")
    if llm.rope_scaling is not None or llm.dim_per_head != llm.hidden_size // llm.num_heads:
        raise ValueError(f"{cfg.variant}'s text config has neither rope scaling nor a head_dim apart from "
                         f"hidden_size / num_heads: model.llm.rope_scaling={llm.rope_scaling!r}, "
                         f"head_dim={llm.head_dim!r}")
    text = dict(
        vocab_size=llm.vocab_size, hidden_size=llm.hidden_size, intermediate_size=llm.intermediate_size,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads,
        num_key_value_heads=llm.num_kv_heads, hidden_act="silu", max_position_embeddings=llm.max_position_embeddings,
        rms_norm_eps=llm.rms_norm_eps, initializer_range=llm.init_std,
        rope_parameters={"rope_type": "default", "rope_theta": llm.rope_theta,
                         "mrope_section": list(llm.mrope_section)},
    )
    tower = cfg.encoder_configs["image"]
    vision = vit_adapter.config_to_hf(tower, per_frame=False).to_dict()
    if vision["model_type"] != f"{cfg.variant}_vision":
        raise ValueError(f"model.encoders.image is a {vision['model_type']} tower, not {cfg.variant}'s")
    if cfg.variant == "qwen2_5_vl":
        vision["tokens_per_second"] = cfg.tokens_per_second
    config_name, model_name = _CLASSES[cfg.variant]
    return getattr(transformers, config_name)(
        text_config=text, vision_config=vision, tie_word_embeddings=llm.tie_embeddings,
        architectures=[model_name], **{name: getattr(cfg, name) for name in _TOKEN_FIELDS})


def _strip(name: str, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: QwenVLConfig) -> dict[str, torch.Tensor]:
    """Our state dict (``llm.*``, ``encoders.image.*``) from a whole folder's (either naming)."""
    if cfg.llm_config is None:
        cfg.validate()
    text, vision = {}, {}
    for name, tensor in hf_sd.items():
        tower_name = _strip(name, _VISION)
        if tower_name is not None:
            vision[tower_name] = tensor
        else:
            inner = _strip(name, _TEXT_IN_MEMORY)
            text[name if inner is None else f"model.{inner}"] = tensor
    sd = {f"llm.{k}": v for k, v in llm_adapter.state_dict_from_hf(text, cfg.llm_config).items()}
    tower = vit_adapter.state_dict_from_hf(vision, cfg.encoder_configs["image"])
    return {**sd, **{f"encoders.image.{k}": v for k, v in tower.items()}}


def loaded_name(name: str) -> str:
    """A folder's name as transformers 5 holds it in memory (what PEFT targets): ``model.*`` of the
    LLM under ``model.language_model.*``, ``visual.*`` under ``model.visual.*``; ``lm_head`` as is."""
    if name.startswith("visual."):
        return f"model.{name}"
    if name.startswith("model.") and not name.startswith((*_TEXT_IN_MEMORY, "model.visual.")):
        return f"model.language_model.{name.removeprefix('model.')}"
    return name


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: QwenVLConfig) -> dict[str, torch.Tensor]:
    """The folder's state dict of ours, in the names ``save_pretrained`` writes."""
    if cfg.llm_config is None:
        cfg.validate()
    parts: dict[str, dict[str, torch.Tensor]] = {"llm.": {}, "encoders.image.": {}}
    for name, tensor in sd.items():
        prefix = next((p for p in parts if name.startswith(p)), None)
        if prefix is None:
            raise KeyError(f"no Qwen-VL mapping for parameter {name!r} (expected llm.* or encoders.image.*)")
        parts[prefix][name[len(prefix):]] = tensor
    out = llm_adapter.state_dict_to_hf(parts["llm."], cfg.llm_config)
    tower = vit_adapter.state_dict_to_hf(parts["encoders.image."], cfg.encoder_configs["image"], per_frame=False)
    return {**out, **{f"visual.{k}": v for k, v in tower.items()}}
