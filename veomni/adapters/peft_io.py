"""LoRA adapters in and out of PEFT's folder format, and the start of a LoRA run's weights.

A PEFT folder is ``adapter_config.json`` + ``adapter_model.safetensors`` keyed by the Hugging Face
(or diffusers) model's module paths: ``base_model.model.<hf module>.lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] for a linear layer. Grouped experts are PEFT's ``target_parameters``:
``lora_A.weight`` [E*r, in] (expert-major) and ``lora_B.weight`` [out, r*E] (expert-minor), one
pair per targeted weight, the first weight listed innermost (``<module>.base_layer.lora_A``...).

Modules ``lora.train`` trains whole are PEFT's ``modules_to_save``: their weights are stored
under the Hugging Face name (``base_model.model.lm_head.weight``), and load back into them. Per-layer
ranks and alphas are PEFT's ``rank_pattern`` / ``alpha_pattern``, written as full module names.
Every other field of PEFT's ``LoraConfig`` is judged in ``peft_fields.py``.

Our module paths become the Hugging Face ones through the family's own ``HFAdapter``: each
adapted weight is exported with ``state_dict_to_hf`` and found among the results, so any family
whose export renames (and may split) weights gets PEFT interop with no code of its own. A weight
the export transforms in value (fused, transposed) cannot carry a PEFT adapter: refused by name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from veomni.adapters.lora import ExpertLoRA, LoRALinear, init_lora, is_adapter_name, scaling_of
from veomni.adapters.peft_fields import peft_config_problems
from veomni.config.schema import LoraConfig
from veomni.contract import HFAdapter
from veomni.contract.hooks import AdaptableExperts
from veomni.errors import BadCheckpoint, BadConfig, MissingInput

logger = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
_SPAN = float(2**32)  # hf_paths: more elements than any one weight holds


def adapted_modules(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(module path, module, adapted weight names) for every adapted linear layer and expert group."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            found.append((path, module, ("weight",)))
        elif isinstance(module, AdaptableExperts) and isinstance(module.expert_delta, ExpertLoRA):
            found.append((path, module, module.expert_delta.names))
    return found


def _join(path: str, leaf: str) -> str:
    return f"{path}.{leaf}" if path else leaf


def _exported_keys(model: nn.Module, adapter: HFAdapter, model_cfg: Any, names: list[str]
                   ) -> tuple[dict[str, list[str]], dict[str, bool]]:
    """(our weight -> the exported keys it becomes, exported key -> whether it comes out element for
    element as it went in) for ``names``, weights of ``model``."""
    state = {k: v for k, v in model.state_dict().items() if not is_adapter_name(k)}
    # Each weight of ``names`` becomes marker * 2**32 + its element index (float64, exact): the exported
    # entries whose values all lie in a marker's range are the ones it turned into, whatever the
    # export renames or splits; the other weights are zero views that take no memory.
    probe = {k: v.new_zeros((), dtype=torch.float64, device="cpu").expand(v.shape) for k, v in state.items()}
    for marker, name in enumerate(names, start=1):
        shape = state[name].shape
        probe[name] = torch.arange(shape.numel(), dtype=torch.float64).add_(marker * _SPAN).reshape(shape)
    exported = adapter.state_dict_to_hf(probe, model_cfg)
    found: dict[str, list[str]] = {name: [] for name in names}
    same: dict[str, bool] = {}
    for key, tensor in exported.items():
        markers = torch.div(tensor.double(), _SPAN, rounding_mode="floor") if tensor.numel() else tensor
        marker = int(markers.flatten()[0]) if tensor.numel() else 0
        if marker and bool((markers == marker).all()):
            name = names[marker - 1]
            found[name].append(key)
            # a linear weight must come out element for element as it went in (not transposed or
            # permuted: the DiT's patch_embedding and proj_out are)
            same[key] = tensor.shape == probe[name].shape and torch.equal(tensor.double(), probe[name])
    return found, same


def hf_paths(model: nn.Module, adapter: HFAdapter, model_cfg: Any) -> dict[str, str]:
    """Our adapted weight (``layers.0.attn.q_proj.weight``) -> the Hugging Face name PEFT targets:
    the module path of a linear layer (``model.layers.0.self_attn.q_proj``) or the parameter path of
    a grouped expert weight (``model.layers.0.mlp.experts.gate_up_proj``), as the loaded model holds
    it (``HFAdapter.loaded_name``)."""
    names = [_join(path, w) for path, _, weights in adapted_modules(model) for w in weights]
    found, same = _exported_keys(model, adapter, model_cfg, names)
    out = {}
    for name, keys in found.items():
        if name.endswith(".weight") and len(keys) == 1 and not same[keys[0]]:
            keys = []
        if not keys:
            raise ValueError(f"{name}: the {type(adapter).__name__} export changes this weight's values (fused or "
                             "transposed), so no PEFT adapter can target it; leave it out of lora.targets")
        if name.endswith(".weight"):  # a linear layer: its module, renamed
            out[name] = adapter.loaded_name(keys[0].removesuffix(".weight"))
            continue
        # a grouped expert weight, kept grouped or split per expert: transformers holds it grouped on
        # the experts' common module
        common = os.path.commonprefix([k.split(".") for k in keys]) if len(keys) > 1 else keys[0].split(".")[:-1]
        if common and common[-1].isdigit():
            common = common[:-1]
        out[name] = adapter.loaded_name(".".join([*common, name.rpartition(".")[2]]))
    return out


def saved_paths(model: nn.Module, adapter: HFAdapter, model_cfg: Any) -> dict[str, str]:
    """Each weight ``lora.train`` trains whole (``lm_head.weight``) -> its Hugging Face name as the
    loaded model holds it: what PEFT's ``modules_to_save`` stores. ValueError naming a weight the
    export changes (fused, transposed, split), which PEFT could not hold as it is."""
    names = [name for name, p in model.named_parameters() if p.requires_grad and not is_adapter_name(name)]
    if not names:
        return {}
    tied = [name for name, p in model.named_parameters(remove_duplicate=False)
            if p.requires_grad and not is_adapter_name(name) and name not in names]
    if tied:
        raise ValueError(f"lora.train trains the tied weight {tied[0]} whole: PEFT's modules_to_save would hold "
                         "one copy per module, untied; export the merged model only")
    found, same = _exported_keys(model, adapter, model_cfg, names)
    out = {}
    for name, keys in found.items():
        if len(keys) != 1 or not same[keys[0]]:
            raise ValueError(f"lora.train trains {name} whole, but the {type(adapter).__name__} export changes it "
                             f"(into {keys or 'nothing'}), so PEFT's modules_to_save cannot hold it; leave it out "
                             "of lora.train, or export the merged model only")
        out[name] = adapter.loaded_name(keys[0])
    return out


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key that is a dotted suffix of ``module`` (a regex)."""
    return next((value for key, value in patterns.items() if re.match(rf"(.*\.)?({key})$", module)), default)


