"""The rank's ``OptimizerSet`` over the modules it holds (the model, or its pipeline stages): per
part, one registered optimizer per name its parameter groups chose (``groups.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from veomni.config.schema import OptimConfig, TrainConfig
from veomni.contract.hooks import ParamRule
from veomni.optim.container import OptimizerSet
from veomni.optim.groups import optimizer_groups
from veomni.optim.registry import get_optimizer


def build_optimizer(model: nn.Module | list[nn.Module], train: TrainConfig, rules: Sequence[ParamRule] = (),
                    optim: OptimConfig | None = None) -> OptimizerSet:
    """The optimizers of ``model`` (each module of a list separately: checkpoints name a part's
    optimizer state by its parameter names). ``rules``: the model family's parameter rules."""
    optim = optim or OptimConfig()
    parts = model if isinstance(model, list) else [model]
    return OptimizerSet([_part_optimizers(part, train, optim, rules) for part in parts])


def _part_optimizers(part: nn.Module, train: TrainConfig, optim: OptimConfig, rules: Sequence[ParamRule]) -> list:
    by_name = optimizer_groups(part, train, optim, rules)
    # A pipeline stage of a LoRA run may hold nothing that trains (adapters on later layers
    # only): it still gets its optimizer, empty, as checkpoints keep one per stage.
    if not by_name:
        by_name = {train.optimizer: [{"params": [], "group": "default"}]}
    return [get_optimizer(name).build(groups, train, optim) for name, groups in by_name.items()]
