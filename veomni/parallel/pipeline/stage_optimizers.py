"""The optimizer of a rank holding several pipeline stages. It lives here, below both the trainer
(which builds it) and the checkpoint manager (which saves each stage's optimizer state under that
stage's parameter names), so that neither of those imports the other."""

from __future__ import annotations

from collections.abc import Callable

import torch


class StageOptimizers(torch.optim.Optimizer):
    """One optimizer per pipeline stage module, stepped as one.

    Separate optimizers because checkpoints name optimizer state by the parameter names of one
    module (``get_optimizer_state_dict(module, optimizer)``); ``param_groups`` are the inner
    optimizers' own group dicts, read afresh each time (loading a checkpoint replaces an inner
    optimizer's dicts), so an LR scheduler on this object drives all of them.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []  # (no groups while the base class adds its own)
        # one group dict, not a list of parameters: a rank whose stages hold nothing that trains
        # (a LoRA run adapting only other layers) has none, which a bare list may not be
        super().__init__([{"params": [p for o in optimizers for g in o.param_groups for p in g["params"]]}], {})
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, _groups: list[dict]) -> None:
        """(``Optimizer.__init__`` assigns its own list: the inner optimizers own the groups.)"""

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
