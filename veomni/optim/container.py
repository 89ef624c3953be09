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

    @property
    def state(self) -> dict:  # type: ignore[override]
        """The inner optimizers' per-parameter state, merged (their parameters are disjoint): so
        ``state_dict()`` reads like one optimizer's, ``state`` indexed over ``param_groups``."""
        merged: dict = {}
        for optimizer in self.optimizers:
            merged.update(optimizer.state)
        return merged

    @state.setter
    def state(self, _state: dict) -> None:
        """(``Optimizer.__init__`` assigns its own: the inner optimizers own the state.)"""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of ``state_dict()``: each inner optimizer its own groups and the state of the
        parameters they number (``state_dict`` numbers parameters in order over ``param_groups``)."""
        groups, start = list(state_dict["param_groups"]), 0
        for optimizer in self.optimizers:
            mine, groups = groups[:len(optimizer.param_groups)], groups[len(optimizer.param_groups):]
            count = sum(len(g["params"]) for g in mine)
            optimizer.load_state_dict({
                "state": {i - start: v for i, v in state_dict["state"].items() if start <= i < start + count},
                "param_groups": [{**g, "params": [i - start for i in g["params"]]} for g in mine]})
            start += count
