"""Optimizers by name, like model families: ``train.optimizer`` (and a parameter group's
``optimizer`` option) names one, and a plug-in package adds its own with ``register_optimizer``,
no edit to the engine.

An entry builds one ``torch.optim.Optimizer`` over the parameter groups assigned to it (dicts with
``params`` and the group's options, ``lr`` and ``weight_decay`` set) from the run's config, and
says which parameters it takes when a run names it with no rule saying otherwise (``takes``):
Muon only hidden matrices, AdamW and SGD everything.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from veomni.config.schema import OptimConfig, TrainConfig

Groups = list[dict[str, Any]]


def _takes_all(_name: str, _param: nn.Parameter, _hidden: bool) -> bool:
    return True


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    build: Callable[[Groups, TrainConfig, OptimConfig], torch.optim.Optimizer]
    """(parameter groups, ``train`` section, ``optim`` section) -> the optimizer over them."""
    takes: Callable[[str, nn.Parameter, bool], bool] = _takes_all
    """(parameter name, parameter, inside one of the plan's blocks) -> this optimizer takes it when
    the run names it; the rest go to ``fallback``."""
    fallback: Callable[[OptimConfig], str] | None = None
    states: int = 0
    """fp32 state tensors it keeps per parameter (AdamW 2, Muon 1, SGD 0): ``--dry-run``'s memory."""
    """run config -> the optimizer of the parameters ``takes`` refuses (Muon: ``optim.muon_fallback``)."""


_OPTIMIZERS: dict[str, OptimizerEntry] = {}


def register_optimizer(entry: OptimizerEntry) -> OptimizerEntry:
    """Add ``entry``; a different entry under a taken name is an error."""
    existing = _OPTIMIZERS.get(entry.name)
    if existing is not None and existing != entry:
        raise ValueError(f"optimizer {entry.name!r} is already registered")
    _OPTIMIZERS[entry.name] = entry
    return entry


def registered_optimizers() -> tuple[str, ...]:
    return tuple(sorted(_OPTIMIZERS))


def get_optimizer(name: str, where: str = "train.optimizer") -> OptimizerEntry:
    """The entry registered as ``name``; an unknown name says which exist and the nearest one."""
    if name not in _OPTIMIZERS:
        close = difflib.get_close_matches(name, list(_OPTIMIZERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: unknown optimizer {name!r}{hint} (registered: {', '.join(registered_optimizers())};"
                         " a plug-in adds one with veomni.optim.register_optimizer)")
    return _OPTIMIZERS[name]
