"""Optimizer with per-parameter groups, and the warmup + cosine schedule.

Parameter groups are rules matched in order against parameter names: the first rule that
matches a parameter sets its options. The default rule removes weight decay from 1-D
parameters (norm scales, biases); a model family adds its own rules (for example parameters
that must never decay) through its spec's ``param_rules``, with no change to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from veomni.config.schema import TrainConfig
from veomni.contract.hooks import ParamRule
from veomni.parallel.pipeline.stage_optimizers import StageOptimizers

NO_DECAY_FOR_VECTORS = ParamRule({"weight_decay": 0.0}, predicate=lambda _, p: p.ndim < 2, name="no_decay_1d")


def _clean_name(name: str) -> str:
    """Parameter names without wrapper segments added by activation checkpointing/compile."""
    return ".".join(part for part in name.split(".") if part not in ("_checkpoint_wrapped_module", "_orig_mod"))


def param_groups(model: nn.Module, base: dict[str, Any], family_rules: Sequence[ParamRule] = ()
                 ) -> list[dict[str, Any]]:
    """Trainable parameters grouped by the first matching rule: the family's, then the default."""
    rules = [*family_rules, NO_DECAY_FOR_VECTORS]
    groups: dict[str, dict[str, Any]] = {}
    for raw_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = _clean_name(raw_name)
        rule = next((r for r in rules if r.matches(name, param)), None)
        key = (rule.name or repr(rule.options)) if rule else "default"
        group = groups.setdefault(key, {**base, **(rule.options if rule else {}), "params": [], "group": key})
        group["params"].append(param)
    return list(groups.values())


def build_optimizer(model: nn.Module | list[nn.Module], cfg: TrainConfig, rules: Sequence[ParamRule] = ()
                    ) -> torch.optim.Optimizer:
    """AdamW (or SGD) over the model; over each module of a list (pipeline stages) separately.
    ``rules``: the model family's parameter rules (its spec's ``param_rules``)."""
    if isinstance(model, list):
        optimizers = [build_optimizer(part, cfg, rules) for part in model]
        return optimizers[0] if len(optimizers) == 1 else StageOptimizers(optimizers)
    base = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    # A pipeline stage of a LoRA run may hold nothing that trains (adapters on later layers
    # only): it still gets its optimizer, empty, as checkpoints keep one per stage.
    groups = param_groups(model, base, rules) or [{**base, "params": [], "group": "default"}]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr)
    # foreach=True: one fused kernel launch per group; works with DTensor (FSDP2) params.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup from 1/warmup to 1, then cosine from 1 down to ``min_ratio`` at max_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    )
