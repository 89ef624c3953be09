"""The MoE half of the HF mapping: Qwen2-MoE / Qwen3-MoE config fields and expert layouts.

Expert weights exist in two HF layouts, both accepted on import:
- per expert, as on the Hub and as ``save_pretrained`` writes them:
  ``model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]);
- grouped, as transformers >= 5 holds them in memory (and as we do):
  ``model.layers.i.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I].
Export writes the per-expert layout, which every transformers version and serving stack reads.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from .config import LLMConfig

_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def config_fields_from_hf(hf_config: Any, family: str) -> dict[str, Any]:
    """``LLMConfig`` MoE fields of a ``qwen2_moe`` / ``qwen3_moe`` config; rejects what we lack."""
    if _get(hf_config, "decoder_sparse_step", 1) != 1 or _get(hf_config, "mlp_only_layers"):
        raise ValueError("only configs with an MoE block in every layer are supported "
                         "(decoder_sparse_step=1, mlp_only_layers=[])")
    num_experts = _get(hf_config, "num_experts") or _get(hf_config, "num_local_experts")
    fields: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": _get(hf_config, "num_experts_per_tok"),
        "moe_intermediate_size": _get(hf_config, "moe_intermediate_size"),
        "norm_topk_prob": bool(_get(hf_config, "norm_topk_prob", False)),
        "router_aux_loss_coef": float(_get(hf_config, "router_aux_loss_coef", 0.0)),
        "router_scoring": "softmax",
    }
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = _get(hf_config, "shared_expert_intermediate_size")
        fields["shared_expert_gate"] = True
    return fields


def config_fields_to_hf(cfg: LLMConfig) -> dict[str, Any]:
    """HF kwargs for ``cfg``'s MoE part; ValueError for options the HF family cannot express."""
    unsupported = {
        "router_scoring": (cfg.router_scoring, "softmax"),
        "router_bias_update_rate": (cfg.router_bias_update_rate, 0.0),
        "routed_scaling_factor": (cfg.routed_scaling_factor, 1.0),
    }
    for name, (value, needed) in unsupported.items():
        if value != needed:
            raise ValueError(f"{name}={value!r} cannot be exported to HF {cfg.family}_moe (needs {needed!r})")
    shared = (cfg.shared_expert_intermediate_size, cfg.shared_expert_gate)
    if cfg.family == "qwen3" and shared != (0, False):
        raise ValueError("HF qwen3_moe has no shared expert: set shared_expert_intermediate_size=0")
    if cfg.family == "qwen2" and not (shared[0] and shared[1]):
        raise ValueError("HF qwen2_moe always has a gated shared expert: set shared_expert_intermediate_size > 0 "
                         "and shared_expert_gate=true")
    kwargs = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if cfg.family == "qwen2":
        kwargs["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return kwargs


def group_experts(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors merged into the grouped layout; other entries pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for name, tensor in hf_sd.items():
        match = _PER_EXPERT.fullmatch(name)
        if match:
            prefix, expert, proj = match.groups()
            experts[prefix][proj][int(expert)] = tensor
        else:
            out[name] = tensor
    for prefix, projs in experts.items():
        count = len(projs["down_proj"])
        if any(sorted(projs[p]) != list(range(count)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise KeyError(f"{prefix}: expert weights are incomplete (every expert needs gate, up and down)")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(count)])
    return out


def split_experts(hf_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The grouped layout written out per expert (the inverse of ``group_experts``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_sd.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".mlp.experts"):
            out[name] = tensor
        elif leaf == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif leaf == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            raise KeyError(f"no HF mapping for expert parameter {name!r}")
    return out
