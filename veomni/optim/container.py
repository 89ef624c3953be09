"""The one optimizer object of a rank: several optimizers per model part (Muon and AdamW over one
model), several parts (pipeline stages), stepped as one. The trainer, the LR schedule, the
bad-step guard (which skips ``step``) and the checkpoint manager (which saves each part's
optimizers' state under that part's parameter names) all hold this one object."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OptimizerSet(torch.optim.Optimizer):
    """``per_part[i]``: the optimizers of model part ``i``, over disjoint parameters.

    ``param_groups`` are the inner optimizers' own group dicts, read afresh each time (loading a
    checkpoint replaces an inner optimizer's dicts), so an LR scheduler on this object drives all
    of them; checkpoints name optimizer state by the parameter names of one part
    (``get_optimizer_state_dict(part, per_part[i])``).
    """

    def __init__(self, per_part: list[list[torch.optim.Optimizer]]) -> None:
        self.per_part: list[list[torch.optim.Optimizer]] = []  # (no groups while the base class adds its own)
        # one group dict, not a list of parameters: a rank whose parts hold nothing that trains
        # (a LoRA run adapting only other layers) has none, which a bare list may not be
        params = [p for optimizers in per_part for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__([{"params": params}], {})
        self.per_part = per_part

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for optimizers in self.per_part for o in optimizers]

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

    def state_dict(self) -> dict[str, Any]:
        """Each inner optimizer's own state dict, in order (checkpoints use DCP per part instead)."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(state)