def export_peft(model: nn.Module, adapter: HFAdapter, model_cfg: Any, lora: LoraConfig, out: Path,
                base_model: str = "", task_type: str | None = "CAUSAL_LM") -> Path:
    """Write ``model``'s adapters (a plain CPU model holding the trained values) as a PEFT folder.
    ``model`` may be a sub-module with a family of its own, with that family's adapter and config:
    a VLM's ``model.llm`` with the LLM's (``load_peft`` likewise). A DiT's folder loads onto
    diffusers' model with ``task_type=None``."""
    paths = hf_paths(model, adapter, model_cfg)
    saved = saved_paths(model, adapter, model_cfg)
    params = dict(model.named_parameters())
    tensors = {f"{PREFIX}{hf}": params[ours].detach().contiguous() for ours, hf in saved.items()}
    modules, parameters = [], []
    ranks, alphas = {}, {}
    for path, module, weights in adapted_modules(model):
        if isinstance(module, LoRALinear):
            target = paths[_join(path, "weight")]
            modules.append(target)
            if module.lora_A.shape[0] != lora.rank:
                ranks[target] = module.lora_A.shape[0]
            if module.alpha != lora.alpha:
                alphas[target] = module.alpha
            tensors[f"{PREFIX}{target}.lora_A.weight"] = module.lora_A.detach().contiguous()
            tensors[f"{PREFIX}{target}.lora_B.weight"] = module.lora_B.detach().contiguous()
            continue
        for depth, weight in enumerate(weights):  # the first weight listed is wrapped innermost
            target = paths[_join(path, weight)]
            parameters.append(target)
            owner = target.rpartition(".")[0] + ".base_layer" * (len(weights) - 1 - depth)
            a, b = getattr(module, f"{weight}_lora_A").detach(), getattr(module, f"{weight}_lora_B").detach()
            tensors[f"{PREFIX}{owner}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
            tensors[f"{PREFIX}{owner}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    config = {"peft_type": "LORA", "task_type": task_type, "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "bias": "none", "fan_in_fan_out": False,
              "rank_pattern": ranks, "alpha_pattern": alphas,
              "target_modules": modules or None, "target_parameters": parameters or None,
              "modules_to_save": sorted({hf.rpartition(".")[0] for hf in saved.values()}) or None,
              "init_lora_weights": True, "inference_mode": True,
              "base_model_name_or_path": base_model or None}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_peft_config(folder: str | Path) -> dict[str, Any]:
    """A PEFT folder's adapter config, its weights file checked present; FileNotFoundError /
    ValueError naming what is wrong."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise MissingInput(f"{folder} is not a PEFT adapter folder: {name} is missing")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise BadCheckpoint(f"{folder / CONFIG_FILE} is not valid JSON ({exc})") from None
    if config.get("peft_type") != "LORA":
        raise BadCheckpoint(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    return config


def read_peft(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter config, tensors) of a PEFT folder; FileNotFoundError / ValueError naming what is wrong."""
    config = read_peft_config(folder)
    try:
        return config, load_file(str(Path(folder) / WEIGHTS_FILE))
    except SafetensorError as exc:
        raise BadCheckpoint(f"{Path(folder) / WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None


@torch.no_grad()
def load_peft(model: nn.Module, folder: str | Path, adapter: HFAdapter, model_cfg: Any, lora: LoraConfig) -> int:
    """Copy a PEFT folder's adapters into ``model``'s (same rank, alpha, targets); returns how many
    weights were loaded. BadCheckpoint naming each mismatch."""
    config, tensors = read_peft(folder)
    problems = peft_config_problems(config, str(folder))
    if problems:
        raise BadCheckpoint("; ".join(problems))
    if (config.get("r"), float(config.get("lora_alpha", 0)), bool(config.get("use_rslora"))) != \
            (lora.rank, float(lora.alpha), lora.rslora):
        raise BadCheckpoint(f"{folder}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')}, "
                               f"use_rslora={config.get('use_rslora')} but the recipe has lora.rank={lora.rank}, "
                               f"lora.alpha={lora.alpha}, lora.rslora={lora.rslora}: make them equal")
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in tensors.items()}
    paths = hf_paths(model, adapter, model_cfg)
    _check_layer_patterns(model, paths, config, folder)
    used: set[str] = set()
    for path, module, weights in adapted_modules(model):
        for depth, weight in enumerate(weights):
            target = paths[_join(path, weight)]
            grouped = not isinstance(module, LoRALinear)
            owner = target.rpartition(".")[0] + ".base_layer" * (len(weights) - 1 - depth) if grouped else target
            keys = (f"{PREFIX}{owner}.lora_A.weight", f"{PREFIX}{owner}.lora_B.weight")
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise BadCheckpoint(f"{folder}: no adapter for {_join(path, weight)} (looked for {missing[0]}); the "
                                       "folder's targets must include every module lora.targets selects")
            a, b = tensors[keys[0]], tensors[keys[1]]
            if grouped:
                dest_a, dest_b = getattr(module, f"{weight}_lora_A"), getattr(module, f"{weight}_lora_B")
                num = dest_a.shape[0]
                a = a.reshape(num, -1, a.shape[-1])
                b = b.reshape(b.shape[0], -1, num).permute(2, 0, 1)
            else:
                dest_a, dest_b = module.lora_A, module.lora_B
            for dest, src, key in ((dest_a, a, keys[0]), (dest_b, b, keys[1])):
                _copy(dest, src, key, folder)
            used.update(keys)
    adapters = len(used) // 2
    params = dict(model.named_parameters())
    for ours, hf in saved_paths(model, adapter, model_cfg).items():
        key = f"{PREFIX}{hf}"
        if key in tensors:
            _copy(params[ours].data, tensors[key], key, folder)
            used.add(key)
    extra = sorted(set(tensors) - used)
    unselected = [k for k in extra if is_adapter_name(k.removesuffix(".weight"))]
    if unselected:
        raise BadCheckpoint(f"{folder}: adapters for modules lora.targets does not select, e.g. {unselected[0]}; add "
                            "them to lora.targets")
    if extra:
        raise BadCheckpoint(f"{folder}: trains {extra[0].removeprefix(PREFIX)} whole (modules_to_save "
                            f"{config.get('modules_to_save')}), which lora.train does not train; add its module to "
                            "lora.train (our module names)")
    return adapters


def _copy(dest: torch.Tensor, src: torch.Tensor, key: str, folder: str | Path) -> None:
    if dest.shape != src.shape:
        raise BadCheckpoint(f"{folder}: {key} has shape {tuple(src.shape)}, the model needs {tuple(dest.shape)}")
    dest.copy_(src)


def _check_layer_patterns(model: nn.Module, paths: dict[str, str], config: dict[str, Any], folder: str | Path
                          ) -> None:
    """The folder's rank and alpha of each adapted linear layer (its ``rank_pattern`` /
    ``alpha_pattern`` read as PEFT reads them) equal the model's; BadCheckpoint naming the layers and
    the ``lora.rank_pattern`` / ``lora.alpha_pattern`` that would make them equal."""
    wrong, want_ranks, want_alphas = [], {}, {}
    for path, module, _ in adapted_modules(model):
        if not isinstance(module, LoRALinear):
            continue
        target = paths[_join(path, "weight")]
        rank = _pattern_value(config.get("rank_pattern") or {}, target, config.get("r"))
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, target, config.get("lora_alpha")))
        if rank != config.get("r"):
            want_ranks[path] = rank
        if alpha != float(config.get("lora_alpha")):
            want_alphas[path] = alpha
        if (rank, alpha) != (module.lora_A.shape[0], module.alpha):
            wrong.append(f"{path} (folder r={rank}, alpha={alpha:g}; recipe r={module.lora_A.shape[0]}, "
                         f"alpha={module.alpha:g})")
    if wrong:
        raise BadCheckpoint(f"{folder}: its rank_pattern / alpha_pattern give layers another rank or alpha than the "
                            f"recipe: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; set "
                            f"lora.rank_pattern: {want_ranks} and lora.alpha_pattern: {want_alphas}")


def init_adapters(model: nn.Module, lora: LoraConfig, adapter: HFAdapter | None, model_cfg: Any,
                  resuming: bool) -> list[str]:
    """The adapters' start on rank 0's full copy: PEFT's init, then ``lora.init_from_peft`` for a
    fresh run. Returns log lines."""
    if lora.rank <= 0:
        return []
    lines = [f"LoRA: {init_lora(model)} adapted weights, rank {lora.rank}, scaling {scaling_of(lora):g}"]
    if lora.init_from_peft and not resuming:
        if adapter is None:
            raise BadConfig("lora.init_from_peft: this model family has no Hugging Face adapter to map PEFT names")
        count = load_peft(model, lora.init_from_peft, adapter, model_cfg, lora)
        lines.append(f"LoRA: {count} adapters loaded from {lora.init_from_peft}")
    return lines
