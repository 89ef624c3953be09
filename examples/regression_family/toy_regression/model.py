"""A stack of residual MLP blocks mapping a feature row to its targets.

Plain single-device PyTorch: the model declares its repeated blocks in its ``ParallelPlan``
and the engine shards them with FSDP from outside. Rows are independent samples, so a batch is
just ``x`` of shape [rows, in_features].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from veomni.plugin_api import ParallelPlan

from .config import ToyRegressorConfig


class ResidualMLPBlock(nn.Module):
    def __init__(self, hidden_size: int, expansion: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.up = nn.Linear(hidden_size, hidden_size * expansion)
        self.down = nn.Linear(hidden_size * expansion, hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class ToyRegressor(nn.Module):
    def __init__(self, config: ToyRegressorConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Linear(config.in_features, config.hidden_size)
        self.blocks = nn.ModuleList(ResidualMLPBlock(config.hidden_size, config.expansion)
                                    for _ in range(config.num_blocks))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks=("blocks.*",))

    def init_weights(self) -> None:
        """Normal(0, init_std) matrices, zero biases, unit norms; the engine seeds the global RNG."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.init_std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
