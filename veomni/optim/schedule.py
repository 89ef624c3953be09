"""Warmup + cosine learning-rate schedule, one per parameter group: a group's own ``warmup_steps``
and ``min_lr_ratio`` (set by an ``optim.groups`` entry) override ``train``'s."""

from __future__ import annotations

import math

import torch

from veomni.config.schema import TrainConfig


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup from 1/warmup to 1, then cosine from 1 down to ``min_ratio`` at max_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def group_schedule(warmup_steps: int, max_steps: int, min_ratio: float):
    """step -> multiplier; a plain function, which ``LambdaLR.state_dict`` leaves out (as before)."""
    return lambda step: lr_multiplier(step, warmup_steps, max_steps, min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    schedules = [group_schedule(group.get("warmup_steps", cfg.warmup_steps), cfg.max_steps,
                                group.get("min_lr_ratio", cfg.min_lr_ratio)) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
