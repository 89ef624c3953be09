"""The optimizers the engine registers itself: ``adamw`` and ``sgd`` (exactly as the trainer has
always built them) and ``muon`` (hidden matrices; the rest to ``optim.muon_fallback``)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from veomni.config.schema import OptimConfig, TrainConfig
from veomni.optim.muon import Muon
from veomni.optim.muon_sharded import sharded_orthogonalize
from veomni.optim.registry import Groups, OptimizerEntry, register_optimizer


def _adamw(groups: Groups, train: TrainConfig, _optim: OptimConfig) -> torch.optim.Optimizer:
    """A group's ``lr`` / ``weight_decay`` are the constructor's unless a rule set its own (likewise below)."""
    # foreach=True: one fused kernel launch per group; works with DTensor (FSDP2) params.
    return torch.optim.AdamW(groups, lr=train.lr, weight_decay=train.weight_decay, betas=train.betas, eps=train.eps,
                             foreach=True)


def _sgd(groups: Groups, train: TrainConfig, _optim: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=train.lr, weight_decay=train.weight_decay)


def _muon(groups: Groups, train: TrainConfig, optim: OptimConfig) -> torch.optim.Optimizer:
    return Muon(groups, lr=optim.muon_lr or train.lr, weight_decay=train.weight_decay, momentum=optim.muon_momentum,
                nesterov=optim.muon_nesterov, ns_coefficients=optim.muon_ns_coefficients, eps=optim.muon_eps,
                ns_steps=optim.muon_ns_steps, adjust_lr=optim.muon_adjust_lr, ns_dtype=optim.muon_ns_dtype,
                orthogonalize=functools.partial(sharded_orthogonalize, split_balance=optim.muon_split_balance))


def takes_hidden_matrices(_name: str, param: nn.Parameter, hidden: bool) -> bool:
    """Muon's share: 2-D weights and 3-D expert stacks inside the plan's blocks."""
    return hidden and param.ndim in (2, 3)


ADAMW = register_optimizer(OptimizerEntry("adamw", _adamw, states=2))
SGD = register_optimizer(OptimizerEntry("sgd", _sgd))
MUON = register_optimizer(OptimizerEntry("muon", _muon, takes=takes_hidden_matrices,
                                         fallback=lambda optim: optim.muon_fallback, states=1))
