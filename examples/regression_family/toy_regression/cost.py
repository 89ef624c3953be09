"""FLOPs and activation memory of ``ToyRegressor``, per row (the task's unit), from its config.

Counted from the config, not the parameters: under FSDP the model's parameters are shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def matmul_params(model: nn.Module) -> int:
    """Weights of every matrix multiply one row goes through (biases and norms are noise)."""
    c = model.config
    return c.in_features * c.hidden_size + c.num_blocks * 2 * c.hidden_size ** 2 * c.expansion \
        + c.hidden_size * c.out_features


class RegressionCost:
    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        return self.sample_flops(model, int(batch["x"].shape[0]))

    def sample_flops(self, model: nn.Module, units: int) -> float:
        """Forward (2 per weight) plus backward (4 per weight) for each row."""
        return 6.0 * matmul_params(model) * units

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        """Per block: its input (always kept), and unless checkpointed its norm output and the
        inner layer before and after the activation."""
        c = model.config
        inner = 0 if checkpointing == "full" else c.hidden_size + 2 * c.hidden_size * c.expansion
        return bytes_per_elem * c.num_blocks * (c.hidden_size + inner)

    def activated_params(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        return []
