"""An exponential moving average of the weights (``train.ema_decay``), kept beside the model.

Diffusion models sample noticeably better from averaged weights than from the last step's, so
image and video trainers keep an EMA; any family may use it. Each rank averages its own shard
(FSDP's parameters are DTensors; the average is elementwise, so shards never meet), in fp32,
after every optimizer step. The decay warms up as ``min(decay, (1 + n) / (10 + n))`` after n
updates, so early averages are not dominated by the random initial weights.

The averages are part of the checkpoint (the app state's ``ema`` entry, keyed by parameter
name, saved and resharded by DCP like the weights), and ``swapped`` puts them into the model for
sampling, then restores the trained weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class WeightEMA:
    """Fp32 averages of the trainable parameters of ``parts`` (the model pieces on this rank)."""

    def __init__(self, parts: Sequence[nn.Module], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay={decay} must be in (0, 1), e.g. 0.999; 0 turns the average off")
        self.decay = decay
        self.updates = 0
        self.params = {name: p for part in parts for name, p in part.named_parameters() if p.requires_grad}
        self.averages = {name: p.detach().float().clone() for name, p in self.params.items()}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in (call after each optimizer step)."""
        weight = 1.0 - self.current_decay()
        averages = [_local(self.averages[name]) for name in self.params]
        current = [_local(p).float() for p in self.params.values()]
        torch._foreach_lerp_(averages, current, weight)
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name, plus the update count (DCP fills tensors in place)."""
        return {**self.averages, "updates": torch.tensor(self.updates)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.updates = int(state["updates"])

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Run with the averaged weights in the model; the trained ones come back afterwards."""
        with torch.no_grad():
            saved = {name: _local(p).detach().clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                _local(p).copy_(_local(self.averages[name]))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    _local(p).copy_(saved[name])
