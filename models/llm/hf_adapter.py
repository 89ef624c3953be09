"""Mapping between ``DecoderLM`` and HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
and their MoE variants ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``.

Pure functions over configs and state dicts: no file IO (``veomni.checkpoint.hf_io`` does
that), no model instances. Name mapping (``i`` = layer index):

    embed_tokens                  <-> model.embed_tokens
    layers.i.attn_norm            <-> model.layers.i.input_layernorm
    layers.i.attn.{q,k,v,o}_proj  <-> model.layers.i.self_attn.{q,k,v,o}_proj   (+ .bias)
    layers.i.attn.{q,k}_norm      <-> model.layers.i.self_attn.{q,k}_norm
    layers.i.mlp_norm             <-> model.layers.i.post_attention_layernorm
    layers.i.mlp.{gate,up,down}_proj <-> model.layers.i.mlp.{gate,up,down}_proj
    norm                          <-> model.norm
    lm_head                       <-> lm_head   (absent from HF exports when tied)
  MoE layers (see ``hf_moe`` for the expert layout):
    layers.i.mlp.router.weight    <-> model.layers.i.mlp.gate.weight
    layers.i.mlp.experts.*        <-> model.layers.i.mlp.experts.*
    layers.i.mlp.shared_expert.*  <-> model.layers.i.mlp.shared_expert.*  (Qwen2-MoE)
    layers.i.mlp.shared_expert_gate <-> model.layers.i.mlp.shared_expert_gate
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from . import hf_moe
from .config import LLMConfig

hf_model_types = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Fields a recipe may set apart from a pretrained folder: the context length (RoPE is computed on
# the fly), the init scale, and the MoE training-only options (losses, bias updates). Not
# ``capacity_factor``: dropping tokens past an expert's capacity changes the outputs in eval too,
# and Hugging Face's MoE models drop none (0.0).
free_fields = ("max_position_embeddings", "init_std", "router_aux_loss_coef", "router_z_loss_coef",
               "router_bias_update_rate")

_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# One table, both directions: (our module path, HF module path, alternatives for {p}). ``{i}`` is
# the layer index; ``{p}`` one of the alternatives. Applied to the name before its final
# ".weight" / ".bias".
_NAME_MAP = (
    ("embed_tokens", "model.embed_tokens", None),
    ("norm", "model.norm", None),
    ("lm_head", "lm_head", None),
    ("layers.{i}.attn_norm", "model.layers.{i}.input_layernorm", None),
    ("layers.{i}.mlp_norm", "model.layers.{i}.post_attention_layernorm", None),
    ("layers.{i}.attn.{p}", "model.layers.{i}.self_attn.{p}", r"[qkvo]_proj|[qk]_norm"),
    ("layers.{i}.mlp.{p}", "model.layers.{i}.mlp.{p}", r"gate_proj|up_proj|down_proj"),
    ("layers.{i}.mlp.router", "model.layers.{i}.mlp.gate", None),
    ("layers.{i}.mlp.{p}", "model.layers.{i}.mlp.{p}",
     r"experts|shared_expert\.(?:gate|up|down)_proj|shared_expert_gate"),
)


def _rule(source: str, target: str, alternatives: str | None) -> tuple[str, str]:
    """(regex over ``source`` paths, ``re.sub`` template producing ``target`` paths)."""
    pattern = re.escape(source).replace(re.escape("{i}"), r"(\d+)")
    pattern = pattern.replace(re.escape("{p}"), f"({alternatives})")
    return pattern, target.replace("{i}", r"\1").replace("{p}", r"\2")


_RULES = tuple(_rule(ours, hf, alt) for ours, hf, alt in _NAME_MAP)
_INVERSE = tuple(_rule(hf, ours, alt) for ours, hf, alt in _NAME_MAP)

# Buffers some older HF checkpoints carry; they hold no learned state.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def _rename(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    module, _, leaf = name.rpartition(".")
    for pattern, template in rules:
        if re.fullmatch(pattern, module):
            return f"{re.sub(pattern, template, module)}.{leaf}"
    raise KeyError(f"no HF mapping for parameter {name!r}")


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _rope_from_hf(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from transformers 5 ``rope_parameters`` or the older two fields. A
    default rope with more parameters (``partial_rotary_factor``) is one we do not compute: refused,
    not dropped."""
    params = _get(hf_config, "rope_parameters")
    if params is None:
        params = dict(_get(hf_config, "rope_scaling") or {})
        params["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    params = dict(params)
    theta = float(params.pop("rope_theta"))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        return theta, params
    extra = sorted(set(params) - {"rope_type", "type"})
    if extra:
        raise ValueError(f"rope parameters {extra} of a default rope are not supported "
                         f"(got {dict((k, params[k]) for k in extra)})")
    return theta, None


def _refuse_unmodelled(hf_config: Any) -> None:
    """Options that change the outputs but have no field in ``LLMConfig``: a folder that sets them
    would load without error and compute something else, so it is refused."""
    if _get(hf_config, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={_get(hf_config, 'attention_dropout')} is not supported "
                         "(our attention has no dropout)")
    other = sorted(set(_get(hf_config, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if other:
        raise ValueError(f"layer_types {other} are not supported: every layer must be full_attention")
    if _get(hf_config, "pretraining_tp", 1) not in (1, None):
        raise ValueError(f"pretraining_tp={_get(hf_config, 'pretraining_tp')} is not supported (needs 1)")


def config_from_hf(hf_config: Any) -> LLMConfig:
    """``LLMConfig`` from an HF config object (or its ``config.json`` dict); rejects what we lack."""
    model_type = _get(hf_config, "model_type")
    if model_type not in hf_model_types:
        raise ValueError(f"HF model_type {model_type!r} is not one of {hf_model_types}")
    family = model_type.removesuffix("_moe")
    moe = hf_moe.config_fields_from_hf(hf_config, model_type) if model_type.endswith("_moe") else {}
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"only SwiGLU with silu is supported, got hidden_act={_get(hf_config, 'hidden_act')!r}"
        )
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if family != "qwen2" and _get(hf_config, "attention_bias", False):
        raise ValueError(f"{family} attention_bias=True (bias on o_proj) is not supported")
    if family == "qwen2" and _get(hf_config, "qkv_bias", True) is False:
        raise ValueError(f"{model_type} with qkv_bias=false (no q/k/v biases) is not supported: our qwen2 family "
                         "always has them")
    if _get(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    _refuse_unmodelled(hf_config)
    theta, scaling = _rope_from_hf(hf_config)
    num_heads = _get(hf_config, "num_attention_heads")
    cfg = LLMConfig(
        vocab_size=_get(hf_config, "vocab_size"),
        hidden_size=_get(hf_config, "hidden_size"),
        intermediate_size=_get(hf_config, "intermediate_size"),
        num_layers=_get(hf_config, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_get(hf_config, "num_key_value_heads") or num_heads,
        head_dim=_get(hf_config, "head_dim"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_get(hf_config, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=_get(hf_config, "max_position_embeddings", 4096),
        init_std=_get(hf_config, "initializer_range", 0.02),
        family=family,
        **moe,
    )
    cfg.validate()
    return cfg


def config_to_hf(cfg: LLMConfig) -> Any:
    """The transformers config (by ``cfg.family``, ``*_moe`` with experts) describing the same model."""
    import transformers

    cfg.validate()
    if cfg.mrope_section is not None:
        raise ValueError(f"mrope_section={cfg.mrope_section} (multimodal RoPE) cannot be expressed by a text-only "
                         f"{cfg.family} model: export the whole vision-language model (models/omni, qwen2_5_vl)")
    config_name, model_name = _HF_CLASSES[f"{cfg.family}_moe" if cfg.is_moe else cfg.family]
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    kwargs: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "rope_parameters": rope,
        "architectures": [model_name],
    }
    if cfg.family != "qwen2":
        kwargs["attention_bias"] = False
    if cfg.is_moe:
        kwargs.update(hf_moe.config_fields_to_hf(cfg))
    return getattr(transformers, config_name)(**kwargs)


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], cfg: LLMConfig) -> dict[str, torch.Tensor]:
    """Our state dict from an HF one. Tied models get ``lm_head.weight`` = the embedding;
    MoE routers get a zero selection bias (HF Qwen-MoE has none)."""
    sd = {
        _rename(name, _INVERSE): tensor
        for name, tensor in hf_moe.group_experts(hf_sd).items()
        if not name.endswith(_IGNORED_HF_SUFFIXES)
    }
    if cfg.is_moe:
        for layer in range(cfg.num_layers):
            sd[f"layers.{layer}.mlp.router.expert_bias"] = torch.zeros(cfg.num_experts)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    elif "lm_head.weight" not in sd:
        raise KeyError("untied model but the HF state dict has no lm_head.weight")
    return sd


def loaded_name(name: str) -> str:
    """A folder's names are the loaded model's (``HFAdapter.loaded_name``)."""
    return name


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], cfg: LLMConfig) -> dict[str, torch.Tensor]:
    """The HF state dict of ours; no ``lm_head.weight`` when embeddings are tied; experts written
    per expert. A router selection bias has no HF counterpart, so it must be zero."""
    out = {}
    for name, tensor in sd.items():
        if name.endswith(".router.expert_bias"):
            if torch.count_nonzero(tensor):
                raise ValueError(f"{name} is non-zero: HF {cfg.family}_moe has no router bias to export it to")
        elif not (cfg.tie_embeddings and name == "lm_head.weight"):
            out[_rename(name, _RULES)] = tensor
    return hf_moe.split_experts(out)
