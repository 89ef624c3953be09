"""Parameter groups chosen by rules, and the optimizer each group goes to.

Rules are matched in order against parameter names; the first that matches a parameter sets its
options: the recipe's ``optim.groups`` (globs), then the model family's ``ParamRule``s (its spec's
``param_rules``), then the default that removes weight decay from 1-D parameters (norm scales,
biases). A rule's ``optimizer`` option sends its parameters to that registered optimizer; without
one, the run's optimizer (``train.optimizer``) takes the parameter if its ``takes`` says so, and
its ``fallback`` otherwise: Muon takes the matrices inside the plan's ``blocks`` and leaves the
embeddings, the head, norms and biases to AdamW, as Muon's authors prescribe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from veomni.config.schema import OptimConfig, TrainConfig
from veomni.contract.hooks import ParamRule, TrainableModel
from veomni.contract.plan import flatten_plan, match_modules
from veomni.optim.registry import OptimizerEntry, get_optimizer

NO_DECAY_FOR_VECTORS = ParamRule({"weight_decay": 0.0}, predicate=lambda _, p: p.ndim < 2, name="no_decay_1d")
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """Parameter names without wrapper segments added by activation checkpointing/compile."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def recipe_rules(optim: OptimConfig) -> list[ParamRule]:
    """``optim.groups`` as rules: each entry's set options, under the name ``optim.groups[i]``."""
    rules = []
    for index, entry in enumerate(optim.groups):
        options = {key: value for key, value in (("optimizer", entry.optimizer), ("lr", entry.lr),
                                                 ("weight_decay", entry.weight_decay),
                                                 ("warmup_steps", entry.warmup_steps),
                                                 ("min_lr_ratio", entry.min_lr_ratio)) if value not in (None, "")}
        rules.append(ParamRule(options, pattern=entry.pattern, name=f"optim.groups[{index}]"))
    return rules


def block_prefixes(model: nn.Module) -> tuple[str, ...] | None:
    """``name.`` of every module the model's plan names as a block; None for a module without a plan."""
    if not isinstance(model, TrainableModel):
        return None
    blocks = flatten_plan(model.parallel_plan()).blocks
    return tuple(clean_name(name) + "." for name, _ in match_modules(model, blocks))


def optimizer_groups(model: nn.Module, train: TrainConfig, optim: OptimConfig, rules: Sequence[ParamRule] = ()
                     ) -> dict[str, list[dict[str, Any]]]:
    """Trainable parameters grouped by the first matching rule, per optimizer name (in order of
    first use). A group is ``{**rule options, "params": [...], "group": rule name}``; the options
    it leaves unset (``lr``, ``weight_decay``) are its optimizer's defaults, built from the config."""
    all_rules = [*recipe_rules(optim), *rules, NO_DECAY_FOR_VECTORS]
    run_entry = get_optimizer(train.optimizer)
    blocks = block_prefixes(model)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for raw_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = clean_name(raw_name)
        rule = next((r for r in all_rules if r.matches(name, param)), None)
        options = dict(rule.options) if rule else {}
        hidden = blocks is None or name.startswith(blocks)
        chosen = options.pop("optimizer", None) or _default_choice(run_entry, train, optim, name, param, hidden)
        key = (rule.name or repr(rule.options)) if rule else "default"
        group = out.setdefault(chosen, {}).setdefault(key, {**options, "params": [], "group": key})
        group["params"].append(param)
    return {name: list(groups.values()) for name, groups in out.items()}


def _default_choice(entry: OptimizerEntry, train: TrainConfig, optim: OptimConfig, name: str, param: nn.Parameter,
                    hidden: bool) -> str:
    if entry.takes(name, param, hidden) or entry.fallback is None:
        return entry.name
    return entry.fallback(optim)
