"""The launcher's checks of a recipe's ``lora`` section, on the meta model, before any worker starts.

A pattern of ``lora.targets`` or ``lora.train`` that matches nothing would otherwise surface as a
worker's traceback after data preparation; here it is refused with the message ``add_lora`` raises,
which names the key. Two more questions only the adapted model answers:

- ``lora.targets`` / ``lora.train`` reaching into a part the model config freezes itself (an omni
  model's ``model.freeze``) contradicts it: LoRA already freezes every base weight, so the recipe
  must say which it means.
- ``lora.init_from_peft`` names a PEFT folder of the recipe's rank, alpha and rslora, for a family
  that can map its names, with no ``LoraConfig`` option our LoRA does not compute
  (``veomni/adapters/peft_fields.py``), per-layer patterns where the recipe has them and whole
  modules (``modules_to_save``) where ``lora.train`` trains some. Which layers they reach is
  compared when the folder loads (it needs the weights' Hugging Face names).
- A frozen base that no ``checkpoint.init_from_hf`` / ``checkpoint.init`` entry loads is legitimate
  (tests, recipes, a seeded study): it is the seeded random init, rebuilt from ``train.seed`` on
  every start and resume. The launcher's ``frozen_problems`` refuses that only for what the model
  config freezes, so a LoRA run is warned, not refused.
"""

from __future__ import annotations

from torch import nn

from veomni.adapters.lora import add_lora, is_adapter_name
from veomni.adapters.peft_fields import peft_config_problems
from veomni.adapters.peft_io import read_peft_config
from veomni.checkpoint.component_init import component_paths, init_entries
from veomni.config.schema import RunConfig
from veomni.contract import get_model_spec

_SHOWN = 4


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _base_weight(adapter: str) -> str:
    """``x.q_proj.lora_A`` -> ``x.q_proj.weight``; ``x.experts.gate_up_proj_lora_B`` -> ``x.experts.gate_up_proj``."""
    path, _, leaf = adapter.rpartition(".")
    base = "weight" if leaf in ("lora_A", "lora_B") else leaf.rsplit("_lora_", 1)[0]
    return f"{path}.{base}" if path else base


def _peft_problems(cfg: RunConfig) -> list[str]:
    """``lora.init_from_peft``: a readable LoRA folder of the recipe's rank and alpha, for a family
    whose Hugging Face adapter names its modules."""
    folder = cfg.lora.init_from_peft
    if not folder:
        return []
    if get_model_spec(cfg.model.arch).hf_adapter is None:
        return [f"lora.init_from_peft: model {cfg.model.arch!r} has no Hugging Face adapter to map a PEFT folder's "
                "module names onto; start its adapters from the init (drop lora.init_from_peft)"]
    try:
        config = read_peft_config(folder)
    except (FileNotFoundError, ValueError) as exc:
        return [f"lora.init_from_peft: {exc}"]
    problems = [f"lora.init_from_peft: {problem}" for problem in peft_config_problems(config, folder)]
    if (config.get("r"), float(config.get("lora_alpha", 0)), bool(config.get("use_rslora"))) != \
            (cfg.lora.rank, float(cfg.lora.alpha), cfg.lora.rslora):
        problems.append(f"lora.init_from_peft: {folder} has r={config.get('r')}, lora_alpha={config.get('lora_alpha')}"
                        f", use_rslora={bool(config.get('use_rslora'))}; the recipe has lora.rank={cfg.lora.rank}, "
                        f"lora.alpha={cfg.lora.alpha}, lora.rslora={cfg.lora.rslora}: make them equal")
    for field, ours in (("rank_pattern", cfg.lora.rank_pattern), ("alpha_pattern", cfg.lora.alpha_pattern)):
        if bool(config.get(field)) != bool(ours):
            problems.append(f"lora.init_from_peft: {folder} has {field} {config.get(field) or {}} and the recipe "
                            f"lora.{field} {ours}: give the recipe the same per-layer values (keys in our module "
                            "names, patterns as in lora.targets)")
    if config.get("modules_to_save") and not cfg.lora.train:
        problems.append(f"lora.init_from_peft: {folder} trains {config['modules_to_save']} whole (modules_to_save); "
                        "name those modules in lora.train (our module names) to load and train them")
    return problems


def check_lora(model: nn.Module, cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(problems, warnings) of ``cfg.lora`` for ``model`` (a meta copy, adapted in place here)."""
    if cfg.lora.rank <= 0:
        return [], []
    frozen_by_model = {name for name, param in model.named_parameters() if not param.requires_grad}
    try:
        add_lora(model, cfg.lora)
    except ValueError as exc:
        return [str(exc)], []
    params = dict(model.named_parameters())
    adapted = sorted({_base_weight(n).rpartition(".")[0] for n in params
                      if is_adapter_name(n) and _base_weight(n) in frozen_by_model})
    trained = sorted({n.rpartition(".")[0] for n in frozen_by_model if params[n].requires_grad})
    problems = []
    if adapted:
        problems.append(f"lora.targets adapts {_listed(adapted)}, which the model config freezes (model.freeze): "
                        "LoRA freezes every base weight already; drop the part from model.freeze, or leave it out "
                        "of lora.targets")
    if trained:
        problems.append(f"lora.train trains {_listed(trained)}, which the model config freezes (model.freeze): "
                        "drop one of the two")
    problems += _peft_problems(cfg)
    try:
        entries = list(init_entries(cfg.checkpoint))
    except ValueError:  # reported by the launcher's checkpoint checks
        entries = []
    unloaded = [n for n, p in params.items() if not p.requires_grad
                and not any(e == "" or n == e or n.startswith(e + ".") for e in entries)]
    parts = [c for c in component_paths(model) if any(n == c or n.startswith(c + ".") for n in unloaded)]
    if not unloaded:
        return problems, []
    return problems, [f"lora: the frozen base of {_listed(parts or unloaded)} is loaded by no checkpoint.init_from_hf "
                      f"/ checkpoint.init entry: it is the seeded random init (train.seed={cfg.train.seed}), rebuilt "
                      "from the seed on every start and resume. To adapt a pretrained model, set "
                      "checkpoint.init_from_hf (or checkpoint.init per part)"]
